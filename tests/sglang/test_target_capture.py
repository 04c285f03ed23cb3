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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe"])
def test_captures_match_hf_and_logits_match_stock(sglang_cpu, fused_norm_qualified, family, dtype):
    h = sglang_cpu
    cfg = h.FAMILIES[family].make_config()
    hf = h.hf_model(family, cfg, dtype)
    model = h.sglang_from_hf(family, cfg, dtype, hf)

    model.set_eagle3_layers_to_capture(LAYER_IDS)  # stock
    capture_ids = list(model.model.layers_to_capture)
    assert capture_ids == [i + 1 for i in LAYER_IDS]
    stock = h.two_forwards(model, cfg, dtype, PROMPTS, DRAFTS)

    h.configure_capture(model, LAYER_IDS)  # what ModelRunner does; the plugin installs here
    from eagle3_ops.sglang.capture_hooks import capture_state

    state = capture_state(model)
    assert state is not None and state.layer_ids == capture_ids
    plugin = h.two_forwards(model, cfg, dtype, PROMPTS, DRAFTS)
    h.assert_captures_match_hf_and_stock(stock, plugin, hf, capture_ids, PROMPTS, DRAFTS, dtype, cfg.hidden_size)
    K, p_ver = len(capture_ids), plugin[3]

    # the plugin path ran: both forwards packed into the persistent buffer; the EXTEND's captures are
    # copies, from which the plugin learned (by identity) which norm call's residual SGLang captures;
    # the VERIFY's are written by the fused add+RMSNorm there (qualified here: bitwise SGLang's norm)
    assert state.stats["buffer_forwards"] == 2 and state.stats["stock_forwards"] == 0
    assert state.stats["copied_captures"] == K and state.stats["fused_captures"] == K
    assert state.fused_sites == [f"model.layers.{i}.input_layernorm" for i in capture_ids]
    assert p_ver.hidden_states.data_ptr() == state.buffer.buffer.data_ptr()


def test_embedding_capture_is_copied_and_rest_fused(sglang_cpu, fused_norm_qualified):
    """Capture index 0 (embedding output: no add at the boundary) is a copy; the others are fused."""
    h = sglang_cpu
    dtype = torch.float32
    cfg = h.FAMILIES["llama"].make_config()
    hf = h.hf_model("llama", cfg, dtype)
    model = h.sglang_from_hf("llama", cfg, dtype, hf)
    h.configure_capture(model, [-1, 1])  # SGLang maps to capture indices [0, 2]
    from eagle3_ops.sglang.capture_hooks import capture_state

    state = capture_state(model)
    assert state.layer_ids == [0, 2] and state.fused_sites == []  # nothing learned before a forward
    ref = h.hf_aux(h.hf_hidden_states(hf, PROMPTS), [0, 2], [slice(None)] * len(PROMPTS))
    for _ in range(2):
        kv = h.KVCache(cfg, dtype)
        out = h.run(model, h.extend_batch(kv, [h.Req(kv.new_req()) for _ in PROMPTS], PROMPTS), kv)
        torch.testing.assert_close(out.hidden_states, ref, **h.tolerances(dtype))
    assert state.fused_sites == ["model.layers.2.input_layernorm"]
    assert state.stats["copied_captures"] == 2 + 1 and state.stats["fused_captures"] == 1


def test_a_family_reading_layer_flags_wraps_negative_ids_and_the_plugin_follows(sglang_cpu):
    """Qwen3-MoE's set_eagle3_layers_to_capture flags ``self.layers[id + 1]``, and its forward reads the flags:
    id -2 -> layers[-1] = the last layer's entry (boundary L-1), a capture SGLang really takes. The plugin lays
    its buffer out for the flagged boundaries (not the raw list's -1), and serves them bitwise stock."""
    h = sglang_cpu
    from eagle3_ops.sglang.capture_hooks import capture_state, configured_captures, unslotted_ids

    dtype = torch.float32
    cfg = h.FAMILIES["qwen3_moe"].make_config()
    hf = h.hf_model("qwen3_moe", cfg, dtype)
    model = h.sglang_from_hf("qwen3_moe", cfg, dtype, hf)
    L = cfg.num_hidden_layers
    model.set_eagle3_layers_to_capture([-2, 0, 1])  # stock
    assert list(model.model.layers_to_capture) == [-1, 1, 2]
    assert configured_captures(model.model) == [L - 1, 1, 2] and unslotted_ids(model.model) == []
    stock = h.two_forwards(model, cfg, dtype, PROMPTS, DRAFTS)
    assert stock[1].shape[-1] == 3 * cfg.hidden_size, "SGLang captures three states"

    h.configure_capture(model, [-2, 0, 1])
    state = capture_state(model)
    assert state is not None and state.layer_ids == [1, 2, L - 1]
    plugin = h.two_forwards(model, cfg, dtype, PROMPTS, DRAFTS)
    h.assert_captures_match_hf_and_stock(stock, plugin, hf, [1, 2, L - 1], PROMPTS, DRAFTS, dtype, cfg.hidden_size)


@pytest.mark.parametrize("ids,lost", [([-1, 1, 2], [-1]), ([2, 2, 3], [2])], ids=["uncaptured-id", "repeated-id"])
def test_fewer_slots_than_sglang_counts_stays_stock(sglang_cpu, caplog, ids, lost):
    """DeepSeek's rule takes ids as boundaries (first id not 1): -1 is never captured and a repeated id is
    captured once, but SGLang's packer counts every entry. The plugin lays out no buffer with fewer slots (one
    line); SGLang's own error stands, at the first forward, as it would without the plugin."""
    h = sglang_cpu
    from eagle3_ops.sglang.capture_hooks import capture_state

    cfg = h.FAMILIES["deepseek_v2"].make_config()
    model = h.sglang_model("deepseek_v2", cfg, torch.float32)
    with caplog.at_level("WARNING", logger="eagle3_ops.sglang"):
        h.configure_capture(model, ids)
    assert capture_state(model) is None
    lines = [r.getMessage() for r in caplog.records if "capture left stock" in r.getMessage()]
    assert len(lines) == 1 and f"layers_to_capture {ids} (3 captures)" in lines[0] and f": {lost} has no slot" in \
        lines[0], caplog.text
    with pytest.raises(RuntimeError, match="captured 2 of 3 aux hidden states"):
        kv = h.KVCache(cfg, torch.float32)
        h.run(model, h.extend_batch(kv, [h.Req(kv.new_req())], [PROMPTS[0]]), kv)
