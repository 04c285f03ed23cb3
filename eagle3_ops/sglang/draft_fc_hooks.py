"""Draft side: SGLang's llama_eagle3 fc block as one ``eagle3::draft_fc`` call.

Stock ``sglang.srt.models.llama_eagle3.LlamaModel.forward`` does, on the first draft step (when the
input is the target's ``[T, K*H]`` aux states):

    if input_norm:  h = input_norm(h)                   # RMSNorm over the K*H row, rounded
    if fc_norm:     h = cat([norm_k(chunk_k(h))])        # RMSNorm per H slot, rounded, cat
    h = fc(h)                                            # replicated nn.Linear K*H -> H_draft

With this module installed the draft's forward computes ``draft_fc(h, fc.weight, fc.bias,
chunk_norm_weight, input_norm_weight, eps)`` (norms folded, fp32 throughout, one rounding), puts the
result where the draft reads its input (``forward_batch.spec_info.hidden_states``) for the duration
of the call, and runs SGLang's own forward, which then sees an H-wide input and skips its fc block.
Later draft steps (H-wide input) run stock.

Under TP > 1 SGLang's llama_eagle3 replicates ``fc`` (3*7168 -> 7168 is 308 MB in bf16 on every
rank, read in full by every rank on every draft extend). With sharding on (the default;
``EAGLE3_OPS_SGLANG_SHARD_FC=0`` turns it off) the plugin replaces ``fc`` by a
:class:`ColumnShardedFc` holding only this rank's output rows ``r*N/tp .. (r+1)*N/tp`` (and bias),
releases the replicated weight, and the fused call computes the rank's ``[M, N/tp]`` slice (the input
norms work on full input rows, which every rank has), followed by ONE all-gather along the last
dimension through the draft's TP group: SGLang's ``tensor_model_parallel_all_gather``, the
collective its ColumnParallelLinear(gather_output=True) uses, which SGLang's graph runners capture
(NCCL; no host sync). Its own forward (the same slice + all-gather) keeps SGLang's stock fc path
correct for any forward the fused call does not take. Uneven N stays replicated (one log line).

The forward is wrapped on llama_eagle3's LlamaModel
class, keyed on the instance's state (routing.py), so SGLang's compile trampolines still reach it;
under ``torch.compile`` tracing it steps aside. The weights are the draft's own parameters: ``fc.weight``
is passed as is, and the K ``fc_norm`` weights are re-pointed once to rows of one ``[K, H]`` tensor
so the op reads them without a copy (no second copy of any weight).
"""
from __future__ import annotations

import logging
import sys
import weakref
from typing import List, Optional

import torch

from .. import ops
from .capture_hooks import _warn_once, serving_backends
from .routing import forward_owner, routing_problem, wrap_class_forward

log = logging.getLogger("eagle3_ops.sglang")

_STATE_ATTR = "_eagle3_ops_draft_fc"
_sharded_states: "weakref.WeakSet" = weakref.WeakSet()
_folded_states: "weakref.WeakSet" = weakref.WeakSet()  # states keeping a folded fc weight
DRAFT_MODULE = "sglang.srt.models.llama_eagle3"


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
        from .groups import tp_rank_size

        rank, size = tp_rank_size()
        if (size, rank) != (self.tp_size, self.tp_rank):
            raise RuntimeError(f"eagle3_ops: the draft fc was sharded for TP rank {self.tp_rank} of {self.tp_size}, "
                               f"but this forward runs in a TP group where it is rank {rank} of {size}")

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """``[M, N/tp]`` slices of every rank -> ``[M, N]`` (one all-gather, rank order)."""
        from sglang.srt.distributed.communication_op import tensor_model_parallel_all_gather

        self.check_group()
        return tensor_model_parallel_all_gather(local, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gather(torch.nn.functional.linear(x, self.weight, self.bias))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (rows {self.row_start}.."
                f"{self.row_start + self.rows} on TP rank {self.tp_rank}/{self.tp_size}), "
                f"bias={self.bias is not None}")


class DraftFcState:
    def __init__(self, inner, fc, input_norm, fc_norm, eps: float):
        self.inner = inner
        self.fc = fc
        self.input_norm = input_norm
        self.fc_norm = fc_norm
        self.eps = eps
        self.enabled = True
        self.stats = {"fused_calls": 0, "stock_calls": 0}
        self.routing_warned = False
        self.chunk_norm_weight: Optional[torch.Tensor] = None
        self.sharding: Optional[dict] = None    # set when the fc was sharded over TP ranks
        self.workspace: Optional[torch.Tensor] = None  # the plugin's own draft_fc scratch (allocate_workspace)
        self.plan = None  # qualify.Plan: (backend, path) or stock per row bucket (None: not qualified)
        # ShardingPlan when TP > 1 qualification chose sharded rows for some row buckets only (the
        # replicated weight stays; those buckets compute this rank's rows of it + one all-gather)
        self.partial_sharding: Optional["ShardingPlan"] = None
        # fc.weight with the norm weights folded in (eagle3_ops.fold_norm_weights), kept only when
        # qualification chose a folded candidate for some bucket; re-folded after every load_weights
        self.folded_weight: Optional[torch.Tensor] = None
        self.name = type(inner).__name__  # the draft's class name in log lines (install sets it)
        if fc_norm is not None:
            self._share_chunk_norm_storage()

    @property
    def input_norm_weight(self) -> Optional[torch.Tensor]:
        return self.input_norm.weight if self.input_norm is not None else None

    def refold(self) -> None:
        """(Re)compute the folded weight from the current fc and norm weights, in place."""
        if self.folded_weight is None:
            return
        input_norm_weight = self.input_norm_weight
        ops.fold_norm_weights(self.fc.weight, self.chunk_weight(), input_norm_weight, out=self.folded_weight)

    def _share_chunk_norm_storage(self) -> None:
        """Re-point the K fc_norm weights to rows of one [K, H] tensor (same values, one storage)."""
        weights = [norm.weight for norm in self.fc_norm]
        stacked = torch.stack([w.data for w in weights])
        for k, w in enumerate(weights):
            w.data = stacked[k]
        self.chunk_norm_weight = stacked

    def allocate_workspace(self, max_tokens: int) -> int:
        """The draft_fc scratch for up to ``max_tokens`` rows, owned by the plugin: allocated once
        here (when the draft is installed, before SGLang sizes its KV cache and outside any CUDA-graph
        pool) instead of growing inside a graph capture. Returns its bytes."""
        weight = self.fc.weight
        input_norm_weight = self.input_norm_weight
        # the weights calls are made with: the fc's, and this rank's rows of it under partial sharding
        # (fewer rows can plan more splits, so more partials)
        weights = [(weight, self.fc.bias)]
        if self.partial_sharding is not None:
            rows, bias_rows, _ = self.partial_sharding.rows_of(weight, self.fc.bias)
            weights.append((rows, bias_rows))
        need = 0
        # every M where the planned split count changes (the skinny range, up to 256) and the larger
        # buckets: the bytes are monotone in M within a path and split count
        for m in sorted(set(range(1, 257)) | {512, 1024, 2048, 4096, int(max_tokens)}):
            if m > max_tokens:
                continue
            x = torch.empty((m, self.fc.in_features), dtype=weight.dtype, device="meta")
            for folded in (False, True) if self.chunk_norm_weight is not None or input_norm_weight is not None \
                    else (False,):
                if folded and weight.dtype == torch.float16 and input_norm_weight is not None:
                    continue  # never folded (validation.FOLDED_FP16_INPUT_NORM)
                for w, b in weights:
                    need = max(need, ops.draft_fc_workspace_bytes(x, w, b, None, self.chunk_norm_weight,
                                                                  input_norm_weight, norm_folded=folded))
        self.workspace = torch.empty(need, dtype=torch.uint8, device=weight.device) if need else None
        return need

    def workspace_for(self, h: torch.Tensor, weight, bias, chunk, input_norm_weight,
                      folded: bool = False) -> Optional[torch.Tensor]:
        """The plugin's workspace when it is large enough for this call (the weight and bias it is
        made with), else None (the face's per-stream scratch serves it)."""
        ws = self.workspace
        if ws is None:
            return None
        need = ops.draft_fc_workspace_bytes(h, weight, bias, None, chunk, input_norm_weight, norm_folded=folded)
        return ws if need <= ws.numel() else None

    def chunk_weight(self) -> Optional[torch.Tensor]:
        if self.fc_norm is None:
            return None
        stacked = self.chunk_norm_weight
        H = stacked.shape[1]
        if all(norm.weight.data_ptr() == stacked.data_ptr() + k * H * stacked.element_size()
               for k, norm in enumerate(self.fc_norm)):
            return stacked
        # The weights were replaced since (a reload that assigned new tensors): share again. This
        # never happens inside a CUDA-graph capture, where weights are fixed.
        self._share_chunk_norm_storage()
        return self.chunk_norm_weight


def _plain_rmsnorm(norm) -> Optional[str]:
    from sglang.srt.layers import layernorm

    if type(norm) is not layernorm.RMSNorm:
        return f"{type(norm).__name__} is not a plain RMSNorm"
    if norm.cast_x_before_out_mul or norm.variance_size_override is not None or not norm.has_weight:
        return "RMSNorm variant (cast_x_before_out_mul / variance override / no weight)"
    if norm.override_orig_dtype is not None:
        return "RMSNorm with override_orig_dtype"
    return None


def is_eagle3_draft(model) -> bool:
    """Whether ``model`` belongs to SGLang's EAGLE-3 draft family (``*_eagle3`` model modules,
    ``...Eagle3...`` classes). Other models with an inner ``.fc`` (EAGLE/EAGLE-2 drafts, targets)
    are not this module's business and are passed over without a word."""
    inner = getattr(model, "model", None)
    for obj in (model, inner):
        if obj is None:
            continue
        cls = type(obj)
        if cls.__module__.rsplit(".", 1)[-1].endswith("eagle3") or "eagle3" in cls.__name__.lower():
            return True
    return False


def _supported_draft(inner):
    """The class whose forward the plugin wraps, if ``inner`` runs llama_eagle3's LlamaModel.forward."""
    module = sys.modules.get(DRAFT_MODULE)
    cls = getattr(module, "LlamaModel", None) if module is not None else None
    return forward_owner(inner, cls) if cls is not None else None


def _run_draft_forward(state: DraftFcState, original, inner, args, kwargs):
    """One forward of a patched draft (``original``: llama_eagle3 LlamaModel's stock forward)."""
    forward_batch = kwargs["forward_batch"] if "forward_batch" in kwargs else (args[2] if len(args) > 2 else None)
    fc = state.fc
    spec = getattr(forward_batch, "spec_info", None)
    h = getattr(spec, "hidden_states", None)
    if (not state.enabled or not isinstance(h, torch.Tensor) or h.dim() != 2
            or h.shape[-1] != fc.in_features or h.shape[-1] == inner.config.hidden_size
            or h.dtype != fc.weight.dtype or h.device != fc.weight.device
            or (h.shape[-1] > 1 and h.stride(-1) != 1)):
        state.stats["stock_calls"] += 1
        return original(inner, *args, **kwargs)
    choice = state.plan.choice_for(h.shape[0]) if state.plan is not None else None
    if choice is not None and choice.backend is None:  # qualification: stock is faster for this many rows
        state.stats["stock_calls"] += 1
        return original(inner, *args, **kwargs)
    input_norm_weight = state.input_norm_weight
    chunk = state.chunk_weight()
    from .. import dispatch, plans

    folded = choice is not None and choice.folded and state.folded_weight is not None
    weight, bias, gather = (state.folded_weight if folded else fc.weight), fc.bias, None
    if isinstance(fc, ColumnShardedFc):
        gather = fc.gather
    elif state.partial_sharding is not None and state.partial_sharding.sharded_for(h.shape[0]):
        weight, bias, gather = state.partial_sharding.rows_of(weight, bias)
    with dispatch.using(choice.backend if choice else None), plans.forced_path(choice.path if choice else None):
        x = ops.draft_fc(h, weight, bias, None, chunk, input_norm_weight, state.eps,
                         workspace=state.workspace_for(h, weight, bias, chunk, input_norm_weight, folded),
                         norm_folded=folded)
    if gather is not None:
        x = gather(x)  # [M, N/tp] -> [M, N]: the one collective sharding adds
    state.stats["fused_calls"] += 1
    spec.hidden_states = x
    try:
        return original(inner, *args, **kwargs)
    finally:
        spec.hidden_states = h


def install_draft_fc(model) -> Optional[DraftFcState]:
    """Run ``model``'s (an SGLang EAGLE-3 draft) fc block as one eagle3::draft_fc call. Returns the
    state, or None when the draft is left stock (with one warning if it is an EAGLE-3 draft).
    Nothing is changed on the model until every check passed."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "fc") or not is_eagle3_draft(model):
        return None
    existing = inner.__dict__.get(_STATE_ATTR)
    if existing is not None:
        return existing
    name = type(model).__name__
    owner = _supported_draft(inner)
    if owner is None:
        _warn_once(f"draft:{name}", "eagle3_ops: draft %s (%s) is not supported; its fc runs stock",
                   name, type(inner).__module__)
        return None
    fc = inner.fc
    if type(fc) is not torch.nn.Linear:
        _warn_once(f"draftfc:{name}", "eagle3_ops: draft %s fc is %s, not nn.Linear; its fc runs stock",
                   name, type(fc).__name__)
        return None
    input_norm = getattr(inner, "input_norm", None)
    fc_norm = getattr(inner, "fc_norm", None)
    norms = ([input_norm] if input_norm is not None else []) + (list(fc_norm) if fc_norm is not None else [])
    for norm in norms:
        why = _plain_rmsnorm(norm)
        if why is None and norm.weight.dtype != fc.weight.dtype:
            why = f"norm weight is {norm.weight.dtype}, fc weight is {fc.weight.dtype}"
        if why is not None:
            _warn_once(f"draftnorm:{name}", "eagle3_ops: draft %s: %s; its fc runs stock", name, why)
            return None
    eps_values = {float(n.variance_epsilon) for n in norms}
    if len(eps_values) > 1:
        _warn_once(f"drafteps:{name}", "eagle3_ops: draft %s norms use different eps %s; its fc runs stock",
                   name, sorted(eps_values))
        return None
    if fc_norm is not None and len(fc_norm) * fc_norm[0].weight.shape[0] != fc.in_features:
        _warn_once(f"draftshape:{name}", "eagle3_ops: draft %s fc_norm does not tile fc input; stock", name)
        return None
    eps = eps_values.pop() if eps_values else 1e-6
    # Everything above depends only on the model and the settings: the same on every TP rank. From
    # here on a rank may fail alone (a backend's self-check on its GPU, memory), so when collectives
    # follow (sharding) the ranks first agree that all of them can go on.
    shard = _shard_plan(inner, fc, name)
    tp = _tp_size()
    backend, state = None, None
    try:
        backend = serving_backends(("draft_fc",), fc.weight.device, fc.weight.dtype, f"draft {name} fc")
        if backend is not None:
            state = DraftFcState(inner, fc, input_norm, fc_norm, eps)
    except Exception:
        log.exception("eagle3_ops: draft %s fc: could not prepare the fused fc on this rank", name)
    # All TP ranks run the fused fc or none does (ranks with different fc kernels would hold
    # differently rounded copies of what TP treats as one activation; with sharding, collectives).
    if tp > 1 and not _all_ranks_agree(state is not None):
        log.warning("eagle3_ops: draft %s fc stays stock on every TP rank: %s", name,
                    "this rank cannot run it fused" if state is None else "another TP rank cannot run it fused")
        return None
    if state is None:  # (TP = 1) serving_backends has said why
        return None
    from .capture_hooks import _default_max_tokens

    max_tokens = _default_max_tokens()
    # class level, so that SGLang's compile trampolines (which call type(module).forward) reach it
    wrap_class_forward(owner, _STATE_ATTR, _run_draft_forward)
    inner.__dict__[_STATE_ATTR] = state
    log.info("eagle3_ops: patched %s fc block (input_norm=%s, fc_norm=%s, fc %d->%d, bias=%s) -> one "
             "eagle3::draft_fc call, same weight storage; backend draft_fc=%s", name,
             "yes" if input_norm is not None else "no", "yes" if fc_norm is not None else "no",
             fc.in_features, fc.out_features, "yes" if fc.bias is not None else "no", backend["draft_fc"])
    if shard is not None:
        del fc  # the replicated fc must have no reference left here when it is swapped out
        sharding = _qualify_sharding(state, name, *shard, max_tokens)
        if sharding is None or sharding.everywhere:
            _install_sharded_fc(state, name, *shard)
        elif sharding.anywhere:
            state.partial_sharding = sharding
    try:
        nbytes = state.allocate_workspace(max_tokens)
        if nbytes:
            log.info("eagle3_ops: draft %s fc workspace: %.1f MiB on %s, owned by the plugin (allocated once, "
                     "outside CUDA-graph pools)", name, nbytes / 2**20, state.fc.weight.device)
    except Exception:  # e.g. out of memory: the face's per-stream scratch serves instead
        log.exception("eagle3_ops: draft %s fc: no plugin-owned workspace on this rank", name)
        state.workspace = None
    failed = False
    try:
        _qualify_site(state, name, max_tokens)
    except Exception:
        if tp <= 1:
            raise
        log.exception("eagle3_ops: draft %s fc: qualification failed on this rank", name)
        failed = True
    from .. import qualify

    if tp > 1 and qualify.enabled(state.fc.weight.device):  # every rank gets here (collectives)
        _agree_with_rank0(state, name, qualify.buckets_up_to(max_tokens), failed)
    _keep_folded_weight(model, state, name)
    return state


def _tp_size() -> int:
    from .groups import tp_group

    group = tp_group()
    return int(group.world_size) if group is not None else 1


def _keep_folded_weight(model, state: DraftFcState, name: str) -> None:
    """When qualification chose a folded candidate for some bucket: prepare the folded weight once
    (one more copy of this rank's fc weight, allocated here, before SGLang sizes its KV cache) and
    re-fold it after every ``load_weights`` of the draft (weight updates copy into the parameters in
    place; a stale folded copy would serve old weights)."""
    plan = state.plan
    if plan is None or not any(c.folded for c in plan.choices):
        return
    input_norm_weight = state.input_norm_weight
    try:
        state.folded_weight = ops.fold_norm_weights(state.fc.weight, state.chunk_weight(), input_norm_weight)
    except (ValueError, RuntimeError) as e:  # cannot fold / out of memory: those buckets take the unfolded weight
        log.warning("eagle3_ops: draft %s fc: folded weight not prepared (%s); the unfolded weight serves", name, e)
        return
    load = getattr(model, "load_weights", None)
    if load is not None and not getattr(load, "_eagle3_refolds", False):
        def load_weights(*args, **kwargs):
            result = load(*args, **kwargs)
            state.refold()
            return result

        load_weights._eagle3_refolds = True
        model.load_weights = load_weights
    state.name = name
    _folded_states.add(state)
    rows = [c.rows for c in plan.choices if c.folded]
    log.info("eagle3_ops: draft %s fc: folded norm weights prepared for row buckets %s (%.1f MiB, one copy of "
             "this rank's fc weight; re-folded after every load_weights and every SGLang online weight update)",
             name, rows, state.folded_weight.numel() * state.folded_weight.element_size() / 2**20)


def refold_all() -> List[str]:
    """Fold every kept folded draft fc weight again from its current fc and norm weights (after an
    online weight update). Returns one message per draft whose fold failed (logged as an ERROR):
    its folded buckets then do not serve the updated weights (CUDA graphs hold the copy's address);
    a refused fold (fp16 overflow) leaves the copy as it was, an out-of-memory may leave it mixed."""
    failures = []
    for state in list(_folded_states):
        try:
            state.refold()
        except Exception as e:
            msg = (f"eagle3_ops: draft {state.name} fc: the updated weights could not be folded ({e}); its folded "
                   f"buckets do not serve the updated weights; restart (EAGLE3_OPS_QUALIFY=off serves unfolded)")
            log.exception(msg)
            failures.append(msg)
    return failures


def _site_shape(state: DraftFcState):
    """The qualify.Shape of this draft's fc site (this rank's rows when the fc is sharded)."""
    from .. import qualify

    inner, weight = state.inner, state.fc.weight
    K = int(getattr(inner, "num_aux_hidden_states", 0) or (len(state.fc_norm) if state.fc_norm is not None else 3))
    return qualify.Shape("draft_fc", state.fc.in_features // K, K, state.fc.out_features if not state.sharding
                         else state.fc.rows, str(weight.dtype).replace("torch.", ""), state.fc.bias is not None,
                         state.fc_norm is not None, state.input_norm is not None)


def _qualify_site(state: DraftFcState, name: str, max_tokens: int) -> None:
    """Qualification (eagle3_ops/qualify.py) of the fused fc at this draft's own shapes and weights:
    per row bucket the fastest correct (backend, path), or SGLang's stock fc block where none beats
    it. Runs eagerly at install (before graph capture); logged as one table."""
    from .. import qualify

    weight = state.fc.weight
    if not qualify.enabled(weight.device):
        return
    input_norm_weight = state.input_norm_weight
    tensors = {"weight": weight, "bias": state.fc.bias, "chunk_norm_weight": state.chunk_norm_weight,
               "input_norm_weight": input_norm_weight, "eps": state.eps}
    plan = qualify.qualify(_site_shape(state), weight.device, qualify.buckets_up_to(max_tokens), tensors=tensors)
    state.plan = plan
    for line in plan.table().splitlines():
        log.info("eagle3_ops: draft %s fc %s", name, line)


# Replaces qualify.Timer for the sharding decision (tests: scripted, rank-dependent timings).
SHARDING_TIMER = None


class ShardingPlan:
    """The TP > 1 decision per row bucket: this rank's rows of the fc + one all-gather (sharded) or
    the replicated fc, from timings every rank measured and agreed on (the max over ranks)."""

    def __init__(self, tp_rank: int, tp_size: int, rows: list, sharded: list, timings: list):
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.rows, self.sharded, self.timings = rows, sharded, timings  # timings: (full, shard, gather) us

    @property
    def everywhere(self) -> bool:
        return all(self.sharded)

    @property
    def anywhere(self) -> bool:
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

        from .groups import tp_rank_size

        n = weight.shape[0] // self.tp_size
        rank, size = tp_rank_size()
        if (size, rank) != (self.tp_size, self.tp_rank):
            raise RuntimeError(f"eagle3_ops: the draft fc sharding was decided for TP rank {self.tp_rank} of "
                               f"{self.tp_size}, but this forward runs where it is rank {rank} of {size}")
        rows = weight.narrow(0, self.tp_rank * n, n)
        bias_rows = bias.narrow(0, self.tp_rank * n, n) if bias is not None else None
        return rows, bias_rows, lambda local: tensor_model_parallel_all_gather(local, dim=-1)

    def table(self) -> str:
        lines = [f"{'rows':>6} | {'replicated us':>13} | {'rows us':>9} | {'all-gather us':>13} | serves"]
        for rows, sharded, (full, shard, gather) in zip(self.rows, self.sharded, self.timings):
            lines.append(f"{rows:>6} | {full:>13.1f} | {shard:>9.1f} | {gather:>13.1f} | "
                         f"{'sharded' if sharded else 'replicated'}")
        return "\n".join(lines)


def _qualify_sharding(state: DraftFcState, name: str, tp_rank: int, tp_size: int,
                      max_tokens: int) -> Optional[ShardingPlan]:
    """Time, per row bucket, the fused fc on the replicated weight, on this rank's rows, and the
    all-gather of [M, N/tp] through the draft's TP group; the ranks take the max of each timing over
    the group (an all-reduce on its CPU group), so every rank decides the same. A bucket is sharded
    when rows + all-gather beat replicated by qualify.MARGIN. None when qualification is off (then
    the fc is sharded for every bucket: the memory it frees is certain, the speed unmeasured)."""
    import torch.distributed as dist
    from sglang.srt.distributed.communication_op import tensor_model_parallel_all_gather

    from .. import qualify, testing
    from .groups import tp_group

    fc = state.fc
    weight, bias = fc.weight, fc.bias
    if not qualify.enabled(weight.device):
        return None
    group = tp_group()
    n = weight.shape[0] // tp_size
    rows_w = weight.narrow(0, tp_rank * n, n)
    rows_b = bias.narrow(0, tp_rank * n, n) if bias is not None else None
    chunk = state.chunk_norm_weight
    input_norm_weight = state.input_norm_weight
    buckets = qualify.buckets_up_to(max_tokens)
    # Every rank must reach every collective below: first the local work (which may fail, e.g. out
    # of memory), then one all-reduce of "done" so that all ranks go on or all give up together.
    # Not covered: a failure inside the timed all-gathers themselves, after every rank has shown it
    # holds the memory they need (the largest output is allocated and freed before the vote).
    measured, local = [], None
    try:
        timer = SHARDING_TIMER(weight.device) if SHARDING_TIMER is not None else qualify.Timer(weight.device)
        with torch.no_grad():
            for m in buckets:
                gen = testing.generator(weight.device, "sharding", m, weight.shape[1])
                x = testing.randn((m, weight.shape[1]), weight.dtype, weight.device, gen, scale=3.0)
                measured.append([
                    timer(lambda: ops.draft_fc(x, weight, bias, None, chunk, input_norm_weight, state.eps)),
                    timer(lambda: ops.draft_fc(x, rows_w, rows_b, None, chunk, input_norm_weight, state.eps)),
                ])
                del x
            local = torch.zeros((buckets[-1], n), dtype=weight.dtype, device=weight.device)
            probe = torch.empty((buckets[-1], n * tp_size), dtype=weight.dtype, device=weight.device)
            del probe  # the largest all-gather output fits (the caching allocator keeps the block)
        done = 1
    except Exception:
        log.exception("eagle3_ops: draft %s fc: timing the sharded and replicated fc failed on this rank", name)
        done = 0
    if not _all_ranks_agree(bool(done)):
        log.warning("eagle3_ops: draft %s fc at TP=%d: the sharding could not be qualified on every rank; sharded "
                    "for every bucket (the unqualified default)", name, tp_size)
        return None
    with torch.no_grad():
        for m, row in zip(buckets, measured):
            view = local[:m]
            row.append(timer(lambda: tensor_model_parallel_all_gather(view, dim=-1)))
    del local
    agreed = torch.tensor(measured, dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group.cpu_group)
    timings = [tuple(float(v) for v in row) for row in agreed.tolist()]
    sharded = [(shard + gather) * qualify.MARGIN < full for full, shard, gather in timings]
    plan = ShardingPlan(tp_rank, tp_size, buckets, sharded, timings)
    verdict = ("sharded for every bucket" if plan.everywhere else "replicated for every bucket (stock)"
               if not plan.anywhere else "sharded for some buckets: the replicated weight stays (no memory "
               "released), those buckets read this rank's rows of it")
    log.info("eagle3_ops: draft %s fc at TP=%d: %s (max over ranks of each timing; sharded needs rows + "
             "all-gather %.0f%% faster than replicated)", name, tp_size, verdict, (qualify.MARGIN - 1) * 100)
    for line in plan.table().splitlines():
        log.info("eagle3_ops: draft %s fc sharding %s", name, line)
    return plan


def _all_ranks_agree(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank of the current TP group (all-reduce MIN on its CPU group);
    ``ok`` itself without a group of more than one rank."""
    import torch.distributed as dist

    from .groups import tp_group

    group = tp_group()
    if group is None or int(group.world_size) <= 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return bool(flag.item())


def _agree_with_rank0(state: DraftFcState, name: str, buckets, failed: bool) -> None:
    """Under TP > 1 every rank serves each row bucket the same way: rank 0's choice (backend, path,
    folded) where every rank's own qualification also accepted that candidate (it was correct
    there), else SGLang's stock fc on every rank. Two reasons: with partial sharding a fused call
    all-gathers and a stock call does not (different collectives hang); and with a replicated fc,
    ranks running different kernels would hold differently rounded copies of activations that TP
    treats as identical. ``failed``: this rank's qualification failed: it accepts nothing (stock
    everywhere). Every rank calls this (all-reduces on the TP group's CPU group)."""
    import dataclasses
    import hashlib

    import torch.distributed as dist

    from .. import qualify
    from .groups import tp_group

    from .. import dispatch

    group = tp_group()
    weight = state.fc.weight
    if failed or state.plan is None:
        # failed: stock everywhere; no plan without a failure (the site was not qualified, e.g. a
        # test stub): the backend dispatch serves, on its own crossover table (path None)
        backend = None if failed else dispatch.select("draft_fc", weight.device, weight.dtype)[0]
        state.plan = qualify.Plan(str(weight.device), _site_shape(state), [
            qualify.Choice("draft_fc", rows, backend, None, None, None, 0.0,
                           "qualification failed on this rank" if failed else "not qualified")
            for rows in buckets])
    plan = state.plan
    pairs = qualify.candidates("draft_fc", weight.device)
    menu = [(b, p, f) for b, p in pairs for f in (False, True)] + [(b, None, False) for b, _ in pairs]
    # the candidate lists must be the same on every rank for an index to mean the same candidate
    digest = int(hashlib.sha1(repr(menu).encode()).hexdigest()[:15], 16)
    same = torch.tensor([digest, -digest], dtype=torch.int64)
    dist.all_reduce(same, op=dist.ReduceOp.MAX, group=group.cpu_group)
    menus_agree = int(same[0]) == -int(same[1])
    index = {m: i for i, m in enumerate(menu)}
    mine = [index.get((c.backend, c.path, c.folded), -1) if c.backend is not None else -1 for c in plan.choices]
    rank0 = torch.tensor(mine if int(group.rank_in_group) == 0 else [-2] * len(mine), dtype=torch.int64)
    dist.all_reduce(rank0, op=dist.ReduceOp.MAX, group=group.cpu_group)  # = rank 0's indices
    rejected = {(r.rows, r.backend, r.path, r.folded) for r in plan.rejected}
    ok = torch.tensor([int(menus_agree and not failed and (i == -1 or (rows, *menu[i]) not in rejected))
                       for rows, i in zip((c.rows for c in plan.choices), rank0.tolist())], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group.cpu_group)
    for k, (choice, i, agreed) in enumerate(zip(list(plan.choices), rank0.tolist(), ok.tolist())):
        backend, path, folded = menu[i] if (agreed and i >= 0) else (None, None, False)
        if (backend, path, folded) != (choice.backend, choice.path, choice.folded):
            plan.choices[k] = dataclasses.replace(choice, backend=backend, path=path, folded=folded)
            log.info("eagle3_ops: draft %s fc: %d rows serve %s on every TP rank (%s)", name, choice.rows,
                     "stock" if backend is None else f"{backend}/{path}" + ("+folded" if folded else ""),
                     "rank 0's choice" if backend is not None else "a rank could not take rank 0's choice")


def _shard_plan(inner, fc: torch.nn.Linear, name: str):
    """(tp_rank, tp_size) to shard the draft fc over, or None to keep it replicated (one log line
    when TP > 1 and it stays replicated)."""
    from ..settings import SettingError, get, report_once
    from .version import ENV_SHARD_FC

    from .groups import layer_group, same_group, tp_group

    group = tp_group()
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
    known, built = layer_group(qkv)
    if known and not same_group(built, group):
        b_rank, b_size = (0, 1) if built is None else (int(built.rank_in_group), int(built.world_size))
        log.info("eagle3_ops: draft %s fc stays replicated: its layers were built for TP rank %d of %d (another "
                 "group than the one it is configured in, where this is rank %d of %d)", name, b_rank, b_size,
                 tp_rank, tp_size)
        return None
    return tp_rank, tp_size


def _install_sharded_fc(state: DraftFcState, name: str, tp_rank: int, tp_size: int) -> None:
    """Replace the draft's replicated fc by this rank's rows and release the replicated weight."""
    inner, full = state.inner, state.fc
    full_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    gone = [weakref.ref(p) for p in full.parameters()]
    try:
        sharded = ColumnShardedFc(full, tp_rank, tp_size)
    except Exception:  # e.g. out of memory for the rows' copy: the fused replicated fc stays
        log.exception("eagle3_ops: draft %s fc could not be sharded on this rank", name)
        sharded = None
    # All ranks shard or none does: a sharded rank all-gathers in every draft extend, a replicated
    # one does not, and a mix of the two hangs in the first one.
    if not _all_ranks_agree(sharded is not None):
        log.warning("eagle3_ops: draft %s fc stays replicated (fused) on every TP rank: %s", name,
                    "sharding failed on this rank" if sharded is None else "sharding failed on another rank")
        return
    inner.fc = sharded
    state.fc = sharded
    del full
    shard_bytes = sum(p.numel() * p.element_size() for p in sharded.parameters())
    released = all(ref() is None for ref in gone)
    log.info("eagle3_ops: draft %s fc sharded over %d TP ranks: this rank (%d) keeps rows %d..%d (%.1f MiB of "
             "%.1f MiB); each draft extend reads %.1f MiB of fc weight instead of %.1f MiB and adds one all-gather "
             "of [M, %d] along the last dim through the draft's TP group; %s", name, tp_size, tp_rank,
             sharded.row_start, sharded.row_start + sharded.rows, shard_bytes / 2**20, full_bytes / 2**20,
             shard_bytes / 2**20, full_bytes / 2**20, sharded.out_features,
             f"the replicated weight ({(full_bytes) / 2**20:.1f} MiB) was released" if released else
             "the replicated weight is still referenced elsewhere and was NOT released")
    state.sharding = {"tp_rank": tp_rank, "tp_size": tp_size, "released": released,
                      "bytes_before": full_bytes, "bytes_after": shard_bytes}
    _sharded_states.add(state)


def sharded_bytes_released() -> int:
    """Bytes of replicated draft fc weights released in this process so far (for the capture
    buffer's log line: what sharding gave back, next to what the buffer costs)."""
    return sum(s.sharding["bytes_before"] - s.sharding["bytes_after"] for s in list(_sharded_states)
               if s.sharding and s.sharding["released"])


def check_routing(model) -> Optional[str]:
    """After SGLang's CUDA-graph / compile setup: None if a patched draft still routes its forward
    through the plugin, else what replaced it (warned once per model)."""
    inner = getattr(model, "model", None)
    state = getattr(inner, "__dict__", {}).get(_STATE_ATTR) if inner is not None else None
    if state is None:
        return None
    problem = routing_problem(inner, _STATE_ATTR)
    if problem is not None and not state.routing_warned:
        state.routing_warned = True
        log.warning("eagle3_ops: draft %s: after SGLang's CUDA-graph/compile setup its forward no longer goes "
                    "through the plugin: %s. Forwards that bypass it run SGLang's stock fc.",
                    type(model).__name__, problem)
    return problem


def draft_fc_state(model) -> Optional[DraftFcState]:
    inner = getattr(model, "model", model)
    return getattr(inner, "__dict__", {}).get(_STATE_ATTR)
