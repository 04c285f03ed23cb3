"""Target side on SGLang's own gpt-oss code (``sglang.srt.models.gpt_oss``, inner ``GptOssModel``),
CPU, with the same checks as test_target_capture.py (GLM-4.5/4.6 runs there unchanged).

Why gpt-oss needs its own setup: its attention calls the backend with ``sinks=`` (learned per-head
attention sinks), and SGLang 0.5.23's ``TorchNativeAttnBackend`` -- the only SGLang attention
backend that runs on a CPU without SGLang's CPU kernels -- does not take that argument
(``TypeError: TorchNativeAttnBackend.forward_extend() got an unexpected keyword argument 'sinks'``);
the backends that implement sinks (triton, flashinfer, fa3, trtllm_mha, aiter, intel_amx) need a
GPU or sgl_kernel's CPU build. So here, and only here, the attention backend is a test one:
``TorchNativeAttnBackend`` whose extend path, when called with ``sinks``, computes sink attention
in plain torch (Hugging Face's eager gpt-oss formula: the sink logit joins each row's softmax and
is dropped; causal, plus the sliding window on sliding layers). Everything else is SGLang's code
unchanged: the embedding, the q/k/v/o projections with bias, YaRN rotary, the layer boundaries and
their add+RMSNorm, the router and the MoE experts (biased, clamped SwiGLU), the final norm, and the
capture path (``attn_boundary.prepare(capture=AuxHiddenStateList.capture)``) that the plugin
takes over. The attention is not on that path: stock and plugin runs use the same backend, and
Hugging Face's ``output_hidden_states`` (which checks the backend's math too) is the reference.
The prompts are shorter than the sliding window (32), so HF's and SGLang's window conventions
cannot differ.
"""
import pytest
import torch

LAYER_IDS = [0, 1, 2]  # draft-config ids; SGLang adds 1 -> capture [1, 2, 3]
PROMPTS = [[5, 17, 3, 99, 42], [7, 1, 64, 23, 88, 120, 11]]
DRAFTS = [[9, 31, 2, 77], [54, 6, 101, 13]]  # one chain of draft tokens per request


def _sink_backend(kv):
    """The test attention backend (see the module docstring) over ``kv``'s pools."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    class SinkAttnBackend(TorchNativeAttnBackend):
        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None):
            if sinks is None:
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
            if save_kv_cache and k is not None and v is not None:
                self.token_to_kv_pool.set_kv_buffer(
                    layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
            k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
            v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
            heads, kv_heads, dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
            q = q.reshape(-1, heads, dim)
            out = q.new_empty(q.shape[0], heads, layer.v_head_dim)
            window = layer.sliding_window_size
            start = 0
            for i in range(forward_batch.batch_size):
                prefix = int(forward_batch.extend_prefix_lens[i])
                n = int(forward_batch.extend_seq_lens[i])
                locs = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices[i], :prefix + n]
                # GQA as HF's repeat_kv: kv head j serves query heads j*g .. j*g+g-1
                key = k_cache[locs].float().repeat_interleave(heads // kv_heads, dim=1)
                value = v_cache[locs].float().repeat_interleave(heads // kv_heads, dim=1)
                scores = torch.einsum("qhd,khd->hqk", q[start:start + n].float(), key) * layer.scaling
                q_pos = torch.arange(prefix, prefix + n)[:, None]
                k_pos = torch.arange(prefix + n)[None, :]
                allowed = k_pos <= q_pos
                if window is not None and window > -1:  # SGLang's size: HF's window - 1 (query not counted)
                    allowed &= k_pos >= q_pos - window
                scores = scores.masked_fill(~allowed, float("-inf"))
                sink = sinks.float()[:, None, None].expand(heads, n, 1)
                logits = torch.cat([scores, sink], dim=-1)
                probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
                out[start:start + n] = torch.einsum("hqk,khd->qhd", probs, value).to(out.dtype)
                start += n
            return out.reshape(-1, heads * layer.v_head_dim)

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None):
            if sinks is not None:
                raise NotImplementedError("test backend: sink attention for DECODE batches is not needed here")
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

    return SinkAttnBackend(kv)


def _kv_cache(h, cfg, dtype):
    kv = h.KVCache(cfg, dtype)
    kv.backend = _sink_backend(kv)
    return kv


def _gpt_oss(h, dtype):
    cfg = h.FAMILIES["gpt_oss"].make_config()
    hf = h.hf_model("gpt_oss", cfg, dtype)
    with torch.no_grad():
        # visible sinks (HF's init is N(0, 0.02): too small to tell a dropped one), bf16 values: SGLang
        # keeps sinks in bf16 (fp32 only for trtllm_mha), which would round fp32 ones
        for layer in hf.model.layers:
            layer.self_attn.sinks.copy_(torch.randn_like(layer.self_attn.sinks).to(torch.bfloat16))
    model = h.sglang_from_hf("gpt_oss", cfg, dtype, hf)
    from sglang.srt.models.gpt_oss import GptOssModel

    assert type(model.model) is GptOssModel
    return cfg, hf, model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpt_oss_captures_match_hf_and_logits_match_stock(sglang_cpu, fused_norm_qualified, dtype):
    h = sglang_cpu
    cfg, hf, model = _gpt_oss(h, dtype)

    model.set_eagle3_layers_to_capture(LAYER_IDS)  # stock
    capture_ids = list(model.model.layers_to_capture)
    assert capture_ids == [i + 1 for i in LAYER_IDS]
    stock = h.two_forwards(model, cfg, dtype, PROMPTS, DRAFTS, kv=_kv_cache(h, cfg, dtype))

    h.configure_capture(model, LAYER_IDS)  # what ModelRunner does; the plugin installs here
    from eagle3_ops.sglang.capture_hooks import capture_state

    state = capture_state(model)
    assert state is not None and state.layer_ids == capture_ids
    plugin = h.two_forwards(model, cfg, dtype, PROMPTS, DRAFTS, kv=_kv_cache(h, cfg, dtype))
    h.assert_captures_match_hf_and_stock(stock, plugin, hf, capture_ids, PROMPTS, DRAFTS, dtype, cfg.hidden_size)
    K = len(capture_ids)
    s_ptr, s_ver, p_ptr, p_ver = stock[2], stock[3], plugin[2], plugin[3]

    # the plugin path ran: both forwards packed into the persistent buffer; gpt-oss's input norms
    # are plain RMSNorms called as norm(hidden, residual) whose residual SGLang captures (learned in
    # the EXTEND, whose captures are copies), so every VERIFY capture is fused
    assert state.fused_sites == [f"model.layers.{i}.input_layernorm" for i in capture_ids]
    assert state.stats["buffer_forwards"] == 2 and state.stats["stock_forwards"] == 0
    assert state.stats["fused_captures"] == K and state.stats["copied_captures"] == K
    buf_ptr = state.buffer.buffer.data_ptr()
    assert s_ptr != buf_ptr and s_ver.hidden_states.data_ptr() != buf_ptr
    assert p_ptr == buf_ptr and p_ver.hidden_states.data_ptr() == buf_ptr


def test_gpt_oss_end_boundary_capture_is_a_buffer_slot(sglang_cpu, fused_norm_qualified):
    """gpt-oss (unlike the other families) can capture boundary L, the last layer's output, which
    SGLang records at the final norm (``residual_batch.final_norm(..., capture=...)``). That
    boundary is the buffer's last slot; values: HF (boundary L before the final norm) and bitwise
    stock."""
    h = sglang_cpu
    dtype = torch.float32
    cfg, hf, model = _gpt_oss(h, dtype)
    L = cfg.num_hidden_layers
    layer_ids = [0, 1, L - 1]  # SGLang adds 1 -> capture [1, 2, L]
    model.set_eagle3_layers_to_capture(layer_ids)
    assert model.model.layers_to_capture == [1, 2, L]
    stock = h.two_forwards(model, cfg, dtype, PROMPTS, DRAFTS, kv=_kv_cache(h, cfg, dtype))

    h.configure_capture(model, layer_ids)
    from eagle3_ops.sglang.capture_hooks import capture_state

    state = capture_state(model)
    assert state is not None and state.layer_ids == [1, 2, L]  # boundary L is the last slot
    plugin = h.two_forwards(model, cfg, dtype, PROMPTS, DRAFTS, kv=_kv_cache(h, cfg, dtype))

    refs = h.hf_refs_with_last(hf, PROMPTS, DRAFTS)  # boundaries 1, 2 and L
    h.assert_captures_match_hf_and_stock(stock, plugin, hf, [1, 2, L], PROMPTS, DRAFTS, dtype, cfg.hidden_size,
                                         refs=refs)
    p_ver = plugin[3]

    assert state.stats["buffer_forwards"] == 2 and state.stats["stock_forwards"] == 0
    # SGLang captures boundary L as the residual its final norm returns: learned by identity like the
    # layers' input norms, so the VERIFY writes all three slots from fused add+RMSNorms
    assert state.fused_sites == ["model.layers.1.input_layernorm", "model.layers.2.input_layernorm", "model.norm"]
    assert state.stats["fused_captures"] == 3 and state.stats["copied_captures"] == 3
    assert p_ver.hidden_states.data_ptr() == state.buffer.buffer.data_ptr()
