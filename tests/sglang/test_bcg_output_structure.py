"""SGLang's breakable prefill CUDA graphs (BCG, on by default on CUDA) allocate ONE output buffer
from the largest bucket's output and copy every bucket's output into it with
``BreakableCudaGraphBackend._copy_output_to_buffer``, which refuses a tensor where the buffer holds
a list. With EAGLE3_OPS_SGLANG_MAX_TOKENS below the largest bucket, that bucket's forward does not
fit the capture buffer; it must still return a packed tensor, as the smaller buckets do.

SGLang's own ``_alloc_full_buffer`` / ``_copy_output_to_buffer`` are called on the inner model's
real outputs (the BCG captures ``layer_model.forward``, the inner LlamaModel): no CUDA graph is
needed to reproduce the structure check, which is plain Python."""
import pytest
import torch

LAYER_IDS = [0, 1, 2]
BIG = [[1, 2, 3, 4, 5, 6, 7, 8]]   # the "largest bucket": 8 tokens, more than the 6-row buffer
SMALL = [[9, 10, 11, 12]]          # a smaller bucket that fits


def _bcg():
    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import BreakableCudaGraphBackend

    return BreakableCudaGraphBackend.__new__(BreakableCudaGraphBackend)  # the two methods use no state


@pytest.fixture
def models(sglang_cpu, monkeypatch):
    h = sglang_cpu
    dtype = torch.float32
    cfg = h.FAMILIES["llama"].make_config()
    hf = h.hf_model("llama", cfg, dtype)
    stock = h.sglang_from_hf("llama", cfg, dtype, hf)
    stock.set_eagle3_layers_to_capture(LAYER_IDS)
    monkeypatch.setenv("EAGLE3_OPS_SGLANG_MAX_TOKENS", "6")
    plugin = h.sglang_from_hf("llama", cfg, dtype, hf)
    h.configure_capture(plugin, LAYER_IDS)
    return h, cfg, dtype, stock, plugin


def test_a_list_in_one_bucket_and_a_tensor_in_another_is_what_crashes(models):
    """The crash the issue reported, reproduced with SGLang's functions: the largest bucket ran
    SGLang's list path, a smaller one returns a packed tensor."""
    h, cfg, dtype, stock, plugin = models
    bcg = _bcg()
    big_stock = h.inner_forward(stock, cfg, dtype, BIG)
    assert isinstance(big_stock[1], list)  # stock SGLang: an AuxHiddenStateList
    buffer = bcg._alloc_full_buffer(big_stock, 8)
    small = h.inner_forward(plugin, cfg, dtype, SMALL)
    assert torch.is_tensor(small[1])
    with pytest.raises(TypeError, match="Unsupported BCG output buffer pair"):
        bcg._copy_output_to_buffer(small, buffer, 4)


def test_every_bucket_returns_one_packed_tensor(models):
    h, cfg, dtype, stock, plugin = models
    from eagle3_ops.sglang.capture_hooks import capture_state

    state = capture_state(plugin)
    bcg = _bcg()
    big = h.inner_forward(plugin, cfg, dtype, BIG)          # does not fit: stock capture, packed
    assert torch.is_tensor(big[1]) and big[1].data_ptr() != state.buffer.buffer.data_ptr()
    big_stock = h.inner_forward(stock, cfg, dtype, BIG)
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

    assert torch.equal(big[1], pack_aux_hidden_states(big_stock[1]))  # what SGLang would have packed
    buffer = bcg._alloc_full_buffer(big, 8)
    bcg._copy_output_to_buffer(big, buffer, 8)
    small = h.inner_forward(plugin, cfg, dtype, SMALL)      # fits: the persistent buffer's view
    assert small[1].data_ptr() == state.buffer.buffer.data_ptr()
    bcg._copy_output_to_buffer(small, buffer, 4)              # no TypeError any more
    small_stock = h.inner_forward(stock, cfg, dtype, SMALL)
    assert torch.equal(buffer[1][:4], pack_aux_hidden_states(small_stock[1]))
    assert state.stats["stock_forwards"] == 1 and state.stats["buffer_forwards"] == 1
