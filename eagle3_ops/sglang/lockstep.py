"""How TP ranks decide together without leaving one of them waiting in a collective.

Every install step that ends in a collective follows one rule: each rank first finishes its LOCAL
work (which may fail on one rank alone: its backend's self-check, an allocation, a timing), catching
the failure, and only then takes part in the collective, always, with what it has (a vote of "no"
when its local work failed). So a failure anywhere turns into the same answer everywhere, and no rank
is left blocked in a collective its peers never reach. Collectives here run on the group's CPU
(gloo) group: small int64/float64 tensors, no device sync.

* :func:`all_ranks_agree`: MIN of a 0/1 flag;
* :func:`max_over_ranks`: elementwise MAX of a float list (timings, so every rank decides the same);
* :func:`agree_on_plan`: a qualification plan (eagle3_ops.qualify.Plan) made the same on every rank:
  per row bucket rank 0's choice where every rank accepted that candidate, else stock everywhere.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import List, Optional, Sequence

import torch

log = logging.getLogger("eagle3_ops.sglang")


def _multi_rank(group) -> bool:
    return group is not None and int(group.world_size) > 1


def all_ranks_agree(ok: bool, group) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (``ok`` itself without a multi-rank group)."""
    if not _multi_rank(group):
        return bool(ok)
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return bool(flag.item())


def max_over_ranks(values: Sequence[float], group) -> List[float]:
    """Elementwise maximum of ``values`` over the ranks of ``group`` (every rank passes as many)."""
    if not _multi_rank(group):
        return [float(v) for v in values]
    import torch.distributed as dist

    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.cpu_group)
    return [float(v) for v in t.tolist()]


def same_on_all_ranks(text: str, group) -> bool:
    """Whether ``text`` is the same string on every rank (a digest compared by MIN and MAX)."""
    if not _multi_rank(group):
        return True
    import torch.distributed as dist

    digest = int(hashlib.sha1(text.encode()).hexdigest()[:15], 16)
    both = torch.tensor([digest, -digest], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group.cpu_group)
    return int(both[0]) == -int(both[1])


def _menu(op: str, device: torch.device) -> list:
    """Every candidate a plan may choose, in one order all ranks share (an index means the same
    candidate on every rank when the menus agree)."""
    from .. import qualify

    pairs = qualify.candidates(op, device)
    folds = (False, True) if op == "draft_fc" else (False,)
    return [(b, p, f) for b, p in pairs for f in folds]


def agree_on_plan(plan, op: str, device: torch.device, group, failed: bool, site: str) -> None:
    """Make ``plan`` (this rank's qualification, or None) the same on every rank of ``group``, in
    place: per row bucket rank 0's (backend, path, folded) where every rank's own qualification also
    accepted that candidate at that bucket (it ran and was correct there), else stock on every rank.
    ``failed``: this rank's qualification failed: it accepts nothing. Every rank must call this with
    plans over the same buckets (the callers qualify ``qualify.buckets_up_to`` of one agreed size)."""
    if not _multi_rank(group) or plan is None:
        return
    import torch.distributed as dist

    menu = _menu(op, device)
    menus_agree = same_on_all_ranks(repr(menu), group)
    index = {m: i for i, m in enumerate(menu)}
    mine = [index.get((c.backend, c.path, c.folded), -1) if c.backend is not None else -1 for c in plan.choices]
    rank0 = torch.tensor(mine if int(group.rank_in_group) == 0 else [-2] * len(mine), dtype=torch.int64)
    dist.all_reduce(rank0, op=dist.ReduceOp.MAX, group=group.cpu_group)  # = rank 0's indices
    rejected = {(r.rows, r.backend, r.path, r.folded) for r in plan.rejected}
    accepted = torch.tensor([int(menus_agree and not failed and (i == -1 or (c.rows, *menu[i]) not in rejected))
                             for c, i in zip(plan.choices, rank0.tolist())], dtype=torch.int64)
    dist.all_reduce(accepted, op=dist.ReduceOp.MIN, group=group.cpu_group)
    for k, (choice, i, ok) in enumerate(zip(list(plan.choices), rank0.tolist(), accepted.tolist())):
        backend, path, folded = menu[i] if (ok and i >= 0) else (None, None, False)
        if (backend, path, folded) != (choice.backend, choice.path, choice.folded):
            plan.choices[k] = dataclasses.replace(choice, backend=backend, path=path, folded=folded)
            log.info("eagle3_ops: %s: %d rows serve %s on every TP rank (%s)", site, choice.rows,
                     "stock" if backend is None else f"{backend}/{path or '-'}" + ("+folded" if folded else ""),
                     "rank 0's choice" if backend is not None else "a rank could not take rank 0's choice")


def stock_plan(plan_device: str, shape, buckets: Sequence[int], why: str):
    """A plan that serves SGLang's stock path for every bucket (a rank whose qualification failed)."""
    from .. import qualify

    return qualify.Plan(plan_device, shape, [qualify.Choice(shape.op, rows, None, None, None, None, 0.0, why)
                                             for rows in buckets])


def agreed_plan(local_plan: Optional[object], failed: bool, op: str, device: torch.device, shape,
                buckets: Sequence[int], group, site: str):
    """The plan every rank serves: this rank's (``local_plan``; a stock plan when its qualification
    ``failed``), agreed over ``group`` (:func:`agree_on_plan`)."""
    plan = local_plan
    if failed or plan is None:
        plan = stock_plan(str(device), shape, buckets, "qualification failed on this rank" if failed
                          else "not qualified")
    agree_on_plan(plan, op, device, group, failed, site)
    return plan
