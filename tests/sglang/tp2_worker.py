"""One rank of the TP=2 CPU run (two gloo processes): ``python tp2_worker.py RANK PORT OUTDIR``.

One pair of processes covers everything that needs real collectives (test_tp2.py checks it):

* **target** (SGLang's LlamaForCausalLM, sharded by SGLang's loaders): EXTEND + TARGET_VERIFY stock and
  with the plugin, the fused norm qualified (scripted timings: it wins) — captures post-all-reduce,
  bitwise stock — and once more with the norm's qualification failing on rank 1 (both ranks then serve
  SGLang's norm: one decision on every rank);
* **the states dump** at TP=2 (rank 0 keeps values and writes);
* **the live wiring check** at TP=2 on the tiny doctor pair served mis-wired (both ranks record in
  lockstep; rank 0 alone scores, warns and writes the verdict);
* **draft** (SGLang's llama_eagle3, checkpoint ``DIR/inputs.pt``): stock, sharded (qualification off:
  sharded everywhere), replicated (``EAGLE3_OPS_SGLANG_SHARD_FC=0``), SGLang's own fc block on the
  sharded module, qualified (rank-dependent scripted timings: the max over ranks decides; partial
  sharding), the same again from the cache (no timed collective), rank 0's site choice served where
  rank 1 accepts it / stock where it rejects it, a failure injected on rank 1 at every install step
  (every rank then keeps SGLang's stock fc, no rank left waiting), and the draft configured in an
  attention-TP group of its own (DP attention: a one-rank group inside the TP=2 world).

The rank processes serve every op with the reference backend (no Triton interpreter: fast)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness as h  # noqa: E402

PROMPTS = [[5, 17, 3, 99, 42], [7, 1, 64, 23, 88, 120, 11]]
DRAFTS = [[9, 31, 2, 77], [54, 6, 101, 13]]
LAYER_IDS = [0, 1, 2]
# install steps where rank 1 fails in the failure scenarios (draft side)
FAILURE_STEPS = ("backend", "state", "timer", "fc-timing", "gather-timing", "site", "rows", "workspace", "fold")
# install steps where rank 1 fails in the failure scenarios (target side, before the fused norm's vote)
TARGET_FAILURE_STEPS = ("backend", "buffer", "candidates", "settings")


def two_forwards(model, cfg, dtype, tp_size):
    kv = h.KVCache(cfg, dtype, tp_size=tp_size)
    reqs = [h.Req(kv.new_req()) for _ in PROMPTS]
    ext = h.run(model, h.extend_batch(kv, reqs, PROMPTS), kv)
    out = {"extend_aux": ext.hidden_states.clone(), "extend_logits": ext.next_token_logits.clone()}
    ver = h.run(model, h.extend_batch(kv, reqs, DRAFTS, mode="TARGET_VERIFY"), kv)
    out.update(verify_aux=ver.hidden_states.clone(), verify_logits=ver.next_token_logits.clone())
    return out


class Patches:
    """Attribute patches undone together (a tiny monkeypatch for a script)."""

    def __init__(self):
        self.saved = []

    def set(self, obj, name, value):
        self.saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def env(self, name, value):
        self.saved.append((os.environ, name, os.environ.get(name)))
        os.environ[name] = value

    def undo(self):
        for obj, name, value in reversed(self.saved):
            if obj is os.environ:
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            else:
                setattr(obj, name, value)
        self.saved.clear()


def site_timer(winner_on_rank, rank, folded_wins=False):
    """The sites' qualification: stock (closures named ``run``) 100 us; candidates 10 us where this rank
    is in ``winner_on_rank`` (they serve), 99 us elsewhere (inside the 5% margin: stock). With
    ``folded_wins`` a folded draft candidate (its closure's last default True) takes 5 us."""
    def make(device, reps=10):
        def time(fn):
            fn()
            if fn.__name__ == "run":
                return 100.0
            if folded_wins and (fn.__defaults__ or (None,))[-1] is True:
                return 5.0
            return 10.0 if rank in winner_on_rank else 99.0
        return time
    return make


def fc_timer(rank, fail=None):
    """The sharding decision's fc timings, per bucket (1, 4, 16, 64 rows): replicated 100 us, this rank's
    rows 10 us (rank 0) / 20 us (rank 1). ``fail``: "timer" raises building it, "fc-timing" on a call."""
    if fail == "timer":
        raise RuntimeError("CUDA out of memory (simulated, allocating the L2 flush buffer)")
    calls = [0]

    def time(fn):
        if fail == "fc-timing":
            raise RuntimeError("CUDA out of memory (simulated, timing the fc)")
        fn()
        calls[0] += 1
        return 100.0 if calls[0] % 2 == 1 else (10.0 if rank == 0 else 20.0)
    return time


def gather_time(rank, fail=False):
    """The all-gather timings: 20 us, except 200 us at 64 rows on rank 1 (so the max over the ranks
    keeps the 64-row bucket replicated); ``fail`` raises reading them."""
    def time(m, measured):
        if fail:
            raise RuntimeError("CUDA error: an illegal memory access (simulated, reading the all-gather timing)")
        return 200.0 if (rank == 1 and m == 64) else 20.0
    return time


def target_part(rank, outdir, results):
    import torch

    from eagle3_ops import qualify
    from eagle3_ops.sglang import capture_hooks

    for dtype in (torch.float32, torch.bfloat16):
        for variant in ("fused", "norm-qualification-fails-on-rank-1"):
            p = Patches()
            p.env("EAGLE3_OPS_QUALIFY", "on")
            p.env("XDG_CACHE_HOME", os.path.join(outdir, f"cache-target-{rank}-{variant}-{dtype}"))
            p.env("EAGLE3_OPS_SGLANG_MAX_TOKENS", "64")
            p.set(qualify, "Timer", site_timer((0, 1), rank))
            if variant != "fused" and rank == 1:
                real = qualify.qualify

                def failing(shape, *a, **k):
                    if shape.op == "fused_add_rmsnorm_capture":
                        raise RuntimeError("CUDA out of memory (simulated, qualifying the fused norm)")
                    return real(shape, *a, **k)  # noqa: B023 (called only within this iteration)
                p.set(qualify, "qualify", failing)
            try:
                cfg = h.FAMILIES["llama"].make_config()
                hf = h.hf_model("llama", cfg, dtype)
                model = h.sglang_from_hf("llama", cfg, dtype, hf)
                assert model.model.layers[0].self_attn.num_heads == cfg.num_attention_heads // 2  # really sharded
                model.set_eagle3_layers_to_capture(LAYER_IDS)
                stock = two_forwards(model, cfg, dtype, 2)
                h.configure_capture(model, LAYER_IDS)
            finally:
                p.undo()
            plugin = two_forwards(model, cfg, dtype, 2)
            state = capture_hooks.capture_state(model)
            results[("target", str(dtype), variant)] = {
                "stock": stock, "plugin": plugin, "stats": dict(state.stats), "fused_sites": state.fused_sites,
                "norm_plan": [(c.rows, c.backend) for c in state.norm_plan.choices]}
        # the capture's install failing on rank 1 alone, before any collective: both ranks stay stock
        for step in TARGET_FAILURE_STEPS:
            p = Patches()
            p.env("EAGLE3_OPS_QUALIFY", "on")
            p.env("XDG_CACHE_HOME", os.path.join(outdir, f"cache-target-{rank}-fails-{step}-{dtype}"))
            p.env("EAGLE3_OPS_SGLANG_MAX_TOKENS", "64")
            p.set(qualify, "Timer", site_timer((0, 1), rank))
            if rank == 1:
                if step == "backend":  # a backend's verification failed on this GPU only
                    p.set(capture_hooks, "serving_backends", lambda *a, **k: None)
                elif step == "settings":  # another node's environment: the collectives would be shaped apart
                    p.env("EAGLE3_OPS_SGLANG_MAX_TOKENS", "32")
                elif step == "buffer":
                    def no_memory(*a, **k):
                        raise MemoryError("injected on rank 1 (allocating the capture buffer)")
                    p.set(capture_hooks, "AuxCaptureBuffer", no_memory)
                else:
                    def broken(*a, **k):
                        raise RuntimeError("injected on rank 1 (finding the fused-norm candidates)")
                    p.set(capture_hooks, "_candidate_norms", broken)
            try:
                cfg = h.FAMILIES["llama"].make_config()
                model = h.sglang_from_hf("llama", cfg, dtype, h.hf_model("llama", cfg, dtype))
                model.set_eagle3_layers_to_capture(LAYER_IDS)
                stock = two_forwards(model, cfg, dtype, 2)
                h.configure_capture(model, LAYER_IDS)
            finally:
                p.undo()
            results[("target", str(dtype), f"fails-at-{step}")] = {
                "stock": stock, "plugin": two_forwards(model, cfg, dtype, 2),
                "installed": capture_hooks.capture_state(model) is not None}
    # the states dump at TP=2: both ranks run it (same environment, as in a server); rank 0 writes
    os.environ["EAGLE3_OPS_DUMP_STATES"] = os.path.join(outdir, "states.safetensors")
    os.environ["EAGLE3_OPS_DUMP_TOKENS"] = str(sum(map(len, PROMPTS)))
    try:
        from eagle3_ops.sglang.dump_states import dump_state

        cfg = h.FAMILIES["llama"].make_config()
        model = h.sglang_from_hf("llama", cfg, torch.float32, h.hf_model("llama", cfg, torch.float32))
        h.configure_capture(model, LAYER_IDS)
        rec = dump_state(model)
        kv = h.KVCache(cfg, torch.float32, tp_size=2)
        h.run(model, h.extend_batch(kv, [h.Req(kv.new_req()) for _ in PROMPTS], PROMPTS), kv)
        results["dump"] = {"tp_rank": rec.tp_rank, "tp_size": rec.tp_size, "keeps_values": rec.keep_values,
                           "done": rec.done}
    finally:
        os.environ.pop("EAGLE3_OPS_DUMP_STATES", None)
        os.environ.pop("EAGLE3_OPS_DUMP_TOKENS", None)
    wiring_part(rank, outdir, results)


def wiring_part(rank, outdir, results):
    """The live wiring check at TP=2 on the tiny doctor pair, served mis-wired (ids [1, 3, 5]): both ranks
    record in lockstep (the next-token all-gather), rank 0 alone scores and talks."""
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    from eagle3_ops.sglang import wiring_check

    pair = torch.load(os.path.join(outdir, "inputs.pt"), weights_only=False)["wiring"]
    os.environ["XDG_CACHE_HOME"] = os.path.join(outdir, f"cache-wiring-{rank}")
    cfg = LlamaConfig.from_pretrained(pair["target"])
    model = h.sglang_model("llama", cfg, torch.float32, weights=load_file(os.path.join(pair["target"],
                                                                                       "model.safetensors")).items())
    h.configure_capture(model, [1, 3, 5])
    check = wiring_check.start(model, draft_path=pair["draft"], target_config=cfg)
    prompts = json.loads(open(pair["prompts"]).read())[:wiring_check.CLOSE_AFTER_TOKENS // 32 + 2]
    kv = h.KVCache(cfg, torch.float32, tp_size=2, size=sum(map(len, prompts)) + 8, max_reqs=len(prompts) + 1)
    for s in range(0, len(prompts), 4):
        chunk = prompts[s:s + 4]
        h.run(model, h.extend_batch(kv, [h.Req(kv.new_req()) for _ in chunk], chunk), kv)
    check.wait()
    results["wiring"] = {"phase": check.phase, "verdict": check.verdict, "thread": check.thread is not None,
                         "boundaries": check.recorder.boundaries, "done": check.recorder.done,
                         "result_file": wiring_check.result_path("LlamaForCausalLM").is_file()}
    # rank 0 fails alone while recording (host memory, say): it stops keeping values but goes on taking
    # part in the all-gathers, so rank 1 is never left waiting; the check ends with one line
    wiring_check._checks.clear()
    model = h.sglang_model("llama", cfg, torch.float32, weights=load_file(os.path.join(pair["target"],
                                                                                       "model.safetensors")).items())
    h.configure_capture(model, [1, 3, 5])
    check = wiring_check.start(model, draft_path=pair["draft"], target_config=cfg)
    if rank == 0:
        def fail(*a, **k):
            raise MemoryError("injected on rank 0")
        check.recorder._keep = fail
    kv = h.KVCache(cfg, torch.float32, tp_size=2, size=sum(map(len, prompts)) + 8, max_reqs=len(prompts) + 1)
    for s in range(0, len(prompts), 4):
        chunk = prompts[s:s + 4]
        h.run(model, h.extend_batch(kv, [h.Req(kv.new_req()) for _ in chunk], chunk), kv)
    check.wait()
    results["wiring_failure"] = {"phase": check.phase, "done": check.recorder.done,
                                 "failure": check.recorder.failure}


def _build_draft(dcfg, dtype, ckpt):
    draft = h.eagle3_draft(dcfg, dtype)
    draft.load_weights([(name, t.to(dtype)) for name, t in ckpt.items()])
    return draft


def draft_variant(rank, outdir, variant, dtype, dcfg, ckpt, aux, gathers):
    """Install the draft fc under ``variant`` (patches undone afterwards) and run it; what it saw."""
    import torch

    import functools

    from eagle3_ops import qualify
    from eagle3_ops.sglang import draft_fc_hooks, fc_sharding, serving
    from test_draft_fc import _draft_steps

    draft = _build_draft(dcfg, dtype, ckpt)
    rec = {}
    install_gathers = None
    if variant != "stock":
        p = Patches()
        p.set(serving, "default_max_tokens", lambda: 64)  # buckets 1, 4, 16, 64
        fail = variant[len("fails-at-"):] if variant.startswith("fails-at-") else None
        fail_here = fail if rank == 1 else None
        qualified = variant.startswith(("qualified", "rank0", "rank1")) or fail in (
            "timer", "fc-timing", "gather-timing", "site", "fold")
        if variant == "replicated":
            p.env("EAGLE3_OPS_SGLANG_SHARD_FC", "0")
        if qualified:
            cache = "qualified" if variant in ("qualified", "qualified-cached") else variant
            p.env("EAGLE3_OPS_QUALIFY", "on")
            p.env("XDG_CACHE_HOME", os.path.join(outdir, f"cache-draft-{rank}-{cache}-{dtype}"))
            p.set(fc_sharding, "decide_sharding", functools.partial(
                fc_sharding.decide_sharding, make_timer=lambda device: fc_timer(rank, fail_here),
                gather_us=gather_time(rank, fail_here == "gather-timing")))
            winners = {"rank0-decides": (0,), "rank1-rejects": (0,)}.get(variant, (0, 1))
            p.set(qualify, "Timer", site_timer(winners, rank, folded_wins=fail == "fold"))
        if variant == "rank1-rejects" and rank == 1:
            real = qualify.qualify

            def rejecting(*a, **k):  # rank 1 found rank 0's pick wrong
                plan = real(*a, **k)
                plan.rejected += [qualify.Rejection("draft_fc", c.rows, "reference", None, "simulated")
                                  for c in plan.choices]
                return plan
            p.set(qualify, "qualify", rejecting)

        def boom(*a, **k):
            raise RuntimeError(f"CUDA out of memory (simulated, at the {fail} step on rank 1)")
        if fail_here == "backend":
            p.set(draft_fc_hooks, "serving_backends", lambda *a, **k: None)  # its self-check failed here
        elif fail_here == "state":
            p.set(draft_fc_hooks, "DraftFcState", boom)
        elif fail_here == "site":
            p.set(draft_fc_hooks, "_qualify_site", boom)
        elif fail_here == "rows":
            p.set(fc_sharding, "ColumnShardedFc", boom)
        elif fail_here == "workspace":
            p.set(draft_fc_hooks.DraftFcState, "allocate_workspace", boom)
        elif fail_here == "fold":
            p.set(draft_fc_hooks, "_prepare_folded_weight", boom)
        before = gathers[0]
        try:
            h.configure_capture(draft, None, eagle=False)
        finally:
            p.undo()
        install_gathers = gathers[0] - before
        state = draft_fc_hooks.draft_fc_state(draft)
        rec["installed"] = state is not None
        if variant == "stepped-aside":
            state.enabled = False  # SGLang's own fc block runs: its fc call is ColumnShardedFc.forward
        rec["sharding"] = state.sharding if state else None
        partial = state.partial_sharding if state else None
        rec["partial_sharding"] = (partial.rows, partial.sharded, partial.timings, partial.cached) if partial else None
        rec["site_plan"] = ([(c.rows, c.backend, c.path, c.folded) for c in state.plan.choices]
                            if state is not None and state.plan is not None else None)
        fc = draft.model.fc
        rec["fc_class"] = type(fc).__name__
        rec["fc_weight_shape"] = tuple(fc.weight.shape)
        if isinstance(fc, fc_sharding.ColumnShardedFc):
            rows = slice(fc.row_start, fc.row_start + fc.rows)
            rec["rows"] = (fc.row_start, fc.rows)
            rec["rows_match_checkpoint"] = (torch.equal(fc.weight, ckpt["model.fc.weight"][rows].to(dtype))
                                            and torch.equal(fc.bias, ckpt["model.fc.bias"][rows].to(dtype)))
            rec["released"] = state.sharding["released"]
    rec["install_gathers"] = install_gathers
    fc_calls = []
    hook = draft.model.fc.register_forward_hook(lambda m, a, out: fc_calls.append(1))
    counts = []
    orig_run = h.run

    def counted_run(model, fb, kv):
        before = gathers[0]
        out = orig_run(model, fb, kv)
        counts.append(gathers[0] - before)
        return out

    h.run = counted_run
    try:
        ext, dec, fc_out = _draft_steps(h, draft, dcfg, dtype, aux)
    finally:
        h.run = orig_run
        hook.remove()
    rec.update(extend_gathers=counts[0], decode_gathers=counts[1], fc_module_calls=len(fc_calls), fc_out=fc_out,
               extend_logits=ext.next_token_logits.clone(), extend_hidden=ext.hidden_states.clone(),
               decode_logits=dec.next_token_logits.clone(), decode_hidden=dec.hidden_states.clone())
    state = draft_fc_hooks.draft_fc_state(draft)
    if state is not None:
        rec["stats"] = dict(state.stats)
    return rec


def dp_attention_variant(dcfg, ckpt, aux, gathers):
    """The draft configured inside an attention-TP group of its own (what SGLang's draft_tp_context does
    under DP attention: here a one-rank group in the TP=2 world): the fc is not sharded (the draft's
    group has one rank), no collective runs on the draft, and its outputs are stock's."""
    import torch
    from sglang.srt.distributed.parallel_state import get_self_pp_group, patch_tensor_parallel_group

    from eagle3_ops.sglang import draft_fc_hooks
    from test_draft_fc import _draft_steps

    out = {}
    with patch_tensor_parallel_group(get_self_pp_group(), owns_attention=True):
        for name in ("stock", "plugin"):
            draft = _build_draft(dcfg, torch.float32, ckpt)
            if name == "plugin":
                h.configure_capture(draft, None, eagle=False)
            before = gathers[0]
            ext, dec, fc_out = _draft_steps(h, draft, dcfg, torch.float32, aux)
            state = draft_fc_hooks.draft_fc_state(draft)
            out[name] = {"fc_out": fc_out, "extend_logits": ext.next_token_logits.clone(),
                         "decode_logits": dec.next_token_logits.clone(), "gathers": gathers[0] - before,
                         "stats": dict(state.stats) if state else None, "sharding": state.sharding if state else None,
                         "fc_class": type(draft.model.fc).__name__}
    return out


def draft_part(rank, outdir, results, gathers):
    import torch

    inputs = torch.load(os.path.join(outdir, "inputs.pt"), weights_only=False)
    dcfg, aux32, ckpt = inputs["dcfg"], inputs["aux"], inputs["ckpt"]
    variants = ["stock", "sharded", "replicated", "stepped-aside", "qualified", "qualified-cached",
                "rank0-decides", "rank1-rejects"] + [f"fails-at-{s}" for s in FAILURE_STEPS]
    for dtype in (torch.float32, torch.bfloat16):
        for variant in (variants if dtype == torch.float32 else ["stock", "sharded"]):
            results[("draft", str(dtype), variant)] = draft_variant(rank, outdir, variant, dtype, dcfg, ckpt,
                                                                    aux32.to(dtype), gathers)
    results["dp_attention"] = dp_attention_variant(dcfg, ckpt, aux32, gathers)


def main(rank: int, port: int, outdir: str) -> None:
    h.disable_dynamo()
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("eagle3_ops").setLevel(logging.INFO)
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    h.init_distributed(tp_size=2, rank=rank, port=port)
    assert h.plugin_install()
    gathers = [0]
    original_all_gather = GroupCoordinator.all_gather

    def counting_all_gather(self, *args, **kwargs):
        if self.world_size > 1:
            gathers[0] += 1
        return original_all_gather(self, *args, **kwargs)

    GroupCoordinator.all_gather = counting_all_gather
    results = {"reference_only": h.reference_only(torch.float32) and h.reference_only(torch.bfloat16)}
    target_part(rank, outdir, results)
    draft_part(rank, outdir, results, gathers)
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):  # a test's worker script: its usage, nothing run
        print(f"usage: python tests/sglang/tp2_worker.py RANK PORT OUTDIR\n\n{__doc__}")
        sys.exit(0)
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
