"""SGLang's tensor-parallel group, read without tripping over its absence or its deprecation note.

In SGLang 0.5.23 ``get_tp_group()`` raises RuntimeError ("parallel name 'tp_group' has not been
written in this process") where no model-parallel groups exist (scripts), and warns
(DeprecationWarning) on every call. The plugin reads it at install time and in the sharded fc's
forward check, so it goes through here.
"""
from __future__ import annotations

import warnings
from typing import Optional, Tuple


def tp_group():
    """SGLang's current TP GroupCoordinator (the draft's inside SGLang's draft TP context), or None
    when this process has no model-parallel groups."""
    from sglang.srt.distributed import parallel_state

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return parallel_state.get_tp_group()
        except (RuntimeError, AssertionError, ValueError):  # not written / not initialized / not published
            return None


def tp_rank_size() -> Tuple[int, int]:
    """(rank, world size) in SGLang's current TP group; (0, 1) without groups."""
    group = tp_group()
    return (0, 1) if group is None else (int(group.rank_in_group), int(group.world_size))


def same_group(a, b) -> bool:
    """Whether two GroupCoordinators are the same group (same members, same communicator)."""
    if a is None or b is None:
        return a is b
    return a is b or getattr(a, "device_group", None) is getattr(b, "device_group", object())


def layer_group(layer) -> Tuple[bool, Optional[object]]:
    """(known, group) of an SGLang parallel linear layer: the group it was built for (its
    ``tp_group``; None = unsharded), or known=False when the layer does not say."""
    if layer is None or not hasattr(layer, "tp_group"):
        return False, None
    return True, layer.tp_group
