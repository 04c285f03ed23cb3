"""The draft fc sharding decision (a replicated fc under TP > 1), and the sharded fc it installs.

``llama_eagle3`` replicates its fc (3*7168 -> 7168 is 308 MB in bf16 on every rank, read in full by
every rank on every draft extend). With sharding on (the default; ``EAGLE3_OPS_SGLANG_SHARD_FC=0``
turns it off) the plugin may replace ``fc`` by a :class:`ColumnShardedFc` holding only this rank's
output rows (and bias), release the replicated weight, and follow the fused call by ONE all-gather
along the last dimension through the draft's TP group (SGLang's ``tensor_model_parallel_all_gather``).

* :func:`shard_plan`: whether it may shard at all (settings, even split, the draft's own TP group);
* :func:`decide_sharding`: per row bucket, the fused fc on the replicated weight, on this rank's rows,
  and the all-gather, each timed on every rank (the one Timer); the max of each timing over the ranks
  decides, so every rank decides the same; cached with the rest of qualification;
* :func:`commit_sharded_fc`: the swap and the release, after every rank voted (draft_fc_hooks.py).

``state`` below is the draft's ``DraftFcState`` (draft_fc_hooks.py), read for its fc and norms.
"""
from __future__ import annotations

import json
import logging
import statistics
import weakref
from typing import Callable, List, Optional, Tuple

import torch

from .. import ops, problems, qualify, qualify_cache
from ..settings import SettingError, get, report_once
from ..timing import Timer
from . import groups, lockstep
from .version import ENV_SHARD_FC

log = logging.getLogger("eagle3_ops.sglang")

_sharded_states: "weakref.WeakSet" = weakref.WeakSet()


class ColumnShardedFc(torch.nn.Module):
    """The draft's fc with only this TP rank's output rows (column-parallel): ``forward(x)`` is
    ``all_gather(linear(x, weight_rows, bias_rows), dim=-1)``, i.e. the replicated fc's output.
    Weight reloads (``load_weights`` with the checkpoint's full ``[N, K*H]`` tensor) go through the
    parameters' ``weight_loader``, which keeps the rank's rows."""

    def __init__(self, fc: torch.nn.Linear, tp_rank: int, tp_size: int):
        super().__init__()
        n = fc.out_features // tp_size
        self.in_features, self.out_features = fc.in_features, fc.out_features
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.row_start, self.rows = tp_rank * n, n
        self.weight = self._shard_parameter(fc.weight)
        self.bias = self._shard_parameter(fc.bias) if fc.bias is not None else None

    def _shard_parameter(self, full: torch.nn.Parameter) -> torch.nn.Parameter:
        rows = full.data.narrow(0, self.row_start, self.rows).clone()  # its own storage: the full one can go
        param = torch.nn.Parameter(rows, requires_grad=full.requires_grad)
        param.weight_loader = self._load_rows
        return param

    def _load_rows(self, param: torch.nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] == self.out_features and param.shape[0] == self.rows:
            loaded = loaded.narrow(0, self.row_start, self.rows)
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"eagle3_ops ColumnShardedFc (TP rank {self.tp_rank}/{self.tp_size}): checkpoint tensor "
                             f"of shape {tuple(loaded.shape)} fits neither the full fc ({self.out_features} rows) "
                             f"nor this rank's {tuple(param.shape)}")
        param.data.copy_(loaded)

    def check_group(self) -> None:
        """The TP group a forward runs under must be the one the rows were cut for."""
        rank, size = groups.tp_rank_size()
        if (size, rank) != (self.tp_size, self.tp_rank):
            raise RuntimeError(f"eagle3_ops: the draft fc was sharded for TP rank {self.tp_rank} of {self.tp_size}, "
                               f"but this forward runs in a TP group where it is rank {rank} of {size}")

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """``[M, N/tp]`` slices of every rank -> ``[M, N]`` (one all-gather, rank order)."""
        from sglang.srt.distributed.communication_op import tensor_model_parallel_all_gather

        self.check_group()
        return tensor_model_parallel_all_gather(local, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, K*H] -> [M, N]: this rank's rows of the fc, then the all-gather of every rank's [M, N/tp] slice
        (:meth:`gather`)."""
        return self.gather(torch.nn.functional.linear(x, self.weight, self.bias))

    def extra_repr(self) -> str:
        """The module's repr line: features, this rank's row range and TP rank, whether it has a bias."""
        return (f"in_features={self.in_features}, out_features={self.out_features} (rows {self.row_start}.."
                f"{self.row_start + self.rows} on TP rank {self.tp_rank}/{self.tp_size}), "
                f"bias={self.bias is not None}")



# ---- the sharding decision (a replicated fc at TP > 1) ------------------------------------------------
GATHER_REPS = 5  # timed all-gathers per bucket (after one warm-up); the same count on every rank


def timed_all_gathers(view: torch.Tensor, reps: int = GATHER_REPS) -> List[float]:
    """Exactly ``reps + 1`` all-gathers of ``view`` through the TP group (the first a warm-up), and the
    microseconds of each timed one (the one Timer, tolerant: the collective is called every time
    whatever happens to the timing around it, so every rank issues the same number)."""
    from sglang.srt.distributed.communication_op import tensor_model_parallel_all_gather

    timer = Timer(view.device, reps=reps, warmup=1, flush=None, spin=False, tolerant=True)
    return timer.samples(lambda: tensor_model_parallel_all_gather(view, dim=-1))


class ShardingPlan:
    """The TP > 1 decision per row bucket: this rank's rows of the fc + one all-gather (sharded) or
    the replicated fc, from timings every rank measured and agreed on (the max over ranks)."""

    def __init__(self, tp_rank: int, tp_size: int, rows: list, sharded: list, timings: list, cached: bool = False):
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.rows, self.sharded, self.timings = rows, sharded, timings  # timings: (full, shard, gather) us
        self.cached = cached

    @property
    def everywhere(self) -> bool:
        """Whether every row bucket is sharded (the replicated weight can be released)."""
        return all(self.sharded)

    @property
    def anywhere(self) -> bool:
        """Whether any row bucket is sharded."""
        return any(self.sharded)

    def sharded_for(self, m: int) -> bool:
        """The decision of the smallest bucket holding m rows (the largest bucket above it)."""
        for rows, sharded in zip(self.rows, self.sharded):
            if m <= rows:
                return sharded
        return self.sharded[-1]

    def rows_of(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        """(this rank's weight rows, bias rows, the all-gather) as views of the replicated tensors."""
        from sglang.srt.distributed.communication_op import tensor_model_parallel_all_gather

        n = weight.shape[0] // self.tp_size
        rank, size = groups.tp_rank_size()
        if (size, rank) != (self.tp_size, self.tp_rank):
            raise RuntimeError(f"eagle3_ops: the draft fc sharding was decided for TP rank {self.tp_rank} of "
                               f"{self.tp_size}, but this forward runs where it is rank {rank} of {size}")
        rows = weight.narrow(0, self.tp_rank * n, n)
        bias_rows = bias.narrow(0, self.tp_rank * n, n) if bias is not None else None
        return rows, bias_rows, lambda local: tensor_model_parallel_all_gather(local, dim=-1)

    def to_json(self) -> dict:
        """The plan as a JSON-able dict for the qualification cache: buckets, decisions and their (replicated, rows,
        all-gather) timings in us."""
        return {"kind": "draft_fc_sharding", "rows": list(self.rows), "sharded": list(self.sharded),
                "timings": [list(t) for t in self.timings]}

    def table(self) -> str:
        """The plan as text, one line per bucket: the replicated, rows and all-gather times in us and which one
        serves."""
        lines = [f"{'rows':>6} | {'replicated us':>13} | {'rows us':>9} | {'all-gather us':>13} | serves"]
        for rows, sharded, (full, shard, gather) in zip(self.rows, self.sharded, self.timings):
            lines.append(f"{rows:>6} | {full:>13.1f} | {shard:>9.1f} | {gather:>13.1f} | "
                         f"{'sharded' if sharded else 'replicated'}")
        return "\n".join(lines)


def sharding_made_for(state, tp_size: int, buckets) -> dict:
    """The qualification cache's ``made_for`` of this draft's sharding decision: the device, the fc's shape, dtype, bias
    and norms, the TP size, the buckets and the margin (:func:`qualify.entry_made_for`)."""
    return qualify.entry_made_for("draft_fc_sharding", state.fc.weight.device, {
        "shape": list(state.fc.weight.shape), "dtype": str(state.fc.weight.dtype), "bias": state.fc.bias is not None,
        "chunk_norm": state.fc_norm is not None, "input_norm": state.input_norm is not None, "tp": tp_size,
        "buckets": list(buckets), "margin": qualify.MARGIN})


def sharding_from_json(data, tp_rank: int, tp_size: int, buckets) -> ShardingPlan:
    """A cached decision for these buckets; raises qualify_cache.BadEntry (qualify_cache.load logs
    one line) for anything else: another shape's, a timing that is not a finite non-negative
    number, a verdict that does not follow from its timings."""
    if not isinstance(data, dict) or set(data) != {"kind", "rows", "sharded", "timings"} or \
            data["kind"] != "draft_fc_sharding":
        raise qualify_cache.BadEntry("not a draft fc sharding decision")
    rows, sharded, timings = data["rows"], data["sharded"], data["timings"]
    if rows != list(buckets) or not isinstance(sharded, list) or not isinstance(timings, list) or \
            len(sharded) != len(rows) or len(timings) != len(rows):
        raise qualify_cache.BadEntry(f"not a decision for the buckets {list(buckets)}")
    for s, t in zip(sharded, timings):
        if not isinstance(s, bool) or not isinstance(t, list) or len(t) != 3 or \
                not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf") for v in t):
            raise qualify_cache.BadEntry(f"a bucket's verdict {str(s)[:20]!r} or timings {str(t)[:60]!r} are not a "
                                         f"flag and three times")
        full, shard, gather = t
        if s != ((shard + gather) * qualify.MARGIN < full):
            raise qualify_cache.BadEntry("a verdict that does not follow from its timings")
    return ShardingPlan(tp_rank, tp_size, list(rows), list(sharded), [tuple(map(float, t)) for t in timings],
                        cached=True)


def decide_sharding(state, name: str, tp_rank: int, tp_size: int, buckets, qualifying: bool, group, *,
                    make_timer: Callable = Timer, gather_us: Optional[Callable[[int, float], float]] = None
                    ) -> Tuple[Optional[ShardingPlan], bool]:
    """(plan, ok). Per row bucket: the fused fc on the replicated weight, on this rank's rows, and the
    all-gather of [M, N/tp] through the draft's TP group, each timed on every rank; the max of each
    timing over the ranks decides (so every rank decides the same); a bucket is sharded when rows +
    all-gather beat replicated by qualify.MARGIN. Cached per device, shapes and TP size (used only when
    every rank holds the same cached decision). ``(None, True)`` when qualification is off (sharded for
    every bucket: the memory it frees is certain, the speed unmeasured); ``ok`` False when a rank failed
    (every rank then keeps the fc stock). ``make_timer(device)``: the fc timer (default the one Timer);
    ``gather_us(rows, measured us)``: what the all-gather timing reads as (default: the measurement)."""
    if not qualifying:
        return None, True
    made_for = sharding_made_for(state, tp_size, buckets)
    cached = qualify_cache.load(made_for, lambda value: sharding_from_json(value, tp_rank, tp_size, buckets))
    hit = cached is not None
    if lockstep.all_ranks_agree(hit, group) and lockstep.same_on_all_ranks(json.dumps(cached.to_json()) if hit else "",
                                                                           group):
        log_sharding(cached, name, tp_size)
        return cached, True

    fc = state.fc
    weight, bias = fc.weight, fc.bias
    n = weight.shape[0] // tp_size
    rows_w = weight.narrow(0, tp_rank * n, n)
    rows_b = bias.narrow(0, tp_rank * n, n) if bias is not None else None
    chunk, input_norm_weight = state.chunk_norm_weight, state.input_norm_weight
    # local work (may fail on this rank): the fc timings, and everything the timed all-gathers need
    measured, local, timer = [], None, None
    try:
        timer = make_timer(weight.device)
        with torch.no_grad():
            for m in buckets:
                gen = problems.generator(weight.device, "sharding", m, weight.shape[1])
                x = problems.randn((m, weight.shape[1]), weight.dtype, weight.device, gen, scale=3.0)
                measured.append([
                    timer(lambda x=x: ops.draft_fc(x, weight, bias, None, chunk, input_norm_weight, state.eps)),
                    timer(lambda x=x: ops.draft_fc(x, rows_w, rows_b, None, chunk, input_norm_weight, state.eps)),
                ])
                del x
            local = torch.zeros((buckets[-1], n), dtype=weight.dtype, device=weight.device)
            probe = torch.empty((buckets[-1], n * tp_size), dtype=weight.dtype, device=weight.device)
            del probe  # the largest all-gather output fits (the caching allocator keeps the block)
        ready = True
    except Exception:
        log.exception("eagle3_ops: draft %s fc: timing the sharded and replicated fc failed on this rank", name)
        ready = False
    if not lockstep.all_ranks_agree(ready, group):
        return None, False
    # the timed all-gathers: collectives every rank reaches the same number of times, whatever fails
    # around them on this rank (the timing is read after each; a failure there is caught and voted on)
    gather_ok = True
    with torch.no_grad():
        for m, row in zip(buckets, measured):
            times = timed_all_gathers(local[:m])
            try:
                us = statistics.median(times) if times else float("nan")
                row.append(float(gather_us(m, us) if gather_us is not None else us))
                if not row[-1] == row[-1]:  # NaN: an event that failed
                    raise RuntimeError("no all-gather timing")
            except Exception:
                if gather_ok:
                    log.exception("eagle3_ops: draft %s fc: timing the all-gather failed on this rank", name)
                gather_ok = False
                row.append(float("inf"))
    del local
    if not lockstep.all_ranks_agree(gather_ok, group):
        return None, False
    flat = lockstep.max_over_ranks([v for row in measured for v in row], group)
    timings = [tuple(flat[3 * i:3 * i + 3]) for i in range(len(buckets))]
    sharded = [(shard + gather) * qualify.MARGIN < full for full, shard, gather in timings]
    plan = ShardingPlan(tp_rank, tp_size, list(buckets), sharded, timings)
    qualify_cache.store(made_for, plan.to_json())
    log_sharding(plan, name, tp_size)
    return plan, True


def log_sharding(plan: ShardingPlan, name: str, tp_size: int) -> None:
    """Logs the sharding decision for draft ``name`` at ``tp_size`` (the verdict, whether cached, the margin), then the
    plan's table line by line, at INFO."""
    verdict = ("sharded for every bucket" if plan.everywhere else "replicated for every bucket (stock)"
               if not plan.anywhere else "sharded for some buckets: the replicated weight stays (no memory "
               "released), those buckets read this rank's rows of it")
    log.info("eagle3_ops: draft %s fc at TP=%d: %s (%s; max over ranks of each timing; sharded needs rows + "
             "all-gather %.0f%% faster than replicated)", name, tp_size, verdict,
             "cached" if plan.cached else "measured now", (qualify.MARGIN - 1) * 100)
    for line in plan.table().splitlines():
        log.info("eagle3_ops: draft %s fc sharding %s", name, line)


def shard_plan(inner, head, name: str):
    """(tp_rank, tp_size) to shard the replicated draft fc over, or None to keep it replicated (one log
    line when TP > 1 and it stays replicated)."""
    fc = head.fc
    group = groups.tp_group()
    if group is None:  # no model-parallel groups in this process (a script): nothing to shard over
        return None
    tp_size, tp_rank = int(group.world_size), int(group.rank_in_group)
    if tp_size <= 1:
        return None
    try:
        enabled = get(ENV_SHARD_FC)
    except SettingError as e:
        report_once(e, log)
        return None
    if not enabled:
        log.info("eagle3_ops: draft %s fc stays replicated on each of the %d TP ranks (%s=0)", name, tp_size,
                 ENV_SHARD_FC)
        return None
    if fc.out_features % tp_size:
        log.info("eagle3_ops: draft %s fc stays replicated: its %d output rows do not split evenly over %d TP "
                 "ranks", name, fc.out_features, tp_size)
        return None
    # The draft's own parallel layers were built in the TP group SGLang gives the draft (their
    # ``tp_group``); the fc rows must be cut for that group, the one its forwards run in.
    qkv = getattr(getattr(getattr(inner, "layers", [None])[0], "self_attn", None), "qkv_proj", None)
    known, built = groups.layer_group(qkv)
    if known and not groups.same_group(built, group):
        b_rank, b_size = (0, 1) if built is None else (int(built.rank_in_group), int(built.world_size))
        log.info("eagle3_ops: draft %s fc stays replicated: its layers were built for TP rank %d of %d (another "
                 "group than the one it is configured in, where this is rank %d of %d)", name, b_rank, b_size,
                 tp_rank, tp_size)
        return None
    return tp_rank, tp_size


def commit_sharded_fc(state, name: str, sharded: ColumnShardedFc, tp_size: int) -> None:
    """Swap the prepared sharded fc in and release the replicated weight (every rank voted for it)."""
    inner, full = state.inner, state.fc
    full_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    gone = [weakref.ref(p) for p in full.parameters()]
    inner.fc = sharded
    state.fc = sharded
    state.head.fc = sharded
    del full
    shard_bytes = sum(p.numel() * p.element_size() for p in sharded.parameters())
    released = all(ref() is None for ref in gone)
    log.info("eagle3_ops: draft %s fc sharded over %d TP ranks: this rank (%d) keeps rows %d..%d (%.1f MiB of "
             "%.1f MiB); each draft extend reads %.1f MiB of fc weight instead of %.1f MiB and adds one all-gather "
             "of [M, %d] along the last dim through the draft's TP group; %s", name, tp_size, sharded.tp_rank,
             sharded.row_start, sharded.row_start + sharded.rows, shard_bytes / 2**20, full_bytes / 2**20,
             shard_bytes / 2**20, full_bytes / 2**20, sharded.out_features,
             f"the replicated weight ({full_bytes / 2**20:.1f} MiB) was released" if released else
             "the replicated weight is still referenced elsewhere and was NOT released")
    state.sharding = {"tp_rank": sharded.tp_rank, "tp_size": tp_size, "released": released,
                      "bytes_before": full_bytes, "bytes_after": shard_bytes}
    _sharded_states.add(state)


def sharded_bytes_released() -> int:
    """Bytes of replicated draft fc weights released in this process so far (for the capture
    buffer's log line: what sharding gave back, next to what the buffer costs)."""
    return sum(s.sharding["bytes_before"] - s.sharding["bytes_after"] for s in list(_sharded_states)
               if s.sharding and s.sharding["released"])
