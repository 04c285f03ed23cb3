"""When the draft fc is sharded and when it stays replicated (in one process: the TP group's size
and rank are faked; the TP=2 run with real gloo groups is test_tp2.py)."""
import logging

import pytest
import torch

LAYER_IDS = [0, 1, 2]


class _FakeGroup:
    """What the plugin reads of SGLang's GroupCoordinator."""

    def __init__(self, world_size, rank_in_group):
        self.world_size, self.rank_in_group = world_size, rank_in_group
        self.device_group = object()


def _draft(h, hidden=None):
    cfg = h.FAMILIES["llama"].make_config()
    dcfg = h.eagle3_draft_config(cfg, layer_ids=LAYER_IDS, fc_norm=True, hidden_size=hidden)
    return h.eagle3_draft(dcfg, torch.float32)


def _configure_in_group(h, monkeypatch, draft, world_size, rank, built=None):
    """Configure ``draft`` as if SGLang's TP group had ``world_size`` ranks. The draft's parallel
    layers keep the group they were built for in ``tp_group`` (SGLang's LinearBase): the same group
    by default, or another one of (tp_size, tp_rank) = ``built``."""
    import sglang.srt.distributed.parallel_state as ps

    group = _FakeGroup(world_size, rank)
    monkeypatch.setattr(ps, "get_tp_group", lambda: group)
    # one process plays one rank: the others of the (fake) group agree with it (the real agreement,
    # all-reduces on the group's CPU group, is tested at TP=2 in test_tp2.py)
    from eagle3_ops.sglang import lockstep

    monkeypatch.setattr(lockstep, "all_ranks_agree", lambda ok, group: ok)
    qkv = draft.model.layers[0].self_attn.qkv_proj
    assert hasattr(qkv, "tp_group")  # what the plugin reads (SGLang's own attribute)
    monkeypatch.setattr(qkv, "tp_group", group if built is None else _FakeGroup(*built))
    h.configure_capture(draft, None, eagle=False)
    from eagle3_ops.sglang.draft_fc_hooks import draft_fc_state

    return draft_fc_state(draft)


@pytest.mark.parametrize("case", ["uneven", "switch-off", "bad-switch", "group-mismatch"])
def test_fc_stays_replicated(sglang_cpu, monkeypatch, caplog, case):
    h = sglang_cpu
    draft = _draft(h)
    full = draft.model.fc.weight
    world, built, expect = 2, None, None
    if case == "uneven":
        world, expect = 3, "its 64 output rows do not split evenly over 3 TP ranks"
    elif case == "switch-off":
        monkeypatch.setenv("EAGLE3_OPS_SGLANG_SHARD_FC", "off")
        expect = "stays replicated on each of the 2 TP ranks (EAGLE3_OPS_SGLANG_SHARD_FC=0)"
    elif case == "bad-switch":
        monkeypatch.setenv("EAGLE3_OPS_SGLANG_SHARD_FC", "maybe")
        expect = ("EAGLE3_OPS_SGLANG_SHARD_FC='maybe' is not valid: expected 1/true/on or 0/false/off; "
                  "the draft fc is not sharded")
    else:
        built, expect = (4, 1), "its layers were built for TP rank 1 of 4 (another group"
    with caplog.at_level(logging.INFO, logger="eagle3_ops"):
        state = _configure_in_group(h, monkeypatch, draft, world, 0, built)
    assert state is not None and state.sharding is None  # fused fc installed, not sharded
    assert draft.model.fc.weight is full and type(draft.model.fc) is torch.nn.Linear
    messages = [r.getMessage() for r in caplog.records]
    assert sum(expect in m for m in messages) == 1, messages


def test_fc_sharded_rows_and_reload(sglang_cpu, monkeypatch):
    """Rank 1 of 2 keeps rows N/2..N; reloading the checkpoint's full fc through SGLang's
    load_weights keeps this rank's rows; a tensor that fits neither shape is refused by name."""
    h = sglang_cpu
    draft = _draft(h)
    full_weight = draft.model.fc.weight.detach().clone()
    state = _configure_in_group(h, monkeypatch, draft, 2, 1)
    fc = draft.model.fc
    from eagle3_ops.sglang.fc_sharding import ColumnShardedFc

    assert isinstance(fc, ColumnShardedFc) and state.sharding["released"]
    assert torch.equal(fc.weight, full_weight[32:]) and fc.weight.shape == (32, 192)
    new = torch.randn_like(full_weight)
    draft.load_weights([("fc.weight", new)])
    assert torch.equal(fc.weight, new[32:])
    with pytest.raises(ValueError, match="fits neither the full fc"):
        draft.load_weights([("fc.weight", torch.randn(48, 192))])


def test_no_groups_no_sharding(sglang_cpu, monkeypatch):
    """A process without SGLang's model-parallel groups (a script): nothing to shard over, and the
    fused fc is still installed. (SGLang 0.5.23's get_tp_group raises this RuntimeError there.)"""
    import sglang.srt.distributed.parallel_state as ps

    def not_initialized():
        raise RuntimeError("parallel name 'tp_group' has not been written in this process. ")

    h = sglang_cpu
    draft = _draft(h)
    monkeypatch.setattr(ps, "get_tp_group", not_initialized)
    h.configure_capture(draft, None, eagle=False)
    from eagle3_ops.sglang.draft_fc_hooks import draft_fc_state

    state = draft_fc_state(draft)
    assert state is not None and state.sharding is None
