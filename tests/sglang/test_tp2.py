"""TP=2 on CPU: two gloo processes running SGLang's own LlamaForCausalLM (target) and llama_eagle3 (draft),
one pair of processes for every multi-rank behaviour (tp2_worker.py says what each scenario does).

Target: the captures are the post-all-reduce residual stream (bitwise equal on both ranks, equal to TP=1
and to Hugging Face within rounding; a per-rank partial sum would be far off), the fused norm serves
where qualified and the target's captures and logits are bitwise stock; a failing qualification on
rank 1 leaves SGLang's norm on both ranks. Draft: the sharded fc (each rank its rows, the replicated
weight released) gives the replicated fc's outputs with exactly one added all-gather per draft
extend; the sharding decision is the max of every rank's timings and is cached; a failure on rank 1
at any install step leaves SGLang's stock fc on both ranks (and the test finishing shows no rank was
left waiting); a draft in an attention-TP group of its own (DP attention) is not sharded. The live
wiring check: both ranks record in lockstep, rank 0 alone scores and warns."""
import torch

from tp2_worker import DRAFTS, FAILURE_STEPS, LAYER_IDS, PROMPTS, TARGET_FAILURE_STEPS, two_forwards  # noqa: F401

OUTPUTS = ("fc_out", "extend_logits", "extend_hidden", "decode_logits", "decode_hidden")


def _checkpoint(draft, dcfg):
    """The draft's weights in checkpoint naming (SGLang's fused qkv / gate_up split back)."""
    heads, kv_heads = dcfg.num_attention_heads, dcfg.num_key_value_heads
    head_dim = dcfg.hidden_size // heads
    out = {}
    for name, t in draft.state_dict().items():
        t = t.detach().float().clone()
        if name.endswith("qkv_proj.weight"):
            q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
            for part, w in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[name.replace("qkv_proj", part)] = w.clone()
        elif name.endswith("gate_up_proj.weight"):
            gate, up = t.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.clone()
            out[name.replace("gate_up_proj", "up_proj")] = up.clone()
        else:
            out[name] = t
    return out


def _same(a, b, dtype, msg, reference):
    import harness

    harness.assert_plugin_matches_stock(a, b, dtype, msg, reference=reference)


def test_tp2(sglang_cpu, tmp_path):
    h = sglang_cpu
    cfg = h.FAMILIES["llama"].make_config()
    dcfg = h.eagle3_draft_config(cfg, layer_ids=LAYER_IDS, fc_norm=True, norm_before_fc=True)
    dcfg.bias = True  # llama_eagle3 reads config.bias for fc: the bias rows are sharded too
    ckpt = _checkpoint(h.eagle3_draft(dcfg, torch.float32, seed=3), dcfg)
    aux = torch.randn(12, len(LAYER_IDS) * cfg.hidden_size, generator=torch.Generator().manual_seed(11))
    from eagle3_ops.doctor.tiny import build_tiny_pair

    pair = build_tiny_pair(tmp_path.parent.parent / "doctor_tiny_pair")
    from doctor_fixtures import copy_draft_with_ids

    miswired = copy_draft_with_ids(pair, tmp_path / "miswired", nested=[1, 3, 5])
    wiring = {"target": str(pair.target_dir), "draft": str(miswired), "prompts": str(pair.prompts_file)}
    torch.save({"ckpt": ckpt, "aux": aux, "dcfg": dcfg, "wiring": wiring}, tmp_path / "inputs.pt")

    ranks, logs = h.run_ranks("tp2_worker.py", tmp_path)
    ref_only = [r["reference_only"] for r in ranks]
    assert all(ref_only)  # the rank processes serve the reference backend (bitwise comparisons below)
    _check_target(h, ranks)
    _check_dump(h, ranks, tmp_path)
    _check_wiring(ranks)
    _check_draft(h, ranks, logs, ckpt, dcfg)


def _check_wiring(ranks):
    """The live wiring check at TP=2: both ranks recorded the same boundaries and closed after the same
    forward; rank 0 alone scored (the trained wiring [3, 5, 7] over the served [2, 4, 6]) and wrote the
    verdict; rank 1 started nothing."""
    w0, w1 = ranks[0]["wiring"], ranks[1]["wiring"]
    assert w0["boundaries"] == w1["boundaries"] and w0["done"] and w1["done"]
    assert w0["phase"] == "done" and w0["thread"] and w0["result_file"], w0
    assert w0["verdict"]["verdict"] == "WARNING" and w0["verdict"]["best"]["boundaries"] == [3, 5, 7], w0
    assert w0["verdict"]["configured"]["boundaries"] == [2, 4, 6]
    assert w1["phase"] == "done" and not w1["thread"] and w1["verdict"] is None and not w1["result_file"], w1
    f0, f1 = ranks[0]["wiring_failure"], ranks[1]["wiring_failure"]
    assert f0["done"] and f1["done"], "both ranks closed the recording after the same forward"
    assert f0["phase"] == "failed" and "injected on rank 0" in f0["failure"], f0
    assert f1["phase"] == "done" and f1["failure"] is None, f1


def _check_target(h, ranks):
    for dtype in (torch.float32, torch.bfloat16):
        key, tol = str(dtype), h.tolerances(dtype)
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
        r0, r1 = (r[("target", key, "fused")] for r in ranks)
        for name in ("extend_aux", "verify_aux"):
            assert torch.equal(r0["plugin"][name], r1["plugin"][name]), f"{key} {name}: ranks differ"
            torch.testing.assert_close(r0["plugin"][name], tp1[name], **tol, msg=f"{key} {name} vs TP=1")
            torch.testing.assert_close(r0["plugin"][name].float(), ref[name].float(), **tol, msg=f"{key} {name} vs HF")
        for variant in ("fused", "norm-qualification-fails-on-rank-1"):
            plans = [r[("target", key, variant)]["norm_plan"] for r in ranks]
            assert plans[0] == plans[1], (variant, plans)  # one decision on every rank
            for r in ranks:
                t = r[("target", key, variant)]
                for name in ("extend_aux", "verify_aux", "extend_logits", "verify_logits"):
                    assert torch.equal(t["plugin"][name], t["stock"][name]), f"{key} {variant} {name}: not stock"
                assert t["stats"]["buffer_forwards"] == 2
                if variant == "fused":  # the EXTEND learns which norms' residuals are captured, the VERIFY fuses
                    assert all(b == "reference" for _, b in t["norm_plan"]), t["norm_plan"]
                    assert t["stats"]["fused_captures"] == 3 and t["stats"]["copied_captures"] == 3
                else:  # rank 1's qualification failed: SGLang's norm on both ranks
                    assert all(b is None for _, b in t["norm_plan"]), t["norm_plan"]
                    assert t["stats"]["fused_captures"] == 0 and t["stats"]["copied_captures"] == 6
        # the capture's install failed on rank 1 alone before any collective: stock on both ranks, none waiting
        for step in TARGET_FAILURE_STEPS:
            for r in ranks:
                t = r[("target", key, f"fails-at-{step}")]
                assert not t["installed"], (key, step)
                for name in ("extend_aux", "verify_aux", "extend_logits", "verify_logits"):
                    assert torch.equal(t["plugin"][name], t["stock"][name]), f"{key} fails-at-{step} {name}"


def _check_dump(h, ranks, tmp_path):
    """The states dump at TP=2: each rank knows its place, rank 0 alone keeps values and writes; the
    next tokens (argmax over the two vocab shards, gathered) are HF's greedy tokens."""
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


def _check_draft(h, ranks, logs, ckpt, dcfg):
    N, KH = ckpt["model.fc.weight"].shape
    for dtype in (torch.float32, torch.bfloat16):
        key = str(dtype)
        for r, res in enumerate(ranks):
            stock, sharded = res[("draft", key, "stock")], res[("draft", key, "sharded")]
            # each rank holds only its rows (the replicated weight released), one added all-gather per
            # draft extend, none per decode step, and the replicated fc's outputs (within the dtype's
            # tolerance of stock: the fused fc keeps the normed input in fp32)
            assert sharded["fc_class"] == "ColumnShardedFc" and sharded["rows"] == (r * N // 2, N // 2), logs[r][-3000:]
            assert sharded["rows_match_checkpoint"] and sharded["released"]
            assert sharded["fc_weight_shape"] == (N // 2, KH)
            assert sharded["extend_gathers"] == stock["extend_gathers"] + 1
            assert sharded["decode_gathers"] == stock["decode_gathers"]
            assert sharded["stats"] == {"fused_calls": 1, "stock_calls": 1} and sharded["fc_module_calls"] == 0
            for name in OUTPUTS:
                torch.testing.assert_close(sharded[name], stock[name], **h.tolerances(dtype), msg=f"{key} r{r} {name}")
        for name in OUTPUTS:
            assert torch.equal(ranks[0][("draft", key, "sharded")][name], ranks[1][("draft", key, "sharded")][name])

    key, dtype = str(torch.float32), torch.float32
    tol = h.tolerances(dtype)
    plans = [res[("draft", key, "qualified")]["partial_sharding"] for res in ranks]
    assert plans[0] is not None and plans[0][:3] == plans[1][:3], plans
    rows, sharded_buckets, timings, cached = plans[0]
    # the max of each timing over the ranks: rank 1's rows (20 us) and its slow 64-row all-gather (200 us)
    assert rows == [1, 4, 16, 64] and sharded_buckets == [True, True, True, False] and not cached
    assert timings[0] == (100.0, 20.0, 20.0) and timings[3] == (100.0, 20.0, 200.0)
    for r, res in enumerate(ranks):
        v = {name: res[("draft", key, name)] for name in
             ["stock", "sharded", "replicated", "stepped-aside", "qualified", "qualified-cached", "rank0-decides",
              "rank1-rejects"] + [f"fails-at-{s}" for s in FAILURE_STEPS]}
        stock, replicated = v["stock"], v["replicated"]
        assert replicated["sharding"] is None and replicated["fc_weight_shape"] == (N, KH)
        assert replicated["extend_gathers"] == stock["extend_gathers"]
        for name in OUTPUTS:  # sharded == replicated on the same rank, bitwise (reference backend)
            assert torch.equal(v["sharded"][name], replicated[name]), f"r{r} {name}"
        # SGLang's own fc block on the sharded module (any forward the fused call steps aside from)
        aside = v["stepped-aside"]
        assert aside["stats"] == {"fused_calls": 0, "stock_calls": 2} and aside["fc_module_calls"] == 1
        assert aside["extend_gathers"] == stock["extend_gathers"] + 1
        for name in OUTPUTS:
            torch.testing.assert_close(aside[name], stock[name], **tol, msg=f"r{r} {name} stepped aside")
        # qualified: partial sharding (the replicated weight stays); the 12-row extend (bucket 16) takes
        # this rank's rows + one all-gather; the timed all-gathers ran at install (4 buckets x 6)
        q = v["qualified"]
        assert q["fc_class"] == "Linear" and q["fc_weight_shape"] == (N, KH) and q["sharding"] is None
        assert q["extend_gathers"] == stock["extend_gathers"] + 1 and q["stats"] == {"fused_calls": 1, "stock_calls": 1}
        assert q["install_gathers"] == 4 * 6
        for name in OUTPUTS:
            assert torch.equal(q[name], replicated[name]), f"r{r} {name} qualified"
        # the same install again: the decision comes from the cache, agreed by every rank, no timed collective
        c = v["qualified-cached"]
        assert c["partial_sharding"][:3] == plans[0][:3] and c["partial_sharding"][3] is True
        assert c["install_gathers"] == 0 and c["site_plan"] == q["site_plan"]
        # rank 0 decides where rank 1 accepts its pick (rank 1 alone would have kept stock)
        d = v["rank0-decides"]
        assert d["site_plan"] == ranks[0][("draft", key, "rank0-decides")]["site_plan"]
        assert d["site_plan"] and all(c[1] == "reference" for c in d["site_plan"]), d["site_plan"]
        assert d["stats"] == {"fused_calls": 1, "stock_calls": 1}
        # rank 1 rejected rank 0's pick: stock for every bucket on both ranks (no lone all-gather)
        one = v["rank1-rejects"]
        assert one["site_plan"] and all(c[1] is None for c in one["site_plan"]), one["site_plan"]
        assert one["stats"] == {"fused_calls": 0, "stock_calls": 2}
        assert one["extend_gathers"] == stock["extend_gathers"]
        for name in OUTPUTS:
            assert torch.equal(one[name], stock[name]), f"r{r} {name}: stock on every rank"
        # a failure on rank 1 at any install step: SGLang's stock fc on both ranks (the site's failure
        # leaves the fused fc installed but serving stock for every bucket), nothing sharded
        for step in FAILURE_STEPS:
            f = v[f"fails-at-{step}"]
            assert f["fc_class"] == "Linear" and f["fc_weight_shape"] == (N, KH), (step, f["fc_class"])
            if step == "site":
                assert f["installed"] and all(c[1] is None for c in f["site_plan"]), (step, f["site_plan"])
            else:
                assert not f["installed"], step
            assert f["extend_gathers"] == stock["extend_gathers"], step
            for name in OUTPUTS:
                assert torch.equal(f[name], stock[name]), f"r{r} {name}: failure at {step}"
        # DP attention: the draft's attention-TP group has one rank; nothing sharded, no collective
        dp = res["dp_attention"]
        assert dp["plugin"]["sharding"] is None and dp["plugin"]["fc_class"] == "Linear"
        assert dp["plugin"]["gathers"] == dp["stock"]["gathers"] == 0
        assert dp["plugin"]["stats"] == {"fused_calls": 1, "stock_calls": 1}
        for name in ("fc_out", "extend_logits", "decode_logits"):
            torch.testing.assert_close(dp["plugin"][name], dp["stock"][name], **tol, msg=f"r{r} dp {name}")
    joined = "\n".join(logs)
    assert "fc sharded over 2 TP ranks" in joined and "was released" in joined
    assert "stays replicated on each of the 2 TP ranks (EAGLE3_OPS_SGLANG_SHARD_FC=0)" in joined
    assert "sharded for some buckets: the replicated weight stays" in joined and "(cached;" in joined
    assert "rows serve stock on every TP rank (a rank could not take rank 0's choice)" in logs[0]
    for text in ("timing the sharded and replicated fc failed on this rank",
                 "timing the all-gather failed on this rank", "qualification failed on this rank",
                 "could not allocate what the fused fc needs on this rank"):
        assert text in logs[1], text
    assert "fc stays stock on every TP rank: another TP rank cannot run it fused" in logs[0]
    assert "its install failed on another TP rank" in logs[0]
    assert "the sharding could not be decided on every rank" in logs[0]
    assert "EAGLE-3 capture left stock: its preparation failed on another TP rank" in logs[0]
    assert "injected on rank 1 (allocating the capture buffer)" in logs[1]
    assert "the ranks' settings differ (here rows=32 qualify=True" in logs[1]
