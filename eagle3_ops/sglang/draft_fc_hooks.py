"""Draft side: the fc block of SGLang's two EAGLE-3 heads as one ``eagle3::draft_fc`` call.

SGLang 0.5.23 has two EAGLE-3 draft heads, and both run, on the first draft step (when the input is
the target's ``[T, K*H]`` aux states), an fc block this module replaces:

* ``LlamaForCausalLMEagle3`` (``llama_eagle3.LlamaModel``):
  ``[input_norm] [fc_norm per slot, cat] fc``, ``fc`` a replicated ``nn.Linear`` K*H -> H_draft;
* ``Eagle3DeepseekV2ForCausalLM`` (``kimi_k25_eagle3.Eagle3MLAModel``, the MLA draft for Kimi-K2.x):
  ``[fc_norm per slot, cat] fc`` then ``_fc_gatherer``, ``fc`` SGLang's own
  ``ColumnParallelLinear(gather_output=False)`` (this rank's N/tp output rows) and ``_fc_gatherer`` its
  multimem all-gather (NCCL where multimem cannot serve).

With this module installed the draft's forward computes ``draft_fc(h, fc.weight, fc.bias,
chunk_norm_weight, input_norm_weight, eps)`` (norms folded into one pass, fp32 throughout, one
rounding), gathers it where the head gathers (the MLA head: through its own ``_fc_gatherer``), puts the
result where the draft reads its input (``forward_batch.spec_info.hidden_states``) for the duration of
the call, and runs SGLang's own forward, which then sees an H-wide input and skips its fc block.
Later draft steps (H-wide input) run stock. The draft side may differ from stock within the op's
float64-checked tolerance: it moves acceptance, never the target's tokens.

Under TP > 1 ``llama_eagle3`` replicates ``fc`` (3*7168 -> 7168 is 308 MB in bf16 on every rank, read
in full by every rank on every draft extend). With sharding on (the default;
``EAGLE3_OPS_SGLANG_SHARD_FC=0`` turns it off) the plugin may replace ``fc`` by a
``ColumnShardedFc`` (fc_sharding.py, where the decision lives) holding only this rank's output rows
(and bias), release the replicated weight, and follow the fused call by ONE all-gather along the
last dimension through the draft's TP group (SGLang's ``tensor_model_parallel_all_gather``). Qualification decides
it per row bucket from timings every rank measured (the max over ranks), cached with the rest of qualification.

**Ranks decide together** (lockstep.py): every step that may fail on one rank alone (its backend, a
timing, an allocation) runs locally first and is followed by a vote in which every rank takes part;
a failure anywhere leaves the fc stock on every rank, and no rank is left waiting in a collective.
The install is committed (the sharded module swapped in, the replicated weight released, the class
forward wrapped) only after the last vote.

**Memory**: the draft fc's scratch is the plugin's own, allocated once at install (before SGLang
sizes its KV cache, outside any CUDA-graph pool) and sized for the path qualification chose for each
row bucket; a forward that would need more runs SGLang's stock fc (one log line) and never grows a
scratch buffer inside a graph capture.

The forward is wrapped on the head's model class, keyed on the instance's state (routing.py), so
SGLang's compile trampolines still reach it; under ``torch.compile`` tracing it steps aside. The
weights are the draft's own parameters: ``fc.weight`` is passed as is, and the K ``fc_norm`` weights
are re-pointed once to rows of one ``[K, H]`` tensor so the op reads them without a copy.
"""
from __future__ import annotations

import logging
import sys
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

from .. import bound, dispatch, ops, qualify
from . import fc_sharding, groups, lockstep, serving
from .routing import forward_owner, routing_problem, wrap_class_forward
from .serving import serving_backends, warn_once

log = logging.getLogger("eagle3_ops.sglang")

_STATE_ATTR = "_eagle3_ops_draft_fc"
_folded_states: "weakref.WeakSet" = weakref.WeakSet()  # states keeping a folded fc weight

# The two EAGLE-3 heads of SGLang 0.5.23 whose fc block this module knows: (module, model class, kind).
# "replicated": fc is a plain nn.Linear on every rank; "column-parallel": fc is SGLang's
# ColumnParallelLinear(gather_output=False) followed by the model's own _fc_gatherer.
DRAFT_HEADS = (
    ("sglang.srt.models.llama_eagle3", "LlamaModel", "replicated"),
    ("sglang.srt.models.kimi_k25_eagle3", "Eagle3MLAModel", "column-parallel"),
)
DRAFT_MODULE = DRAFT_HEADS[0][0]


# ---- discovery -------------------------------------------------------------------------------------
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


@dataclass
class DraftHead:
    """What one draft head's fc block is made of (found by :func:`find_draft_head`)."""
    kind: str                    # "replicated" | "column-parallel"
    owner: type                  # the class whose forward is wrapped
    fc: Any
    input_norm: Any
    fc_norm: Any
    eps: float
    num_aux: int


def _plain_rmsnorm(norm) -> Optional[str]:
    from sglang.srt.layers import layernorm

    if type(norm) is not layernorm.RMSNorm:
        return f"{type(norm).__name__} is not a plain RMSNorm"
    if norm.cast_x_before_out_mul or norm.variance_size_override is not None or not norm.has_weight:
        return "RMSNorm variant (cast_x_before_out_mul / variance override / no weight)"
    if norm.override_orig_dtype is not None:
        return "RMSNorm with override_orig_dtype"
    return None


def _fc_weight(fc) -> Optional[torch.Tensor]:
    w = getattr(fc, "weight", None)
    return w if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def find_draft_head(inner) -> Tuple[Optional[DraftHead], str]:
    """(head, "") when ``inner`` runs one of the fc blocks this module knows, else (None, why not)."""
    owner, kind = None, None
    for module_name, class_name, k in DRAFT_HEADS:
        module = sys.modules.get(module_name)
        cls = getattr(module, class_name, None) if module is not None else None
        owner = forward_owner(inner, cls) if cls is not None else None
        if owner is not None:
            kind = k
            break
    if owner is None:
        return None, (f"{type(inner).__module__}.{type(inner).__qualname__} is not one of SGLang's EAGLE-3 draft "
                      f"heads whose fc block the plugin knows ("
                      + ", ".join(f"{m.rsplit('.', 1)[-1]}.{c}" for m, c, _ in DRAFT_HEADS) + ")")
    fc = getattr(inner, "fc", None)
    weight = _fc_weight(fc)
    if kind == "replicated" and type(fc) is not torch.nn.Linear:
        return None, f"its fc is {type(fc).__name__}, not nn.Linear"
    if kind == "column-parallel":
        from sglang.srt.layers.linear import ColumnParallelLinear

        method = type(getattr(fc, "quant_method", None)).__name__
        if not isinstance(fc, ColumnParallelLinear) or getattr(fc, "gather_output", True):
            return None, f"its fc is {type(fc).__name__} (gather_output={getattr(fc, 'gather_output', None)}), not " \
                         f"ColumnParallelLinear(gather_output=False)"
        if method != "UnquantizedLinearMethod":
            return None, f"its fc is quantized ({method}); the fused fc takes plain weights"
        if getattr(fc, "skip_bias_add", False):
            return None, "its fc returns the bias separately (skip_bias_add)"
        if not callable(getattr(inner, "_fc_gatherer", None)):
            return None, "it has no _fc_gatherer"
    if weight is None:
        return None, "its fc has no 2-D weight"
    input_norm = getattr(inner, "input_norm", None)
    fc_norm = getattr(inner, "fc_norm", None)
    norms = ([input_norm] if input_norm is not None else []) + (list(fc_norm) if fc_norm is not None else [])
    for norm in norms:
        why = _plain_rmsnorm(norm)
        if why is None and norm.weight.dtype != weight.dtype:
            why = f"norm weight is {norm.weight.dtype}, fc weight is {weight.dtype}"
        if why is not None:
            return None, why
    eps_values = {float(n.variance_epsilon) for n in norms}
    if len(eps_values) > 1:
        return None, f"its norms use different eps {sorted(eps_values)}"
    if fc_norm is not None and len(fc_norm) * fc_norm[0].weight.shape[0] != weight.shape[1]:
        return None, "its fc_norm does not tile the fc input"
    num_aux = int(getattr(inner, "num_aux_hidden_states", 0) or (len(fc_norm) if fc_norm is not None else 3))
    return DraftHead(kind, owner, fc, input_norm, fc_norm, eps_values.pop() if eps_values else 1e-6, num_aux), ""


# ---- state -----------------------------------------------------------------------------------------
class DraftFcState:
    """What the plugin keeps on one draft model: its fc block (fc, input norm, fc_norm, eps), the stacked chunk norm
    weight, the qualification plan with its bound calls, the workspace, sharding and folded weight, and call counts."""

    def __init__(self, inner, head: DraftHead):
        self.inner = inner
        self.head = head
        self.fc = head.fc
        self.input_norm = head.input_norm
        self.fc_norm = head.fc_norm
        self.eps = head.eps
        self.enabled = True
        self.stats = {"fused_calls": 0, "stock_calls": 0}
        self.routing_warned = False
        self.chunk_norm_weight: Optional[torch.Tensor] = None
        self.sharding: Optional[dict] = None    # set when the fc was sharded over TP ranks
        self.workspace: Optional[torch.Tensor] = None  # the plugin's own draft_fc scratch (allocate_workspace)
        self.plan = None  # qualify.Plan: (backend, path) or stock per row bucket (None: not qualified)
        self.calls: dict = {}  # (backend, path) -> bound.DraftFc the plan's buckets run (bind_calls, at install)
        # ShardingPlan when qualification chose sharded rows for some row buckets only (the replicated
        # weight stays; those buckets compute this rank's rows of it + one all-gather)
        self.partial_sharding: Optional[fc_sharding.ShardingPlan] = None
        # fc.weight with the norm weights folded in (eagle3_ops.fold_norm_weights), kept only when
        # qualification chose a folded candidate for some bucket; re-folded after every load_weights
        self.folded_weight: Optional[torch.Tensor] = None
        self.name = type(inner).__name__  # the draft's class name in log lines (install sets it)
        if self.fc_norm is not None:
            self._share_chunk_norm_storage()

    @property
    def column_parallel(self) -> bool:
        """Whether the draft's fc is a ColumnParallelLinear (``gather_output=False``) rather than replicated."""
        return self.head.kind == "column-parallel"

    @property
    def weight(self) -> torch.Tensor:
        """The fc weight [N, K*H] as the draft holds it now."""
        return self.fc.weight

    @property
    def input_norm_weight(self) -> Optional[torch.Tensor]:
        """The input norm's weight [K*H], or None when the draft has no input norm."""
        return self.input_norm.weight if self.input_norm is not None else None

    def refold(self) -> None:
        """(Re)compute the folded weight from the current fc and norm weights, in place."""
        if self.folded_weight is None:
            return
        ops.fold_norm_weights(self.fc.weight, self.chunk_weight(), self.input_norm_weight, out=self.folded_weight)

    def _share_chunk_norm_storage(self) -> None:
        """Re-point the K fc_norm weights to rows of one [K, H] tensor (same values, one storage)."""
        weights = [norm.weight for norm in self.fc_norm]
        stacked = torch.stack([w.data for w in weights])
        for k, w in enumerate(weights):
            w.data = stacked[k]
        self.chunk_norm_weight = stacked

    def chunk_weight(self) -> Optional[torch.Tensor]:
        """The fc_norm weights as one [K, H] tensor whose rows are those weights' storage (None without fc_norm);
        re-stacked first when a reload replaced the weights."""
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

    def call_for(self, rows: int):
        """(bound call, weight, bias, gather, folded) a fused call of ``rows`` rows makes, or None when
        qualification keeps SGLang's stock fc block for this many rows. The bound calls are made at install
        (:func:`bind_calls`): one per (backend, path) the plan serves."""
        choice = self.plan.choice_for(rows) if self.plan is not None else None
        if choice is not None and choice.backend is None:
            return None
        folded = choice is not None and choice.folded and self.folded_weight is not None
        weight, bias, gather = (self.folded_weight if folded else self.fc.weight), self.fc.bias, None
        if self.column_parallel:
            gather = self.inner._fc_gatherer
        elif isinstance(self.fc, fc_sharding.ColumnShardedFc):
            gather = self.fc.gather
        elif self.partial_sharding is not None and self.partial_sharding.sharded_for(rows):
            weight, bias, gather = self.partial_sharding.rows_of(weight, bias)
        call = self.calls[(choice.backend, choice.path) if choice is not None else None]
        return call, weight, bias, gather, folded

    def workspace_bytes(self, rows: int, call=None) -> int:
        """Scratch bytes a fused call of ``rows`` rows needs on the path it takes (0 when stock)."""
        call = self.call_for(rows) if call is None else call
        if call is None:
            return 0
        bound_call, weight, bias, _, folded = call
        return int(bound_call.plan_rows(rows, weight, bias, self.chunk_weight(), self.input_norm_weight,
                                        folded).nbytes)

    def allocate_workspace(self, max_tokens: int) -> int:
        """The draft_fc scratch for up to ``max_tokens`` rows on the paths the plan chose, owned by the
        plugin: allocated once here (at install, before SGLang sizes its KV cache and outside any
        CUDA-graph pool). Every M where a planned split count can change (up to 256) and every bucket
        edge is sized, and so planned ahead (the bytes are monotone in M within a path and split count).
        Returns its bytes."""
        need = 0
        for m in sorted(set(range(1, 257)) | {512, 1024, 2048, 4096, int(max_tokens)}):
            if m <= max_tokens:
                need = max(need, self.workspace_bytes(m))
        self.workspace = torch.empty(need, dtype=torch.uint8, device=self.fc.weight.device) if need else None
        return need


def bind_calls(state: DraftFcState, default_backend: Optional[str] = None) -> None:
    """The bound draft_fc call (``eagle3_ops.bound.DraftFc``: backend function verified, path fixed) of every
    (backend, path) ``state.plan`` serves; without a plan (qualification off), ``default_backend``'s with its
    own crossover table, under the key None. :meth:`DraftFcState.allocate_workspace` then plans them ahead."""
    device, dtype = state.fc.weight.device, state.fc.weight.dtype
    calls = {}
    if state.plan is None:
        backend = default_backend or dispatch.select("draft_fc", device, dtype)[0]
        calls[None] = bound.DraftFc(backend, None, device, dtype)
    else:
        for c in state.plan.choices:
            if c.backend is not None and (c.backend, c.path) not in calls:
                calls[(c.backend, c.path)] = bound.DraftFc(c.backend, c.path, device, dtype)
    state.calls = calls


# ---- installation ------------------------------------------------------------------------------------
def install_draft_fc(model) -> Optional[DraftFcState]:
    """Run ``model``'s (an SGLang EAGLE-3 draft) fc block as one eagle3::draft_fc call. Returns the
    state, or None when the draft is left stock (one log line saying why if it is an EAGLE-3 draft).
    Nothing is changed on the model until every rank voted for the whole install."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "fc") or not is_eagle3_draft(model):
        return None
    existing = inner.__dict__.get(_STATE_ATTR)
    if existing is not None:
        return existing
    name = type(model).__name__
    head, why = find_draft_head(inner)
    if head is None:
        warn_once(f"draft:{name}", "eagle3_ops: draft %s fc runs stock: %s", name, why)
        return None

    # Everything above depends only on the model and the settings: the same on every TP rank. From
    # here on a rank may fail alone (its backend's self-check, memory, a timing): each step's local
    # work runs first, then every rank votes.
    group = groups.tp_group()
    tp = int(group.world_size) if group is not None else 1
    device = head.fc.weight.device
    shard = fc_sharding.shard_plan(inner, head, name) if head.kind == "replicated" else None
    max_tokens = serving.default_max_tokens()
    buckets = qualify.buckets_up_to(max_tokens)
    qualifying = qualify.enabled(device)

    # 1. this rank can run the fused fc at all
    backend, state = None, None
    try:
        backend = serving_backends(("draft_fc",), device, head.fc.weight.dtype, f"draft {name} fc")
        if backend is not None:
            state = DraftFcState(inner, head)
            state.name = name
    except Exception:
        log.exception("eagle3_ops: draft %s fc: could not prepare the fused fc on this rank", name)
    if not lockstep.all_ranks_agree(state is not None, group):
        if tp > 1:  # (at TP = 1 serving_backends, or the exception above, has said why)
            log.warning("eagle3_ops: draft %s fc stays stock on every TP rank: %s", name,
                        "this rank cannot run it fused" if state is None else "another TP rank cannot run it fused")
        return None

    # 2. sharded or replicated (a replicated fc under TP > 1): measured, cached, the same on every rank
    sharding = None
    if shard is not None:
        sharding, ok = fc_sharding.decide_sharding(state, name, *shard, buckets, qualifying, group)
        if not ok:
            log.warning("eagle3_ops: draft %s fc stays stock on every TP rank: the sharding could not be decided on "
                        "every rank", name)
            return None
    shard_everywhere = shard is not None and (sharding is None or sharding.everywhere)

    # 3. the site's own qualification (local), then one plan on every rank
    if qualifying:
        plan, failed = None, False
        try:
            plan = _qualify_site(state, name, buckets, shard if shard_everywhere else None)
        except Exception:
            log.exception("eagle3_ops: draft %s fc: qualification failed on this rank", name)
            failed = True
        state.plan = lockstep.agreed_plan(plan, failed, "draft_fc", device, _site_shape(state, shard if shard_everywhere
                                                                                else None), buckets, group,
                                 f"draft {name} fc")
        for line in state.plan.table().splitlines():
            log.info("eagle3_ops: draft %s fc %s", name, line)

    # 4. everything the install allocates, locally (not yet visible to SGLang), then the last vote
    prepared, sharded_fc, nbytes = False, None, 0
    try:
        if shard_everywhere:
            sharded_fc = fc_sharding.ColumnShardedFc(state.fc, *shard)
        elif sharding is not None and sharding.anywhere:
            state.partial_sharding = sharding
        replicated = state.fc
        if sharded_fc is not None:
            state.fc = sharded_fc  # the workspace and the folded weight are for the rows that serve
        try:
            _prepare_folded_weight(state, name)
            bind_calls(state, backend["draft_fc"])
            nbytes = state.allocate_workspace(max_tokens)
        finally:
            state.fc = replicated
            del replicated  # no reference to the replicated fc may outlive its release below
        prepared = True
    except Exception:
        log.exception("eagle3_ops: draft %s fc: could not allocate what the fused fc needs on this rank", name)
    if not lockstep.all_ranks_agree(prepared, group):
        log.warning("eagle3_ops: draft %s fc stays stock on every TP rank: %s", name,
                    "its install failed on this rank" if not prepared else "its install failed on another TP rank")
        return None

    # 5. commit: from here on nothing can fail on one rank alone
    if sharded_fc is not None:
        fc_sharding.commit_sharded_fc(state, name, sharded_fc, tp)
    wrap_class_forward(head.owner, _STATE_ATTR, _run_draft_forward)
    inner.__dict__[_STATE_ATTR] = state
    if state.folded_weight is not None:
        _refold_after_loads(model, state, name)
    log.info("eagle3_ops: patched %s fc block (%s fc: input_norm=%s, fc_norm=%s, fc %d->%d%s, bias=%s) -> one "
             "eagle3::draft_fc call, same weight storage; backend draft_fc=%s", name, head.kind,
             "yes" if state.input_norm is not None else "no", "yes" if state.fc_norm is not None else "no",
             state.fc.weight.shape[1], getattr(state.fc, "out_features", state.fc.weight.shape[0]),
             f" ({state.fc.weight.shape[0]} rows on this rank, then its own all-gather)" if head.kind ==
             "column-parallel" and tp > 1 else "", "yes" if state.fc.bias is not None else "no", backend["draft_fc"])
    if nbytes:
        log.info("eagle3_ops: draft %s fc workspace: %.1f MiB on %s, owned by the plugin (allocated once, outside "
                 "CUDA-graph pools, sized for the paths it serves)", name, nbytes / 2**20, device)
    return state


def _prepare_folded_weight(state: DraftFcState, name: str) -> None:
    """When qualification chose a folded candidate for some bucket: the folded weight (one more copy of
    this rank's fc weight, allocated here, before SGLang sizes its KV cache)."""
    plan = state.plan
    if plan is None or not any(c.folded for c in plan.choices):
        return
    state.folded_weight = ops.fold_norm_weights(state.fc.weight, state.chunk_weight(), state.input_norm_weight)


def _refold_after_loads(model, state: DraftFcState, name: str) -> None:
    """Re-fold the kept folded weight after every ``load_weights`` of the draft (weight updates copy
    into the parameters in place; a stale folded copy would serve old weights)."""
    load = getattr(model, "load_weights", None)
    if load is not None and not getattr(load, "_eagle3_refolds", False):
        def load_weights(*args, **kwargs):
            result = load(*args, **kwargs)
            state.refold()
            return result

        load_weights._eagle3_refolds = True
        model.load_weights = load_weights
    _folded_states.add(state)
    rows = [c.rows for c in state.plan.choices if c.folded]
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


def _site_shape(state: DraftFcState, shard: Optional[Tuple[int, int]] = None):
    """The qualify.Shape of this draft's fc site: the rows this rank computes (its N/tp when the fc is,
    or will be, sharded; the column-parallel head's local rows)."""
    weight = state.fc.weight
    K = state.head.num_aux
    n = weight.shape[0] // shard[1] if shard is not None else weight.shape[0]
    return qualify.Shape("draft_fc", weight.shape[1] // K, K, n, str(weight.dtype).replace("torch.", ""),
                         state.fc.bias is not None, state.fc_norm is not None, state.input_norm is not None)


def _qualify_site(state: DraftFcState, name: str, buckets, shard: Optional[Tuple[int, int]] = None):
    """Qualification (eagle3_ops/qualify.py) of the fused fc at this draft's own shapes and weights (the
    rows this rank will compute): per row bucket the fastest correct (backend, path), or SGLang's
    stock fc block where none beats it. Runs eagerly at install (before graph capture)."""
    weight, bias = state.fc.weight, state.fc.bias
    if shard is not None:
        n = weight.shape[0] // shard[1]
        weight = weight.narrow(0, shard[0] * n, n)
        bias = bias.narrow(0, shard[0] * n, n) if bias is not None else None
    tensors = {"weight": weight, "bias": bias, "chunk_norm_weight": state.chunk_norm_weight,
               "input_norm_weight": state.input_norm_weight, "eps": state.eps}
    return qualify.qualify(_site_shape(state, shard), weight.device, buckets, tensors=tensors)


# ---- the forward wrapper: what runs in each draft forward once installed ---------------------------
def _run_draft_forward(state: DraftFcState, original, inner, args, kwargs):
    """One forward of a patched draft (``original``: the head's stock model forward): the row bucket's bound
    call (planned at install) on the draft's input, else SGLang's stock fc block."""
    forward_batch = kwargs["forward_batch"] if "forward_batch" in kwargs else (args[2] if len(args) > 2 else None)
    weight = state.fc.weight
    spec = getattr(forward_batch, "spec_info", None)
    h = getattr(spec, "hidden_states", None)
    if (not state.enabled or not isinstance(h, torch.Tensor) or h.dim() != 2
            or h.shape[-1] != weight.shape[1] or h.shape[-1] == inner.config.hidden_size
            or h.dtype != weight.dtype or h.device != weight.device):
        state.stats["stock_calls"] += 1
        return original(inner, *args, **kwargs)
    M = h.shape[0]
    call = state.call_for(M)
    if call is None:
        state.stats["stock_calls"] += 1
        return original(inner, *args, **kwargs)
    if not _planned_layout(h):  # the bound plans are for a contiguous, 16-byte aligned input
        warn_once(f"layout:{state.name}", "eagle3_ops: draft %s fc: its input (strides %s, address %% 16 = %d) is not "
                  "the contiguous, aligned layout the plugin planned for; SGLang's stock fc serves such forwards",
                  state.name, tuple(h.stride()), h.data_ptr() % 16)
        state.stats["stock_calls"] += 1
        return original(inner, *args, **kwargs)
    fn, weight, bias, gather, folded = call
    chunk, input_norm_weight = state.chunk_weight(), state.input_norm_weight
    planned = fn.plan_rows(M, weight, bias, chunk, input_norm_weight, folded) if M else None
    need = planned.nbytes if planned is not None else 0
    have = state.workspace.numel() if state.workspace is not None else 0
    if need > have:  # never grow a scratch buffer in a forward (it may be a graph capture)
        warn_once(f"ws:{state.name}:{M}", "eagle3_ops: draft %s fc: %d rows need %d bytes of scratch, the "
                  "plugin's workspace has %d; SGLang's stock fc serves them", state.name, M, need, have)
        state.stats["stock_calls"] += 1
        return original(inner, *args, **kwargs)
    x = torch.empty((M, weight.shape[0]), dtype=h.dtype, device=h.device)
    if M:
        fn(planned, h, weight, bias, None, chunk, input_norm_weight, state.eps, x, state.workspace if need else None,
           folded)
    if gather is not None:
        x = gather(x)  # [M, N/tp] -> [M, N]: the head's own all-gather, or the one sharding adds
    state.stats["fused_calls"] += 1
    spec.hidden_states = x
    try:
        return original(inner, *args, **kwargs)
    finally:
        spec.hidden_states = h


def _planned_layout(h: torch.Tensor) -> bool:
    """Whether ``h`` [M, K*H] is laid out as the bound plans assume: rows contiguous, 16-byte aligned."""
    # a one-row view counts too: the CUDA op reads its row stride (a multiple of 8 on the skinny path)
    return (h.shape[0] == 0 or h.stride(0) == h.shape[1]) and (h.shape[1] <= 1 or h.stride(1) == 1) \
        and h.data_ptr() % 16 == 0


# ---- after SGLang's graph setup, and lookup --------------------------------------------------------
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
    """The plugin's :class:`DraftFcState` of a draft model (or its ``.model``), or None when the fused fc is not
    installed on it."""
    inner = getattr(model, "model", model)
    return getattr(inner, "__dict__", {}).get(_STATE_ATTR)
