"""DeepSeek-V2 family (also DeepSeek-V3, Kimi-K2/K2.5): SGLang collects its captures with an
AuxHiddenStatePacker (capture_gathered path, MLA attention, MoE layers). With the plugin the
packer's output is the persistent buffer and its slots are written by the eagle3 ops."""
import pytest
import torch

PROMPTS = [[5, 17, 3, 99, 42], [7, 1, 64, 23, 88, 120, 11]]
DRAFTS = [[9, 31, 2], [54, 6, 101]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layer_ids,capture_ids", [([1, 2], [2, 3]), ([0, 1, 3], [0, 1, 3])],
                         ids=["first-id-1-shifted", "ids-as-is-with-embedding"])
def test_packer_path_matches_hf_and_stock(sglang_cpu, fused_norm_qualified, layer_ids, capture_ids, dtype):
    h = sglang_cpu
    cfg = h.FAMILIES["deepseek_v2"].make_config()
    hf = h.hf_model("deepseek_v2", cfg, dtype)
    model = h.sglang_from_hf("deepseek_v2", cfg, dtype, hf)
    from sglang.srt.models.deepseek_v2 import DeepseekV2Model

    assert type(model.model) is DeepseekV2Model

    model.set_eagle3_layers_to_capture(layer_ids)  # stock
    assert model.model.layers_to_capture == capture_ids  # deepseek_v2 adds 1 only if ids start at 1
    stock = h.two_forwards(model, cfg, dtype, PROMPTS, DRAFTS)

    h.configure_capture(model, layer_ids)
    from eagle3_ops.sglang.capture_hooks import capture_state

    state = capture_state(model)
    assert state is not None and state.layer_ids == capture_ids
    plugin = h.two_forwards(model, cfg, dtype, PROMPTS, DRAFTS)
    h.assert_captures_match_hf_and_stock(stock, plugin, hf, capture_ids, PROMPTS, DRAFTS, dtype, cfg.hidden_size)
    s_ptr, s_ver, p_ptr, p_ver = stock[2], stock[3], plugin[2], plugin[3]

    # stock: the packer allocates a fresh [T, K*H] per forward; plugin: both forwards are the buffer
    buf_ptr = state.buffer.buffer.data_ptr()
    assert s_ptr != buf_ptr and s_ver.hidden_states.data_ptr() != buf_ptr
    assert p_ptr == buf_ptr and p_ver.hidden_states.data_ptr() == buf_ptr
    # the EXTEND copies every capture and learns which norm's residual SGLang captures (by identity);
    # the VERIFY then runs the fused add+RMSNorm there (qualified: bitwise SGLang's norm); the
    # embeddings (capture index 0: no add at that boundary) stay a copy
    fused = sum(1 for i in capture_ids if i > 0)
    assert state.fused_sites == [f"model.layers.{i}.input_layernorm" for i in capture_ids if i > 0]
    assert state.stats["buffer_forwards"] == 2
    assert state.stats["fused_captures"] == fused
    assert state.stats["copied_captures"] == len(capture_ids) + (len(capture_ids) - fused)
