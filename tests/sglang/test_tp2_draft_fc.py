"""TP=2 on CPU (two gloo processes running SGLang's llama_eagle3 draft): the draft fc sharded over
the TP ranks (each rank keeps its rows, the replicated weight is gone) gives the draft outputs of
the replicated fc, at TP=2 and at TP=1, with exactly one added all-gather per draft extend and none
per decode step; ``EAGLE3_OPS_SGLANG_SHARD_FC=0`` keeps it replicated. Workers: tp2_draft_worker.py."""
import torch
LAYER_IDS = [0, 1, 2]


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


def _tp1(h, dcfg, ckpt, aux, dtype, plugin):
    from test_draft_fc import _draft_steps

    draft = h.eagle3_draft(dcfg, dtype)
    draft.load_weights([(n, t.to(dtype)) for n, t in ckpt.items()])
    if plugin:
        h.configure_capture(draft, None, eagle=False)
    ext, dec, fc_out = _draft_steps(h, draft, dcfg, dtype, aux.to(dtype))
    return {"fc_out": fc_out, "extend_logits": ext.next_token_logits, "extend_hidden": ext.hidden_states,
            "decode_logits": dec.next_token_logits, "decode_hidden": dec.hidden_states}


OUTPUTS = ("fc_out", "extend_logits", "extend_hidden", "decode_logits", "decode_hidden")


def test_tp2_sharded_draft_fc(sglang_cpu, tmp_path):
    h = sglang_cpu
    cfg = h.FAMILIES["llama"].make_config()
    dcfg = h.eagle3_draft_config(cfg, layer_ids=LAYER_IDS, fc_norm=True, norm_before_fc=True)
    dcfg.bias = True  # llama_eagle3 reads config.bias for fc: the bias rows are sharded too
    source = h.eagle3_draft(dcfg, torch.float32, seed=3)
    assert source.model.fc.bias is not None
    ckpt = _checkpoint(source, dcfg)
    gen = torch.Generator().manual_seed(11)
    T = 12  # tokens of test_draft_fc.PROMPTS
    aux = torch.randn(T, len(LAYER_IDS) * cfg.hidden_size, generator=gen)
    torch.save({"ckpt": ckpt, "aux": aux, "dcfg": dcfg}, tmp_path / "inputs.pt")

    ranks, logs = h.run_ranks("tp2_draft_worker.py", tmp_path)
    N, KH = ckpt["model.fc.weight"].shape
    for dtype in (torch.float32, torch.bfloat16):
        key = str(dtype)
        tol = h.tolerances(dtype)
        tp1_stock = _tp1(h, dcfg, ckpt, aux, dtype, plugin=False)
        for r, res in enumerate(ranks):
            stock, sharded, replicated = (res[(key, v)] for v in ("stock", "sharded", "replicated"))
            # each rank holds only its rows; no tensor of the replicated fc's shape is left in the process
            assert sharded["fc_class"] == "ColumnShardedFc", logs[r][-3000:]
            assert sharded["rows"] == (r * N // 2, N // 2)
            assert sharded["rows_match_checkpoint"]
            assert sharded["param_shapes"]["model.fc.weight"] == (N // 2, KH)
            assert sharded["param_shapes"]["model.fc.bias"] == (N // 2,)
            assert sharded["full_fc_alive"] == 0
            assert sharded["sharding"]["released"] and sharded["sharding"]["tp_size"] == 2
            assert sharded["sharding"]["bytes_after"] * 2 == sharded["sharding"]["bytes_before"]
            assert replicated["sharding"] is None and replicated["fc_weight_shape"] == (N, KH)
            # exactly one added all-gather per draft extend, none per decode step
            assert sharded["extend_gathers"] == stock["extend_gathers"] + 1, (sharded, stock)
            assert sharded["decode_gathers"] == stock["decode_gathers"]
            assert replicated["extend_gathers"] == stock["extend_gathers"]
            for v in (sharded, replicated):
                assert v["stats"] == {"fused_calls": 1, "stock_calls": 1}
                assert v["fc_module_calls"] == 0  # the fused call ran, not the fc module
            # SGLang's own fc block on the sharded module (what any forward the fused call steps
            # aside from runs): its output is the replicated stock fc's, with the one added all-gather
            aside = res[(key, "sharded-stepped-aside")]
            assert aside["stats"] == {"fused_calls": 0, "stock_calls": 2} and aside["fc_module_calls"] == 1
            assert aside["extend_gathers"] == stock["extend_gathers"] + 1
            for name in OUTPUTS:
                torch.testing.assert_close(aside[name], stock[name], **tol, msg=f"{key} rank{r} {name} stepped aside")
            for name in OUTPUTS:
                # sharded == replicated on the same rank: bitwise with the reference backend
                h.assert_plugin_matches_stock(sharded[name], replicated[name], dtype, f"{key} rank{r} {name}",
                                              reference=res["reference_only"])
                # and == TP=1 stock SGLang within rounding (the TP=2 attention/MLP reduce in another order)
                torch.testing.assert_close(sharded[name].float(), tp1_stock[name].float(), **tol,
                                           msg=f"{key} rank{r} {name} vs TP=1")
        for name in OUTPUTS:
            assert torch.equal(ranks[0][(key, "sharded")][name], ranks[1][(key, "sharded")][name]), name
        # qualified: both ranks hold the same plan, from the max of each timing over the ranks
        plans = [res[(key, "qualified")]["partial_sharding"] for res in ranks]
        assert plans[0] is not None and plans[0] == plans[1], plans
        rows, sharded, timings = plans[0]
        assert rows == [1, 4, 16, 64] and sharded == [True, True, True, False]
        assert timings[0] == (100.0, 20.0, 20.0) and timings[3] == (100.0, 20.0, 200.0)  # rank 1's maxima
        for r, res in enumerate(ranks):
            q, stock, replicated = (res[(key, v)] for v in ("qualified", "stock", "replicated"))
            assert q["fc_class"] == "Linear" and q["fc_weight_shape"] == (N, KH) and q["sharding"] is None
            assert q["extend_gathers"] == stock["extend_gathers"] + 1  # 12 rows: bucket 16, sharded
            assert q["decode_gathers"] == stock["decode_gathers"]
            assert q["stats"] == {"fused_calls": 1, "stock_calls": 1}
            for name in OUTPUTS:
                h.assert_plugin_matches_stock(q[name], replicated[name], dtype, f"{key} rank{r} {name} qualified",
                                              reference=res["reference_only"])
            # rank 0 decides (rank 1 would have kept stock, but found rank 0's pick correct): both fuse
            dec = res[(key, "qualified-rank0-decides")]
            assert dec["partial_sharding"] == plans[0] and dec["fc_class"] == "Linear"
            assert dec["site_plan"] == ranks[0][(key, "qualified-rank0-decides")]["site_plan"]
            assert dec["site_plan"] and all(c[1] == "triton" and c[2] == "skinny" for c in dec["site_plan"])
            assert dec["stats"] == {"fused_calls": 1, "stock_calls": 1}
            assert dec["extend_gathers"] == stock["extend_gathers"] + 1  # bucket 16 sharded, fused on both
            for name in OUTPUTS:
                torch.testing.assert_close(dec[name], replicated[name], **tol, msg=f"{key} rank{r} {name} rank 0 decides")
            # rank 1 rejected rank 0's pick: stock for every bucket on both ranks (no lone all-gather)
            one = res[(key, "qualified-rank1-rejects")]
            assert one["partial_sharding"] == plans[0] and one["fc_class"] == "Linear"
            assert one["site_plan"] and all(c[1] is None for c in one["site_plan"]), one["site_plan"]
            assert one["stats"] == {"fused_calls": 0, "stock_calls": 2}
            assert one["extend_gathers"] == stock["extend_gathers"] and one["decode_gathers"] == stock["decode_gathers"]
            for name in OUTPUTS:
                assert torch.equal(one[name], stock[name]), f"{key} rank{r} {name}: stock on every rank"
            # a failure on rank 1 before the collectives (timing, or building the timer): both ranks
            # return (no hang) and shard everywhere
            for variant in ("qualified-fails-on-rank-1", "qualified-timer-fails-on-rank-1"):
                failed = res[(key, variant)]
                assert failed["partial_sharding"] is None and failed["fc_class"] == "ColumnShardedFc", variant
                assert failed["extend_gathers"] == stock["extend_gathers"] + 1
                for name in OUTPUTS:
                    h.assert_plugin_matches_stock(failed[name], res[(key, "sharded")][name], dtype,
                                                  f"{key} rank{r} {name} {variant}", reference=res["reference_only"])
            # the site's qualification fails on rank 1 after partial sharding: it votes stock, all run stock
            site = res[(key, "qualified-site-fails-on-rank-1")]
            assert site["partial_sharding"] == plans[0] and site["fc_class"] == "Linear"
            assert site["site_plan"] and all(c[1] is None for c in site["site_plan"]), site["site_plan"]
            assert site["stats"] == {"fused_calls": 0, "stock_calls": 2}
            assert site["extend_gathers"] == stock["extend_gathers"]
            # no backend on rank 1: the ranks agree before any collective; the fc stays stock on both
            nob = res[(key, "backend-fails-on-rank-1")]
            assert not nob["installed"] and nob["fc_class"] == "Linear" and nob["sharding"] is None
            assert nob["extend_gathers"] == stock["extend_gathers"]
            for name in OUTPUTS:
                assert torch.equal(nob[name], stock[name]), f"{key} rank{r} {name}: stock on every rank"
    joined = "\n".join(logs)
    assert "fc sharded over 2 TP ranks" in joined and "was released" in joined
    assert "stays replicated on each of the 2 TP ranks (EAGLE3_OPS_SGLANG_SHARD_FC=0)" in joined
    assert "fc at TP=2: sharded for some buckets: the replicated weight stays" in joined
    assert "rows serve stock on every TP rank (a rank could not take rank 0's choice)" in logs[0]
    assert "timing the sharded and replicated fc failed on this rank" in logs[1]
    assert "fc stays stock on every TP rank: another TP rank cannot run it fused" in logs[0]
    assert "qualification failed on this rank" in logs[1]
    assert all("the sharding could not be qualified on every rank; sharded for every bucket" in lg for lg in logs)
