"""One rank of the TP=2 draft-fc run (two gloo processes): ``python tp2_draft_worker.py RANK PORT DIR``.

``DIR/inputs.pt`` (written by test_tp2_draft_fc.py) holds the draft's full checkpoint (checkpoint
names, fp32), the target aux states and the draft config. Each rank loads the checkpoint through
SGLang's own ``load_weights`` (which shards the draft's attention/MLP for TP=2; fc is replicated,
as stock SGLang does) three times per dtype:

* ``stock``: SGLang's llama_eagle3 as is (never configured through the plugin's hook);
* ``sharded``: configured through ``configure_aux_hidden_state_capture`` (the plugin installs the
  fused fc and, at TP=2, shards it);
* ``replicated``: the same with ``EAGLE3_OPS_SGLANG_SHARD_FC=0``;
* ``sharded-stepped-aside``: sharded, with the fused call turned off, so SGLang's own fc block
  runs and calls the sharded module (``ColumnShardedFc.forward``: rows + all-gather);
* ``qualified``: EAGLE3_OPS_QUALIFY=on with scripted, rank-dependent timings (:class:`ScriptedTimer`;
  the real fn runs on every call, so the all-gathers being timed happen in step): rank 0's own
  numbers would shard every bucket, rank 1's make the 64-row bucket (the 4th) replicated; the
  agreed plan (max over ranks) is replicated at 64 rows and sharded elsewhere, so the fc stays
  replicated and the 12-row extend (bucket 16) takes this rank's rows of it + one all-gather;
* ``qualified-fails-on-rank-1``: timing fails on rank 1 before any collective; both ranks give up
  together (no rank is left waiting in an all-gather) and shard for every bucket (the default);
  ``qualified-timer-fails-on-rank-1``: the same when building the timer fails;
* ``qualified-site-fails-on-rank-1``: partial sharding as in ``qualified``, then the site's own
  qualification raises on rank 1: it votes stock, so both ranks run stock for every bucket;
* ``backend-fails-on-rank-1``: no backend can serve the fused fc on rank 1 (its self-check failed):
  the ranks agree before any sharding collective; both stay replicated, rank 0 fused, rank 1 stock.
* ``qualified-rank0-decides``: the same sharding plan, and the site's own qualification runs with a
  timer under which rank 0's candidates beat stock and rank 1's do not: every rank serves rank 0's
  choice (rank 1 found it correct too), so both fuse and the extend all-gathers on both;
* ``qualified-rank1-rejects``: the same, and rank 1's qualification rejected rank 0's candidate:
  stock for every bucket on both ranks (else rank 0 would all-gather alone).

Each runs one draft EXTEND (on the target's aux states) and one DECODE step, counting every
all-gather SGLang's TP group performs, and saves outputs, counts and what the rank holds."""
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness as h  # noqa: E402


def _build(dcfg, dtype, ckpt_path):
    import torch

    draft = h.eagle3_draft(dcfg, dtype)
    ckpt = torch.load(ckpt_path, weights_only=False)["ckpt"]
    draft.load_weights([(name, t.to(dtype)) for name, t in ckpt.items()])
    del ckpt
    return draft


def _full_fc_tensors(shape):
    """Every live tensor in this process with the replicated fc's shape (storage pointers)."""
    import torch

    gc.collect()
    found = set()
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and tuple(obj.shape) == tuple(shape):
                found.add(obj.untyped_storage().data_ptr())
        except Exception:  # objects that fail isinstance checks or lazy tensors
            continue
    return found


class ScriptedTimer:
    """The calls: per bucket (1, 4, 16, 64 rows) the replicated fc and this rank's rows, then per
    bucket the all-gather. ``fail_rank`` raises there on its first fc timing (out of memory, say)."""

    BUCKETS = 4

    def __init__(self, rank: int, fail_rank: int = -1, fail_init: bool = False):
        if fail_init and rank == fail_rank:
            raise RuntimeError("CUDA out of memory (simulated, allocating the L2 flush buffer)")
        self.rank, self.calls, self.fail_rank = rank, 0, (-1 if fail_init else fail_rank)

    def __call__(self, fn):
        if self.rank == self.fail_rank:
            raise RuntimeError("CUDA out of memory (simulated)")
        fn()
        i = self.calls
        bucket, which = divmod(i, 2) if i < 2 * self.BUCKETS else (i - 2 * self.BUCKETS, 2)
        self.calls += 1
        if which == 0:
            return 100.0
        if self.rank == 1 and bucket == 3:
            return 200.0 if which == 2 else 20.0  # a slow all-gather at 64 rows on rank 1 only
        return 10.0 if self.rank == 0 else 20.0


class SiteTimer:
    """The site's qualification: stock (closures named ``run``) 100 us; candidates 10 us on rank 0
    (they would serve), 99 us on rank 1 (inside the 5% margin: stock)."""

    def __init__(self, rank: int):
        self.rank = rank

    def __call__(self, fn):
        fn()
        return 100.0 if fn.__name__ == "run" else (10.0 if self.rank == 0 else 99.0)


def main(rank: int, port: int, outdir: str) -> None:
    h.disable_dynamo()
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("eagle3_ops").setLevel(logging.INFO)
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    h.init_distributed(tp_size=2, rank=rank, port=port)
    assert h.plugin_install()
    from eagle3_ops.sglang.draft_fc_hooks import ColumnShardedFc, draft_fc_state
    from test_draft_fc import _draft_steps

    inputs_path = os.path.join(outdir, "inputs.pt")
    inputs = torch.load(inputs_path, weights_only=False)
    dcfg, aux32 = inputs["dcfg"], inputs["aux"]
    full_fc_shape = tuple(inputs["ckpt"]["model.fc.weight"].shape)
    del inputs

    gathers = [0]
    original_all_gather = GroupCoordinator.all_gather

    def counting_all_gather(self, *args, **kwargs):
        if self.world_size > 1:
            gathers[0] += 1
        return original_all_gather(self, *args, **kwargs)

    GroupCoordinator.all_gather = counting_all_gather

    results = {"reference_only": h.reference_only(torch.float32)}
    for dtype in (torch.float32, torch.bfloat16):
        aux = aux32.to(dtype)
        for variant in ("stock", "sharded", "replicated", "sharded-stepped-aside", "qualified",
                        "qualified-rank0-decides", "qualified-rank1-rejects", "qualified-fails-on-rank-1",
                        "qualified-timer-fails-on-rank-1", "qualified-site-fails-on-rank-1",
                        "backend-fails-on-rank-1"):
            draft = _build(dcfg, dtype, inputs_path)
            rec = {}
            if variant != "stock":
                if variant == "replicated":
                    os.environ["EAGLE3_OPS_SGLANG_SHARD_FC"] = "0"
                from eagle3_ops.sglang import draft_fc_hooks

                from eagle3_ops import qualify

                from eagle3_ops.sglang import capture_hooks

                saved = (draft_fc_hooks._qualify_site, qualify.Timer, capture_hooks._default_max_tokens,
                         draft_fc_hooks.serving_backends)
                if variant.startswith("qualified"):
                    os.environ["EAGLE3_OPS_QUALIFY"] = "on"
                    os.environ["XDG_CACHE_HOME"] = os.path.join(outdir, f"cache-{rank}-{variant}-{dtype}")
                    fail_rank = 1 if variant in ("qualified-fails-on-rank-1", "qualified-timer-fails-on-rank-1") else -1
                    fail_init = variant == "qualified-timer-fails-on-rank-1"
                    draft_fc_hooks.SHARDING_TIMER = lambda device: ScriptedTimer(rank, fail_rank, fail_init)
                    capture_hooks._default_max_tokens = lambda: 64  # buckets 1, 4, 16, 64 (the interpreter is slow)
                if variant in ("qualified", "qualified-fails-on-rank-1", "qualified-timer-fails-on-rank-1"):
                    draft_fc_hooks._qualify_site = lambda *a: None  # these: the sharding decision only
                elif variant in ("qualified-rank0-decides", "qualified-rank1-rejects"):
                    site_timer = SiteTimer(rank)
                    qualify.Timer = lambda device, reps=10: site_timer
                    if variant == "qualified-rank1-rejects" and rank == 1:
                        saved_qualify = qualify.qualify

                        def rejecting(*a, **k):  # rank 1 found rank 0's pick (triton/skinny) wrong
                            plan = saved_qualify(*a, **k)
                            plan.rejected += [qualify.Rejection("draft_fc", c.rows, "triton", "skinny", "simulated")
                                              for c in plan.choices]
                            return plan
                        qualify.qualify = rejecting
                elif variant == "qualified-site-fails-on-rank-1" and rank == 1:
                    def failing_site(*a):
                        raise RuntimeError("CUDA out of memory (simulated, in the site's qualification)")
                    draft_fc_hooks._qualify_site = failing_site
                elif variant == "backend-fails-on-rank-1" and rank == 1:
                    draft_fc_hooks.serving_backends = lambda *a, **k: None  # its self-check failed on this GPU
                try:
                    h.configure_capture(draft, None, eagle=False)
                finally:
                    for var in ("EAGLE3_OPS_SGLANG_SHARD_FC", "EAGLE3_OPS_QUALIFY", "XDG_CACHE_HOME"):
                        os.environ.pop(var, None)
                    draft_fc_hooks.SHARDING_TIMER = None
                    (draft_fc_hooks._qualify_site, qualify.Timer, capture_hooks._default_max_tokens,
                     draft_fc_hooks.serving_backends) = saved
                    if variant == "qualified-rank1-rejects" and rank == 1:
                        qualify.qualify = saved_qualify
                state = draft_fc_state(draft)
                rec["installed"] = state is not None
                assert state is not None or variant == "backend-fails-on-rank-1", variant
                if variant == "sharded-stepped-aside":
                    state.enabled = False  # SGLang's own fc block runs: its fc call is ColumnShardedFc.forward
                rec["sharding"] = state.sharding if state else None
                partial = state.partial_sharding if state else None
                rec["partial_sharding"] = (partial.rows, partial.sharded, partial.timings) if partial else None
                rec["site_plan"] = ([(c.rows, c.backend, c.path, c.folded) for c in state.plan.choices]
                                    if state is not None and state.plan is not None else None)
                fc = draft.model.fc
                rec["fc_class"] = type(fc).__name__
                rec["fc_weight_shape"] = tuple(fc.weight.shape)
                rec["fc_bias_shape"] = tuple(fc.bias.shape) if fc.bias is not None else None
                if isinstance(fc, ColumnShardedFc):
                    rec["rows"] = (fc.row_start, fc.rows)
                    # compared here: a full-shape copy kept for the parent would defeat the scan below
                    ckpt = torch.load(inputs_path, weights_only=False)["ckpt"]
                    rows = slice(fc.row_start, fc.row_start + fc.rows)
                    rec["rows_match_checkpoint"] = (
                        torch.equal(fc.weight, ckpt["model.fc.weight"][rows].to(dtype))
                        and torch.equal(fc.bias, ckpt["model.fc.bias"][rows].to(dtype)))
                    del ckpt
                    rec["full_fc_alive"] = len(_full_fc_tensors(full_fc_shape))
                rec["param_shapes"] = {n: tuple(p.shape) for n, p in draft.named_parameters()}
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
            rec.update(extend_gathers=counts[0], decode_gathers=counts[1], fc_module_calls=len(fc_calls),
                       fc_out=fc_out, extend_logits=ext.next_token_logits.clone(),
                       extend_hidden=ext.hidden_states.clone(), decode_logits=dec.next_token_logits.clone(),
                       decode_hidden=dec.hidden_states.clone())
            if variant != "stock" and draft_fc_state(draft) is not None:
                rec["stats"] = dict(draft_fc_state(draft).stats)
            results[(str(dtype), variant)] = rec
            del draft
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
