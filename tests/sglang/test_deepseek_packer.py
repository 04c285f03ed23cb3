"""DeepSeek-V2 family (also DeepSeek-V3, Kimi-K2/K2.5): SGLang collects its captures with an
AuxHiddenStatePacker (capture_gathered path, MLA attention, MoE layers). With the plugin the
packer's output is the persistent buffer and its slots are written by the eagle3 ops."""
import pytest
import torch

PROMPTS = [[5, 17, 3, 99, 42], [7, 1, 64, 23, 88, 120, 11]]
DRAFTS = [[9, 31, 2], [54, 6, 101]]


def _two_forwards(h, model, cfg, dtype):
    kv = h.KVCache(cfg, dtype)
    reqs = [h.Req(kv.new_req()) for _ in PROMPTS]
    ext = h.run(model, h.extend_batch(kv, reqs, PROMPTS), kv)
    ext_aux = ext.hidden_states.clone()
    ext_ptr = ext.hidden_states.data_ptr()
    ver = h.run(model, h.extend_batch(kv, reqs, DRAFTS, mode="TARGET_VERIFY"), kv)
    return ext, ext_aux, ext_ptr, ver


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layer_ids,capture_ids", [([1, 2], [2, 3]), ([0, 1, 3], [0, 1, 3])],
                         ids=["first-id-1-shifted", "ids-as-is-with-embedding"])
def test_packer_path_matches_hf_and_stock(sglang_cpu, layer_ids, capture_ids, dtype):
    h = sglang_cpu
    tol = h.tolerances(dtype)
    cfg = h.FAMILIES["deepseek_v2"].make_config()
    hf = h.hf_model("deepseek_v2", cfg, dtype)
    model = h.sglang_from_hf("deepseek_v2", cfg, dtype, hf)
    from sglang.srt.models.deepseek_v2 import DeepseekV2Model

    assert type(model.model) is DeepseekV2Model

    model.set_eagle3_layers_to_capture(layer_ids)  # stock
    assert model.model.layers_to_capture == capture_ids  # deepseek_v2 adds 1 only if ids start at 1
    s_ext, s_ext_aux, s_ptr, s_ver = _two_forwards(h, model, cfg, dtype)

    h.configure_capture(model, layer_ids)
    from eagle3_ops.sglang.capture_hooks import capture_state

    state = capture_state(model)
    assert state is not None and state.layer_ids == capture_ids
    p_ext, p_ext_aux, p_ptr, p_ver = _two_forwards(h, model, cfg, dtype)

    hf_out = h.hf_hidden_states(hf, [p + d for p, d in zip(PROMPTS, DRAFTS)])
    ref_ext = h.hf_aux(hf_out, capture_ids, [slice(0, len(p)) for p in PROMPTS])
    ref_ver = h.hf_aux(hf_out, capture_ids, [slice(len(p), len(p) + len(d)) for p, d in zip(PROMPTS, DRAFTS)])
    for name, stock, plugin, ref in (("extend", s_ext_aux, p_ext_aux, ref_ext),
                                     ("verify", s_ver.hidden_states, p_ver.hidden_states, ref_ver)):
        torch.testing.assert_close(stock.float(), ref.float(), **tol, msg=f"stock {name} vs HF")
        torch.testing.assert_close(plugin.float(), ref.float(), **tol, msg=f"plugin {name} vs HF")
        h.assert_plugin_matches_stock(plugin, stock, dtype, f"plugin {name} vs stock")
    h.assert_plugin_matches_stock(p_ext.next_token_logits, s_ext.next_token_logits, dtype, "extend logits")
    h.assert_plugin_matches_stock(p_ver.next_token_logits, s_ver.next_token_logits, dtype, "verify logits")

    # stock: the packer allocates a fresh [T, K*H] per forward; plugin: both forwards are the buffer
    buf_ptr = state.buffer.buffer.data_ptr()
    assert s_ptr != buf_ptr and s_ver.hidden_states.data_ptr() != buf_ptr
    assert p_ptr == buf_ptr and p_ver.hidden_states.data_ptr() == buf_ptr
    fused = sum(1 for i in capture_ids if i > 0)
    assert state.stats["buffer_forwards"] == 2
    assert state.stats["fused_captures"] == 2 * fused
    assert state.stats["copied_captures"] == 2 * (len(capture_ids) - fused)
