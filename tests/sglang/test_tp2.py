"""TP=2 on CPU (two gloo processes running SGLang's LlamaForCausalLM): with the plugin the captures
are the post-all-reduce residual stream — bitwise equal on both ranks and equal to TP=1 and to
Hugging Face within rounding (a per-rank partial sum would be far off) — and captures and logits are
those of stock SGLang on the same rank (bitwise with the reference backend)."""
import torch


def test_tp2_captures_post_all_reduce_and_logits_unchanged(sglang_cpu, tmp_path):
    h = sglang_cpu
    ranks, _ = h.run_ranks("tp2_worker.py", tmp_path)
    from tp2_worker import DRAFTS, LAYER_IDS, PROMPTS, two_forwards  # noqa: F401

    for dtype in (torch.float32, torch.bfloat16):
        key = str(dtype)
        tol = h.tolerances(dtype)
        r0, r1 = ranks[0][key], ranks[1][key]
        cfg = h.FAMILIES["llama"].make_config()
        hf = h.hf_model("llama", cfg, dtype)
        tp1_model = h.sglang_from_hf("llama", cfg, dtype, hf)
        h.configure_capture(tp1_model, LAYER_IDS)
        tp1 = two_forwards(tp1_model, cfg, dtype, 1)
        capture_ids = [i + 1 for i in LAYER_IDS]
        hf_out = h.hf_hidden_states(hf, [p + d for p, d in zip(PROMPTS, DRAFTS)])
        ref = {"extend_aux": h.hf_aux(hf_out, capture_ids, [slice(0, len(p)) for p in PROMPTS]),
               "verify_aux": h.hf_aux(hf_out, capture_ids,
                                      [slice(len(p), len(p) + len(d)) for p, d in zip(PROMPTS, DRAFTS)])}
        for name in ("extend_aux", "verify_aux"):
            assert torch.equal(r0["plugin"][name], r1["plugin"][name]), f"{key} {name}: ranks differ"
            torch.testing.assert_close(r0["plugin"][name], tp1[name], **tol, msg=f"{key} {name} vs TP=1")
            torch.testing.assert_close(r0["plugin"][name].float(), ref[name].float(), **tol,
                                       msg=f"{key} {name} vs HF")
        for r in (r0, r1):
            for name in ("extend_aux", "verify_aux", "extend_logits", "verify_logits"):
                h.assert_plugin_matches_stock(r["plugin"][name], r["stock"][name], dtype, f"{key} {name}",
                                              reference=r["reference_only"])
            assert r["stats"]["buffer_forwards"] == 2 and r["stats"]["fused_captures"] == 6

    # the states dump at TP=2: each rank knows its place, rank 0 alone keeps values and writes; the
    # next tokens (argmax over the two vocab shards, gathered) are HF's greedy tokens
    assert [r["dump"]["tp_rank"] for r in ranks] == [0, 1] and all(r["dump"]["tp_size"] == 2 for r in ranks)
    assert [r["dump"]["keeps_values"] for r in ranks] == [True, False]
    assert all(r["dump"]["done"] for r in ranks)
    from eagle3_ops.doctor.states import read_states

    cfg = h.FAMILIES["llama"].make_config()
    hf = h.hf_model("llama", cfg, torch.float32)
    states = read_states(tmp_path / "states.safetensors", num_layers=cfg.num_hidden_layers,
                         hidden_size=cfg.hidden_size)
    assert [p["input_ids"].tolist() for p in states.prompts] == PROMPTS
    for p, (hs, logits) in zip(states.prompts, h.hf_hidden_states(hf, PROMPTS)):
        assert torch.equal(p["next_token"], logits.argmax(-1))
        for b in states.boundaries:
            if b < cfg.num_hidden_layers:  # boundary L is before the final norm; HF's last is after it
                torch.testing.assert_close(p["boundaries"][b], hs[b].float(), atol=1e-4, rtol=1e-4)
