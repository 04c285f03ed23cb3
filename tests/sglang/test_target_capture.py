"""Target side on SGLang's own llama / qwen2 / qwen3 / qwen3_moe / glm4_moe code (CPU, torch_native).

For each family and dtype the same SGLang model runs an EXTEND and then a TARGET_VERIFY (chain of
draft tokens, prefix in the KV cache) twice: stock (capture configured with SGLang's
set_eagle3_layers_to_capture only) and with the plugin (configured through SGLang's
configure_aux_hidden_state_capture, which the plugin hooks). Both are checked against Hugging Face
``output_hidden_states`` at the capture indices (within the dtype's tolerance), and the plugin's
captures and logits against stock (bitwise with the reference backend, see
``harness.assert_plugin_matches_stock``).
"""
import pytest
import torch

LAYER_IDS = [0, 1, 2]  # draft-config ids; SGLang adds 1 for these families -> capture [1, 2, 3]
PROMPTS = [[5, 17, 3, 99, 42], [7, 1, 64, 23, 88, 120, 11]]
DRAFTS = [[9, 31, 2, 77], [54, 6, 101, 13]]  # one chain of draft tokens per request
TOKENS = sum(map(len, PROMPTS))


def _two_forwards(h, model, cfg, dtype):
    """EXTEND the prompts, then TARGET_VERIFY the draft chains on top (fresh KV cache)."""
    kv = h.KVCache(cfg, dtype)
    reqs = [h.Req(kv.new_req()) for _ in PROMPTS]
    ext = h.run(model, h.extend_batch(kv, reqs, PROMPTS), kv)
    ext_aux = ext.hidden_states.clone()
    ver = h.run(model, h.extend_batch(kv, reqs, DRAFTS, mode="TARGET_VERIFY"), kv)
    return ext, ext_aux, ver


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe"])
def test_captures_match_hf_and_logits_match_stock(sglang_cpu, family, dtype):
    h = sglang_cpu
    cfg = h.FAMILIES[family].make_config()
    hf = h.hf_model(family, cfg, dtype)
    model = h.sglang_from_hf(family, cfg, dtype, hf)
    tol = h.tolerances(dtype)

    model.set_eagle3_layers_to_capture(LAYER_IDS)  # stock
    capture_ids = list(model.model.layers_to_capture)
    assert capture_ids == [i + 1 for i in LAYER_IDS]
    s_ext, s_ext_aux, s_ver = _two_forwards(h, model, cfg, dtype)

    h.configure_capture(model, LAYER_IDS)  # what ModelRunner does; the plugin installs here
    from eagle3_ops.sglang.capture_hooks import capture_state

    state = capture_state(model)
    assert state is not None and state.layer_ids == capture_ids
    p_ext, p_ext_aux, p_ver = _two_forwards(h, model, cfg, dtype)

    hf_out = h.hf_hidden_states(hf, [p + d for p, d in zip(PROMPTS, DRAFTS)])
    ref_ext = h.hf_aux(hf_out, capture_ids, [slice(0, len(p)) for p in PROMPTS])
    ref_ver = h.hf_aux(hf_out, capture_ids, [slice(len(p), len(p) + len(d)) for p, d in zip(PROMPTS, DRAFTS)])
    K, H = len(capture_ids), cfg.hidden_size
    for name, stock, plugin, ref in (("extend", s_ext_aux, p_ext_aux, ref_ext),
                                     ("verify", s_ver.hidden_states, p_ver.hidden_states, ref_ver)):
        assert plugin.shape == stock.shape == ref.shape == (ref.shape[0], K * H), name
        torch.testing.assert_close(stock.float(), ref.float(), **tol, msg=f"stock {name} vs HF")
        torch.testing.assert_close(plugin.float(), ref.float(), **tol, msg=f"plugin {name} vs HF")
        h.assert_plugin_matches_stock(plugin, stock, dtype, f"plugin {name} vs stock")

    # logits unchanged by the plugin (EXTEND: last token per request; VERIFY: every draft position)
    h.assert_plugin_matches_stock(p_ext.next_token_logits, s_ext.next_token_logits, dtype, "extend logits")
    h.assert_plugin_matches_stock(p_ver.next_token_logits, s_ver.next_token_logits, dtype, "verify logits")
    ref_last = torch.stack([logits[len(p) - 1] for (_, logits), p in zip(hf_out, PROMPTS)])
    torch.testing.assert_close(p_ext.next_token_logits.float(), ref_last.float(), **tol)

    # the plugin path ran: both forwards packed into the persistent buffer, captures at layers > 0
    # written by the fused add+RMSNorm
    assert state.stats["buffer_forwards"] == 2 and state.stats["stock_forwards"] == 0
    assert state.stats["fused_captures"] == 2 * K and state.stats["copied_captures"] == 0
    assert p_ver.hidden_states.data_ptr() == state.buffer.buffer.data_ptr()


def test_embedding_capture_is_copied_and_rest_fused(sglang_cpu):
    """Capture index 0 (embedding output: no add at the boundary) is a copy; the others are fused."""
    h = sglang_cpu
    dtype = torch.float32
    cfg = h.FAMILIES["llama"].make_config()
    hf = h.hf_model("llama", cfg, dtype)
    model = h.sglang_from_hf("llama", cfg, dtype, hf)
    h.configure_capture(model, [-1, 1])  # SGLang maps to capture indices [0, 2]
    from eagle3_ops.sglang.capture_hooks import capture_state

    state = capture_state(model)
    assert state.layer_ids == [0, 2] and state.fused_sites == ["model.layers.2.input_layernorm"]
    kv = h.KVCache(cfg, dtype)
    reqs = [h.Req(kv.new_req()) for _ in PROMPTS]
    out = h.run(model, h.extend_batch(kv, reqs, PROMPTS), kv)
    ref = h.hf_aux(h.hf_hidden_states(hf, PROMPTS), [0, 2], [slice(None)] * len(PROMPTS))
    torch.testing.assert_close(out.hidden_states, ref, **h.tolerances(dtype))
    assert state.stats["copied_captures"] == 1 and state.stats["fused_captures"] == 1
