"""``doctor --replay STATES``: run the draft's first step on recorded target states, search every recorded
boundary in every slot for the wiring the draft predicts the target best with (:mod:`.search`), and score
the finalists by top-1 agreement with the target's next tokens on every position.

For each prompt position ``t`` the draft gets the captured boundaries at ``t`` plus the embedding
of token ``t+1`` and must predict the target's next token after ``t+1`` (what EAGLE-3 drafts do
during draft-extend). The named wirings (the configured one, each reading of the draft config, the engine
default, every slot one layer earlier/later, all slots shifted, the embeddings or the last layer's output in
a slot, slot permutations) seed the search; ``--replay-sweep`` also scores every single-slot change on every
position. The verdict (:func:`_verdict`, ``report.replay["verdict"]``: the words the live check logs): OK when
no wiring scores higher than the configured one; UNDECIDED when one does by less than ``margin`` or three
standard errors of the paired difference; WARNING (E_REPLAY_BETTER_WIRING) when one does by both; and
NO_WIRING_FITS when no wiring is clearly better than the draft fed nothing (the wiring is not the problem).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from . import codes
from .checks import Report, find_finding, verified_fix, why_no_fix
from .configs import DoctorInputError, TensorInfo, check_file, load_tensors
from .draft import ACTIVATIONS, DraftSpec, Eagle3Draft, count_draft_layers
from .engines import ENGINE_NAMES, describe_boundary, default_boundaries
from .states import StatesError, read_states


class States:
    """Recorded prompts, grouped by length so that each group runs as one batch.

    Each group: ``ids`` [B, T], ``bounds`` {boundary: [B, T, H]} (boundary L = the last layer's output
    before the final norm), ``next`` [B, T] or None (the target's greedy next tokens). ``available``:
    the boundaries every prompt holds (an engine-side dump holds a subset)."""

    def __init__(self, path, num_layers: int, hidden_size: int, groups: List[dict], available: List[int],
                 source: str = ""):
        self.path = Path(path)
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.groups = groups
        self.available = list(available)
        self.source = source

    def boundary(self, g: dict, b: int) -> torch.Tensor:
        """Boundary ``b`` of group ``g``: [B, T, H]."""
        return g["bounds"][b]

    @classmethod
    def from_file(cls, f) -> "States":
        """The states of a read STATES file (:func:`read_states`), its prompts grouped by (length, whether they hold
        next tokens) and stacked per group."""
        by_len: Dict[Tuple[int, bool], List[dict]] = {}
        for p in f.prompts:
            by_len.setdefault((p["input_ids"].numel(), p["next_token"] is not None), []).append(p)
        groups = []
        for (_, has_next), items in sorted(by_len.items()):
            groups.append({"ids": torch.stack([it["input_ids"] for it in items]),
                           "bounds": {b: torch.stack([it["boundaries"][b] for it in items]) for b in f.boundaries},
                           "next": torch.stack([it["next_token"] for it in items]) if has_next else None})
        return cls(f.path, f.num_layers, f.hidden_size, groups, f.boundaries, f.source)


def load_states(path, target) -> States:
    """A STATES file (capture-states or the SGLang plugin's dump) for this target."""
    p = check_file(path, "replay", "a STATES .safetensors file (capture-states, or the SGLang plugin's "
                                   "EAGLE3_OPS_DUMP_STATES)")
    try:
        f = read_states(p, num_layers=target.num_layers, hidden_size=target.hidden_size,
                        vocab_size=getattr(target, "vocab_size", None))
    except StatesError as e:
        raise DoctorInputError(f"replay: {e}") from None
    return States.from_file(f)


REPLAY_DRAFT_CHOICES = ("auto", "sglang", "plain")
PLAIN_SOURCE = ("the plain-PyTorch llama_eagle3 twin (eagle3_ops.doctor.draft, held equal to SGLang's "
                "LlamaForCausalLMEagle3 by a test)")


def draft_implementation(engine: str, requested: str = "auto", device: str = "cpu") -> str:
    """Which code runs the draft: ``sglang`` (SGLang's own head class, on the CPU) or ``plain`` (the
    plain-PyTorch llama_eagle3 twin). ``auto``: SGLang's class where SGLang serves the draft (``--engine
    sglang``), the pinned SGLang is installed and the replay runs on the CPU; else the twin (vLLM users, no
    SGLang)."""
    if requested not in REPLAY_DRAFT_CHOICES:
        raise DoctorInputError(f"replay: the draft implementation must be one of {', '.join(REPLAY_DRAFT_CHOICES)}, "
                               f"got {requested!r}")
    if requested != "auto":
        return requested
    from . import sglang_code, tables

    # the pinned SGLang only: another version's runtime API (process groups, batches) may differ from what the
    # CPU runner drives; --replay-draft sglang still tries it
    pinned = sglang_code.installed_version() == tables.PINNED["sglang"]
    return "sglang" if engine == "sglang" and device == "cpu" and pinned else "plain"


def unsupported_draft(draft, weights: Dict[str, TensorInfo], implementation: str = "plain",
                      engine: str = "sglang") -> Optional[str]:
    """Why the replay cannot run this draft with ``implementation`` (``draft_implementation``), or None.
    SGLang's code runs every EAGLE-3 head SGLang serves; the twin runs llama_eagle3 drafts (SGLang's and
    vLLM's names) only: another architecture would be scored by a model it is not, ranking wirings by noise."""
    if implementation == "sglang":
        from .sglang_draft import head_class

        cls, why = head_class(draft)
        if cls is None:
            return f"replay runs the draft with SGLang's own class, but {why}"
        if draft.draft_vocab_size is None and not draft.tie_word_embeddings:
            return (f"SGLang serves this draft with the target's lm_head ({cls.__name__}.load_lm_head_from_target: "
                    f"its config has no draft_vocab_size), which a STATES file does not hold; the replay cannot score "
                    f"it")
        return None
    lc = draft.layer_config
    archs, layer_type = draft.architectures, str(lc.get("model_type", ""))
    biased = [f"{k}: {lc[k]!r}" for k in ("bias", "attention_bias", "mlp_bias") if lc.get(k)]
    if engine == "vllm" and biased:
        return (f"the replay's plain twin builds the biases SGLang 0.5.23's llama_eagle3 builds; vLLM 0.33.0's head "
                f"builds others (qkv_proj with attention_bias, o_proj with attention_bias or bias, the MLP with "
                f"mlp_bias, never fc), so with {', '.join(biased)} it would score a model vLLM does not serve")
    if (any(a in ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM") for a in archs)
            or (draft.dialect == "speculators" and layer_type == "llama")  # Eagle3Speculator over a llama layer
            or (not archs and "layers.0.self_attn.q_proj.weight" in weights)):  # no architectures, llama tensors
        return None
    this = ", ".join(archs) if archs else ("of unknown architecture (no architectures in config.json, no "
                                           "midlayer.* / layers.0.* llama_eagle3 tensors)")
    if draft.dialect == "speculators":
        this += f" with a {layer_type or 'untyped'} transformer_layer_config"
    return (f"without SGLang's own draft classes (the pinned SGLang not installed, another engine, or a device other "
            f"than the CPU) replay runs LlamaForCausalLMEagle3 drafts only; this draft is {this}")


class PlainDraftRunner:
    """The plain-PyTorch twin behind the same face as :class:`~.sglang_draft.SGLangDraftRunner`."""

    source = PLAIN_SOURCE

    def __init__(self, model: Eagle3Draft):
        self.model = model
        self.uses_target_embeddings = model.uses_target_embeddings
        self.hidden_size = model.spec.hidden_size

    def predict(self, aux: torch.Tensor, ids: torch.Tensor, embeds: Optional[torch.Tensor]) -> torch.Tensor:
        """The draft's top-1 next token per position, in target-vocabulary ids: [B, T] for aux [B, T, K*H] (see
        :meth:`logits`)."""
        return self.model.draft_to_target(self.logits(aux, ids, embeds).argmax(-1))

    @torch.no_grad()
    def logits(self, aux: torch.Tensor, ids: torch.Tensor, embeds: Optional[torch.Tensor]) -> torch.Tensor:
        """The first draft step's logits [B, T, draft_vocab] for ``aux`` [B, T, K*H]: with the target's ``embeds`` where
        the draft uses the target's embeddings, else its own embedding of ``ids``."""
        return self.model(aux, embeds if self.uses_target_embeddings else self.model.embed(ids))

    def draft_targets(self) -> torch.Tensor:
        """The target id of each draft token (d2t)."""
        return self.model.draft_to_target(torch.arange(self.model.spec.draft_vocab_size))

    def fc_parts(self):
        """The draft's fc block (fc weight and bias, slot norms, input norm, slot count) as :class:`~.search.FcParts`,
        for the wiring search."""
        from .search import FcParts

        m = self.model
        return FcParts(weight=m.fc.weight.detach(), bias=None if m.fc.bias is None else m.fc.bias.detach(),
                       slot_norms=list(m.fc_norm) if m.fc_norm is not None else None, input_norm=m.input_norm,
                       num_slots=m.spec.num_aux)


def build_runner(report: Report, weights: Dict[str, TensorInfo], token_ids: Optional[torch.Tensor] = None,
                 implementation: str = "auto", device: str = "cpu", max_positions: int = 0):
    """The draft's first step, run by SGLang's own class or by the plain twin (:func:`draft_implementation`)."""
    impl = draft_implementation(report.options.engine, implementation, device)
    if impl == "sglang":
        if device != "cpu":
            raise DoctorInputError(f"replay: SGLang's draft class runs on the CPU here, not on --device {device} "
                                   f"(--replay-draft plain runs the plain twin there)")
        if report.fc_slots is None:
            raise DoctorInputError("replay: the fc width is not a multiple of the target hidden size; cannot replay")
        why = unsupported_draft(report.draft, weights, "sglang")
        if why is not None:
            raise DoctorInputError(why)
        from .sglang_draft import SGLangDraftRunner

        dtype, why = compute_dtype(report.draft)
        runner = SGLangDraftRunner(report.draft, weights, token_ids, max_positions, dtype=dtype)
        runner.dtype_note = why
        return runner
    return PlainDraftRunner(build_draft(report, weights, token_ids).to(device))


def compute_dtype(draft) -> Tuple[torch.dtype, str]:
    """(the dtype SGLang's draft class computes in here, why). SGLang serves a 16-bit draft in 16 bits: the replay
    computes it in bfloat16 where this CPU's bfloat16 matmul is faster than its float32 one (measured now, a few
    milliseconds; bfloat16 keeps float32's range, and CPUs compute float16 many times slower); otherwise, and for a
    float32 draft, in float32."""
    cfg = draft.config if isinstance(getattr(draft, "config", None), dict) else {}
    served = str(cfg.get("torch_dtype") or cfg.get("dtype") or "")
    if served not in ("bfloat16", "float16"):
        return torch.float32, f"float32 (the draft's dtype is {served or 'not given'})"
    speed = {}
    for dt in (torch.float32, torch.bfloat16):
        a, w = torch.ones(256, 1024, dtype=dt), torch.ones(1024, 1024, dtype=dt)
        torch.nn.functional.linear(a, w)
        t0 = time.perf_counter()
        for _ in range(3):
            torch.nn.functional.linear(a, w)
        speed[dt] = time.perf_counter() - t0
    if speed[torch.bfloat16] < speed[torch.float32]:
        return torch.bfloat16, (f"bfloat16 (the draft is served in {served}; this CPU computes bfloat16 "
                                f"{speed[torch.float32] / speed[torch.bfloat16]:.1f}x as fast as float32)")
    return torch.float32, (f"float32 (the draft is served in {served}, but this CPU computes bfloat16 no faster "
                           f"than float32)")


def llama_eagle3_biases(layer_config: dict) -> Dict[str, bool]:
    """The biases SGLang 0.5.23's llama_eagle3 builds from a draft's config: ``fc`` with ``bias``
    (``LlamaModel.__init__``: ``bias=getattr(config, "bias", False)``), each layer's ``o_proj`` with
    ``attention_bias or bias`` (``llama.LlamaDecoderLayer``), its ``qkv_proj`` with none (the eagle3 layer
    rebuilds it with ``bias=False``); tests/sglang/test_replay_draft.py holds the twin equal to that class."""
    fc = bool(layer_config.get("bias", False))
    return {"fc_bias": fc, "o_proj_bias": bool(layer_config.get("attention_bias", False)) or fc}


def build_draft(report: Report, weights: Dict[str, TensorInfo], token_ids: Optional[torch.Tensor] = None
                ) -> Eagle3Draft:
    """Instantiate the plain-PyTorch draft from the checkpoint (shapes from weights, rest from config).
    ``token_ids``: the tokens the replay will embed; the draft's own embedding (a vocabulary x hidden
    matrix, gigabytes for a large target) is then read only at those rows, and not at all where the
    target's embeddings serve (SGLang replaces the draft's with the target's when the hidden sizes match)."""
    draft, target = report.draft, report.target
    lc = draft.layer_config
    why = unsupported_draft(draft, weights, engine=report.options.engine)
    if why is not None:
        raise DoctorInputError(why)
    act = lc.get("hidden_act") or "silu"  # Llama's default
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise DoctorInputError(f"replay: the draft's hidden_act {act!r} is not supported (supported: "
                               f"{', '.join(ACTIVATIONS)}); a stand-in activation would score a different model")
    fc = weights["fc.weight"]
    K = report.fc_slots
    if K is None:
        raise DoctorInputError("replay: the fc width is not a multiple of the target hidden size; cannot replay")
    hidden = fc.shape[0]
    n_layers = count_draft_layers(weights)
    if n_layers == 0:
        raise DoctorInputError("replay: the draft has no decoder layer weights (midlayer.* or layers.N.*)")
    need = ["layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.mlp.gate_proj.weight",
            "norm.weight"]
    missing = [n for n in need if n not in weights]
    if missing:
        raise DoctorInputError(f"replay: draft weights missing: {', '.join(missing)}")
    heads = lc.get("num_attention_heads")
    if not isinstance(heads, int) or heads <= 0:
        raise DoctorInputError("replay: the draft config has no num_attention_heads")
    q = weights["layers.0.self_attn.q_proj.weight"].shape
    k = weights["layers.0.self_attn.k_proj.weight"].shape
    head_dim = lc.get("head_dim") or q[0] // heads
    kv_heads = k[0] // head_dim
    lm = weights.get("lm_head.weight")
    emb = weights.get("embed_tokens.weight")
    vocab = target.vocab_size or (emb.shape[0] if emb is not None else None) or draft.vocab_size
    draft_vocab = lm.shape[0] if lm is not None else (draft.draft_vocab_size or vocab)
    rope = lc.get("rope_theta") or (lc.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    biases = llama_eagle3_biases(lc)
    spec = DraftSpec(hidden_size=hidden, target_hidden_size=target.hidden_size, num_aux=K, vocab_size=vocab,
                     draft_vocab_size=draft_vocab, num_layers=n_layers, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, intermediate_size=weights["layers.0.mlp.gate_proj.weight"].shape[0],
                     hidden_act=act, rms_norm_eps=float(lc.get("rms_norm_eps", 1e-6)),
                     rope_theta=float(rope), norm_before_fc="input_norm.weight" in weights,
                     fc_norm="fc_norm.0.weight" in weights, **biases,
                     norm_before_residual=draft.norm_before_residual,
                     tie_word_embeddings=draft.tie_word_embeddings and lm is None)
    uses_target = hidden == target.hidden_size
    tied = spec.tie_word_embeddings and "embed_tokens.weight" in weights  # lm_head IS the embedding: all rows
    subset = None
    if not tied and "embed_tokens.weight" in weights:
        if uses_target:
            subset = torch.zeros(0, dtype=torch.long)
        elif token_ids is not None:
            subset = torch.unique(token_ids.long().reshape(-1))
    model = Eagle3Draft(spec, embedding_rows=None if subset is None else subset.numel())
    names = [n for n in weights if not (subset is not None and n == "embed_tokens.weight")]
    tensors = load_tensors(weights, names)
    if subset is not None and subset.numel():
        from .configs import load_rows

        model.use_embedding_rows(subset, load_rows(weights["embed_tokens.weight"], subset))
    try:
        missing = model.load_checkpoint(tensors)
    except ValueError as e:
        raise DoctorInputError(f"replay: {e}") from None
    missing = [m for m in missing if m not in ("embed_tokens.weight", "d2t", "t2d")]
    if missing:
        asked = [f"{k}: {lc[k]!r}" for k in ("bias", "attention_bias") if lc.get(k)]
        raise DoctorInputError(f"replay: draft weights missing: {', '.join(missing)}" + (
            f" (config.json sets {' and '.join(asked)}, so SGLang builds these biases and, without a tensor, "
            f"serves them uninitialised)" if asked and any(m.endswith(".bias") for m in missing) else ""))
    if "d2t" not in tensors:
        model.d2t.zero_()
    # SGLang replaces the draft's embedding with the target's (set_embed) unless the hidden sizes differ.
    model.uses_target_embeddings = uses_target
    if not model.uses_target_embeddings and "embed_tokens.weight" not in weights:
        raise DoctorInputError(f"replay: the draft's hidden size {hidden} differs from the target's "
                               f"{target.hidden_size}, so it needs its own embed_tokens.weight, which is missing")
    return model.eval()


@torch.no_grad()
def score(runner, states: States, boundaries: List[Optional[int]], max_tokens: int) -> torch.Tensor:
    """Per-position correctness (bool) of the draft's top-1 under ``boundaries``, through the head's full
    forward (its own fc) on the first ``max_tokens`` positions (:func:`.search.chunks`: position t pairs the
    captures at t with the embedding of token t+1; the label is the target's next token after t+1). A slot
    given None is fed zeros (all None: what the draft predicts knowing nothing of the target's states)."""
    from .search import chunks

    out = []
    for c in chunks(states, max_tokens, runner.uses_target_embeddings):
        like = next(iter(c.bounds.values()))
        aux = torch.cat([c.bounds[b] if b is not None else torch.zeros_like(like) for b in boundaries], dim=-1)
        pred = runner.predict(aux, c.ids, c.embeds)
        out.append((pred == c.labels).reshape(-1))
    if not out:
        raise DoctorInputError("replay: the states hold no usable positions (prompts need at least 3 tokens)")
    return torch.cat(out)


def candidate_wirings(configured: Optional[List[int]], trained: List[int], L: int, sweep: bool = False,
                      readings: Optional[List[Tuple[str, List[int]]]] = None) -> List[Tuple[str, List[int]]]:
    """The wirings replay scores, as (label, boundaries per slot): the configured and trained ones, the engine default,
    every one-layer shift of all or one slot, embeddings or last layer in each slot, with ``sweep`` every boundary in
    every slot, and the slot permutations (K <= 4); deduplicated, in range 0..L."""
    base = configured if configured is not None else trained
    K = len(base)
    cands: List[Tuple[str, List[int]]] = []
    if configured is not None:
        cands.append(("configured", list(configured)))
    for label, b in readings or [("trained (per draft config)", list(trained))]:
        if len(b) == K:
            cands.append((label, list(b)))
    if len(default_boundaries(L)) == K:
        cands.append(("engine default", default_boundaries(L)))
    cands.append(("all slots one layer earlier", [b - 1 for b in base]))
    cands.append(("all slots one layer later", [b + 1 for b in base]))
    for k in range(K):
        for d, word in ((-1, "earlier"), (1, "later")):
            c = list(base)
            c[k] += d
            cands.append((f"slot {k} one layer {word}", c))
        c = list(base)
        c[k] = 0
        cands.append((f"embeddings in slot {k}", c))
        c = list(base)
        c[k] = L
        cands.append((f"last layer output in slot {k}", c))
    if sweep:  # every boundary in each slot, the other slots as configured: K * (L + 1) wirings
        for k in range(K):
            for b in range(L + 1):
                c = list(base)
                c[k] = b
                cands.append((f"slot {k} = boundary {b}", c))
    if K <= 4:
        for perm in itertools.permutations(range(K)):
            if list(perm) != list(range(K)):
                cands.append((f"slots permuted {list(perm)}", [base[i] for i in perm]))
    seen, out = set(), []
    for label, c in cands:
        t = tuple(c)
        if t in seen or any(b < 0 or b > L for b in c):
            continue
        seen.add(t)
        out.append((label, c))
    return out


def run_replay(report: Report, weights: Dict[str, TensorInfo], states_path, *, margin: float = 0.02,
               max_tokens: int = 4096, device: str = "cpu", sweep: bool = False, draft_code: str = "auto",
               chain_steps: int = 1) -> None:
    """Score the candidate wirings on ``states_path``; ``draft_code``: what runs the draft (auto | sglang | plain,
    :func:`draft_implementation`); ``chain_steps`` > 1: also the served wiring's later draft steps
    (:func:`chain_acceptance`, in ``report.replay["chain"]``)."""
    if chain_steps < 1:
        raise DoctorInputError(f"--replay-steps must be at least 1, got {chain_steps}")
    if report.wiring is None or report.training is None:
        why = ("the engine refuses this target or these ids (see the errors above)" if report.draft.use_aux_hidden_state
               else "the draft uses no aux hidden states")
        report.add(codes.I_REPLAY_SKIPPED, f"Replay skipped: {why}.")
        return
    states = load_states(states_path, report.target)
    runner = build_runner(report, weights, token_ids=torch.cat([g["ids"].reshape(-1) for g in states.groups])
                          if states.groups else None, implementation=draft_code, device=device,
                          max_positions=max((g["ids"].shape[1] for g in states.groups), default=0))
    if device != "cpu":
        for g in states.groups:
            for k in ("ids", "next"):
                if g[k] is not None:
                    g[k] = g[k].to(device)
            g["bounds"] = {b: t.to(device) for b, t in g["bounds"].items()}
    with _cpu_threads(device, runner.hidden_size):
        _replay(report, runner, states, margin=margin, max_tokens=max_tokens, sweep=sweep)
        if chain_steps > 1 and report.replay is not None:
            configured = (report.replay.get("configured") or {}).get("boundaries")
            report.replay["chain"] = chain_acceptance(runner, states, configured, chain_steps,
                                                      min(max_tokens, CHAIN_MAX_TOKENS))


CHAIN_MAX_TOKENS = 512  # positions the later steps are scored on (each step is one more draft forward per position)
CHAIN_TIME_S = 120.0    # their time budget: the live check's replay child has a wall-clock bound for everything


def chain_acceptance(runner, states: States, boundaries: Optional[List[int]], steps: int, max_tokens: int,
                     time_budget_s: Optional[float] = None) -> dict:
    """The served wiring's acceptance per draft step, the draft fed its own outputs as SGLang serves it
    (``runner.chain``: SGLang's own head, its draft extend then DECODE steps on its own hidden states). Step k at
    position j counts where it is observable: steps 1..k-1 predicted the target's next tokens AND the prompt went
    on with exactly those tokens (so the recorded captures and labels after them are what the target computes in
    serving); it is accepted when its prediction is the target's next token there. {"steps", "per_step": the
    acceptance given the steps before (step 1: of every position), "positions": observable positions per step,
    "accepted", "stopped": why it stopped early or None}; or {"steps", "why"} where it cannot be scored. Prompts
    are scored in order until ``time_budget_s`` (default :data:`CHAIN_TIME_S`) has passed: the counts say what was
    scored."""
    if boundaries is None:
        return {"steps": steps, "why": "the served wiring could not be scored"}
    if not hasattr(runner, "chain"):
        return {"steps": steps, "why": f"{runner.source} scores the first draft step only (the later steps feed the "
                                       f"draft its own outputs through SGLang's head: --replay-draft sglang)"}
    from .search import chunks

    budget = CHAIN_TIME_S if time_budget_s is None else time_budget_s
    t0, stopped = time.monotonic(), None
    seen, accepted = [0] * steps, [0] * steps
    for c in chunks(states, max_tokens, runner.uses_target_embeddings):
        aux = torch.cat([c.bounds[b] for b in boundaries], dim=-1)
        for row in range(c.ids.shape[0]):
            if time.monotonic() - t0 > budget:
                stopped = f"the time budget of {budget:.0f} s ran out after {seen[0]} positions"
                break
            preds = runner.chain(aux[row:row + 1], c.ids[row:row + 1],
                                 c.embeds[row:row + 1] if c.embeds is not None else None, steps)
            ids, labels = c.ids[row], c.labels[row]
            ok = torch.ones(ids.numel(), dtype=torch.bool)  # position j's chain is still observable and accepted
            for k, pred in enumerate(preds, start=1):
                m = pred.numel()  # positions j = 0..m-1 have a step k
                ok = ok[:m]
                right = pred.cpu() == labels[k - 1:k - 1 + m].cpu()
                seen[k - 1] += int(ok.sum())
                accepted[k - 1] += int((ok & right).sum())
                # step k + 1 (at positions 0..m-2) is observable where step k was accepted and the prompt's next
                # token is the one it accepted
                m2 = max(m - 1, 0)
                nxt = ids[k:k + m2].cpu() == labels[k - 1:k - 1 + m2].cpu()
                ok = (ok & right)[:m2] & nxt
        if stopped:
            break
    return {"steps": steps, "per_step": [a / s if s else None for a, s in zip(accepted, seen)],
            "positions": seen, "accepted": accepted, "stopped": stopped}


@contextlib.contextmanager
def _cpu_threads(device: str, hidden_size: int):
    """Small drafts on CPU run one thread: their ops are too small for a second thread to pay, and on a busy
    machine two OpenMP threads that wait for each other are many times slower."""
    if device != "cpu" or hidden_size >= 1024:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _replay(report: Report, runner, states: States, *, margin: float, max_tokens: int, sweep: bool) -> None:
    target, wiring = report.target, report.wiring
    L = target.num_layers
    K = report.fc_slots
    conf = [s.boundary for s in wiring.slots]
    configured = conf if (len(conf) == K and all(s.captured for s in wiring.slots)) else None
    trained = list(report.training.boundaries)
    if len(trained) != K:
        trained = configured if configured is not None else default_boundaries(L)[:K]
    readings = [(f"reading {chr(ord('A') + n)} of the draft config", list(r.boundaries))
                for n, r in enumerate(report.training.readings) if r.plausible]
    cands = candidate_wirings(configured, trained, L, sweep=sweep, readings=readings)
    have = set(states.available)
    if 0 not in have and runner.uses_target_embeddings:
        raise DoctorInputError(f"replay: {states.path} has no boundary 0 (the token embeddings), which the draft "
                               f"takes as its embedding input; record with the embeddings")
    unscored = [(label, b) for label, b in cands if not set(b) <= have]
    cands = [(label, b) for label, b in cands if set(b) <= have]
    if not cands or (configured is not None and cands[0][1] != configured):
        raise DoctorInputError(f"replay: {states.path} holds boundaries {sorted(have)}, which cannot form the "
                               f"configured wiring {configured}; record the boundaries it needs (the SGLang dump "
                               f"records each configured boundary and its neighbours)")

    from . import search as wiring_search

    seeds = [b for _, b in cands]
    if configured is None:  # the search starts from a wiring the states hold
        seeds = seeds or [[b if b in have else 0 for b in trained]]
    boundaries = sorted(b for b in have if 0 <= b <= L)
    found = wiring_search.search(runner, states, seeds, boundaries,
                                 scan_positions=min(wiring_search.SCAN_POSITIONS, max_tokens))
    named = {tuple(b): label for label, b in cands}
    keep = [(label, b) for label, b in cands
            if label in ("configured", "engine default", "trained (per draft config)")
            or label.startswith("reading ") or (sweep and label.startswith("slot ") and "= boundary" in label)]
    scored = {tuple(b) for _, b in keep}
    by_top1 = sorted(found.ranked, key=lambda w: -found.scores[w].top1)
    for w in [found.best] + found.ranked[:wiring_search.FINALISTS] + by_top1[:wiring_search.FINALISTS]:
        if w not in scored:
            scored.add(w)
            keep.append((named.get(w) or wiring_search.describe_change(w, configured), list(w)))

    results = []
    for label, bnds in keep:
        correct = score(runner, states, bnds, max_tokens)
        ids = verified_fix(report, bnds, check_readings=False)
        results.append({"label": label, "boundaries": bnds, "accuracy": float(correct.float().mean()),
                        "ids": ids, "_correct": correct})
    blind = score(runner, states, [None] * K, max_tokens)  # the draft fed zeros: what it knows without the target
    n = int(results[0]["_correct"].numel())
    order = sorted(range(len(results)), key=lambda i: (-results[i]["accuracy"], i))
    best = results[order[0]]
    conf_res = results[0] if configured is not None else None

    def public(r):
        return {k: v for k, v in r.items() if not k.startswith("_")}

    report.replay = {"states": str(states.path), "source": states.source, "draft_code": runner.source,
                     "compute_dtype": getattr(runner, "dtype_note", "float32"),
                     "tokens": n, "margin": margin,
                     "boundaries_recorded": states.available,
                     "configured": public(conf_res) if conf_res else None, "best": public(best),
                     "candidates": [public(results[i]) for i in order],
                     "no_input_accuracy": float(blind.float().mean()),
                     "search": found.public(),
                     "unscored": [{"label": label, "boundaries": b, "missing": sorted(set(b) - have)}
                                  for label, b in unscored]}
    if unscored:
        report.add(codes.I_REPLAY_UNSCORED,
                   f"Replay could not score {len(unscored)} wiring(s) the STATES file lacks boundaries for: "
                   + "; ".join(f"{label} {b} (missing {sorted(set(b) - have)})" for label, b in unscored[:8])
                   + (" ..." if len(unscored) > 8 else "") + ".",
                   "Record them (EAGLE3_OPS_DUMP_BOUNDARIES=all, or capture-states) to score them too.")
    if n < 200:
        report.add(codes.W_REPLAY_FEW_TOKENS,
                   f"Replay scored only {n} positions; differences of a few points are noise.", "Record more prompts.")
    _verdict(report, runner, states, results, order, conf_res, blind, margin, n, max_tokens)


def paired(a: torch.Tensor, b: torch.Tensor) -> Tuple[float, float, float]:
    """(mean gain of a over b, its standard error, the standard deviation of the per-position difference)."""
    diff = a.float() - b.float()
    n = diff.numel()
    sd = float(diff.std(unbiased=True)) if n > 1 else float("inf")
    return float(diff.mean()), sd / math.sqrt(n) if n > 1 else float("inf"), sd


def clearly_better(a: torch.Tensor, b: torch.Tensor, margin: float) -> bool:
    """The doctor's rule: per-position correctness ``a`` beats ``b`` by ``margin`` (absolute) and by three standard
    errors of the paired difference."""
    gain, se, _ = paired(a, b)
    return gain >= margin and gain >= 3 * se


LOW_ACCURACY = 0.05  # below this top-1 agreement with every wiring, no wiring fits


def _verdict(report: Report, runner, states: States, results: List[dict], order: List[int],
             conf_res: Optional[dict], blind: torch.Tensor, margin: float, n: int, max_tokens: int) -> None:
    """The replay's verdict, in the words the doctor and the live check both use (``report.replay["verdict"]``:
    {"word": OK | UNDECIDED | WARNING | NO_WIRING_FITS | BEST, "text": one sentence, "ids": the fix or None})."""
    opts, L = report.options, report.target.num_layers
    eng = ENGINE_NAMES[opts.engine]
    best = results[order[0]]
    rep = report.replay

    def fmt(r):
        return (f"{r['label']} {r['boundaries']} "
                f"({'; '.join(describe_boundary(b, L) for b in r['boundaries'])}): {100 * r['accuracy']:.1f}%")

    def say(word, text, ids=None, **more):
        rep["verdict"] = {"word": word, "text": text, "ids": ids, **more}

    if best["accuracy"] < LOW_ACCURACY or not clearly_better(best["_correct"], blind, margin):
        evidence = _no_fit_evidence(runner, states, best, blind, max_tokens)
        rep["no_fit_evidence"] = evidence
        text = (f"no wiring predicts the target well: the best, {best['boundaries']}, agrees on "
                f"{100 * best['accuracy']:.1f}% of {n} positions, and the draft fed nothing on "
                f"{100 * float(blind.float().mean()):.1f}%; the wiring is not the problem. {evidence['summary']}")
        report.add(codes.E_REPLAY_NO_WIRING_FITS, f"Replay on {n} positions: {text}")
        say("NO_WIRING_FITS", text, code=codes.E_REPLAY_NO_WIRING_FITS.code)
        return
    if conf_res is None:
        text = (f"the configured wiring cannot run; best wiring: {fmt(best)}" +
                (f"; for {eng} write ids {best['ids']}." if best["ids"] else
                 f"; no id list makes {eng} feed it: {why_no_fix(report, best['boundaries'])}."))
        report.add(codes.I_REPLAY_BEST, f"Replay on {n} positions: {text}")
        say("BEST", text, best["ids"], code=codes.I_REPLAY_BEST.code)
        return
    gain, se, sd = paired(best["_correct"], conf_res["_correct"])
    rep["gain"], rep["gain_stderr"] = gain, se
    if best is conf_res or best["accuracy"] <= conf_res["accuracy"]:
        rival = next((results[i] for i in order if results[i] is not conf_res), None)
        text = (f"no wiring scores higher than the served {conf_res['boundaries']} "
                f"({100 * conf_res['accuracy']:.1f}% top-1 on {n} positions)" +
                (f"; the best alternative, {fmt(rival)}" if rival is not None else "") +
                f"; {rep['search']['wirings_scanned']} wirings searched")
        report.add(codes.I_REPLAY_CONFIGURED_BEST, f"Replay on {n} positions: {text}.")
        say("OK", text, code=codes.I_REPLAY_CONFIGURED_BEST.code)
    elif clearly_better(best["_correct"], conf_res["_correct"], margin):
        feedable = next((results[i] for i in order if results[i]["ids"] is not None), None)
        fix = (f"Set {_ids_location(opts.engine)} to {best['ids']}." if best["ids"] is not None else
               f"No id list makes {eng} feed it: {why_no_fix(report, best['boundaries'])}; serve the draft with "
               f"an engine that captures it, or retrain it on boundaries {eng} captures."
               + (f" The best wiring {eng} can feed is {fmt(feedable)}: ids {feedable['ids']}."
                  if feedable is not None and feedable is not conf_res else ""))
        found = (f"the configured wiring scores {100 * conf_res['accuracy']:.1f}% top-1, but {fmt(best)} "
                 f"(+{100 * gain:.1f} points, {gain / se if se > 0 else float('inf'):.0f} standard errors). The draft "
                 f"was most likely trained on the latter.")
        text = f"{found} {fix}"
        report.add(codes.E_REPLAY_BETTER_WIRING, f"Replay on {n} positions: {found}", fix)
        say("WARNING", text, best["ids"], code=codes.E_REPLAY_BETTER_WIRING.code)
    else:
        prompts = sum(int(g["ids"].shape[0]) for g in states.groups)
        per_prompt = max(1.0, n / max(prompts, 1))
        if gain < margin:
            need = ("no number of prompts would make it count: it is under the margin of "
                    f"{100 * margin:.0f} points that matters for acceptance")
        else:
            more = max(0, math.ceil((3 * sd / gain) ** 2) - n)
            need = (f"about {more} more positions (~{math.ceil(more / per_prompt)} more prompts like these) "
                    f"would separate them if the gap holds")
        text = (f"{fmt(best)} scores higher than the served {conf_res['boundaries']} "
                f"({100 * conf_res['accuracy']:.1f}%), by {100 * gain:.1f} ± {100 * se:.1f} points on {n} positions: "
                f"the evidence does not separate them; {need}")
        report.add(codes.W_REPLAY_UNDECIDED, f"Replay: {text}.")
        say("UNDECIDED", text, best["ids"], need=need, code=codes.W_REPLAY_UNDECIDED.code)
    _settle(report, results, conf_res, margin, n)


def _no_fit_evidence(runner, states: States, best: dict, blind: torch.Tensor, max_tokens: int) -> dict:
    """Where the evidence points when no wiring fits: the draft ignoring its input (untrained or missing
    weights), a vocabulary map that does not fit (labels outside the draft's vocabulary, or its raw ids
    agreeing better than the mapped ones), else prompts unlike the draft's training data."""
    from .search import chunks, target_index

    targets = runner.draft_targets()
    scored = chunks(states, max_tokens, runner.uses_target_embeddings)
    labels = torch.cat([c.labels.reshape(-1) for c in scored])
    coverage = float((target_index(targets, int(max(int(targets.max()), int(labels.max())) + 1))[labels] >= 0)
                     .float().mean())
    raw_hits = 0
    distinct = set()
    for c in scored:
        aux = torch.cat([c.bounds[b] for b in best["boundaries"]], dim=-1)
        draft_ids = runner.logits(aux, c.ids, c.embeds).argmax(-1)
        raw_hits += int((draft_ids == c.labels).sum())
        distinct.update(targets[draft_ids].reshape(-1).tolist())
    raw = raw_hits / max(labels.numel(), 1)
    blind_acc = float(blind.float().mean())
    points = []
    if best["accuracy"] <= blind_acc + 0.02:
        points.append(f"its predictions do not depend on the target's states (fed zeros it scores "
                      f"{100 * blind_acc:.1f}%, {len(distinct)} distinct tokens predicted): weights that look "
                      f"untrained or missing (a head the checkpoint lacks, a wrong checkpoint)")
    if coverage < 0.5:
        points.append(f"only {100 * coverage:.0f}% of the target's next tokens are in the draft's vocabulary: its "
                      f"vocabulary map (d2t) does not fit this target")
    if raw > best["accuracy"] + 0.02:
        points.append(f"its own token ids agree with the target's more often ({100 * raw:.1f}%) than the ids its d2t "
                      f"maps them to: the vocabulary map is wrong or missing")
    if not points:
        points.append("the prompts may be unlike the draft's training data (a chat template it was trained with "
                      "and the prompts lack), or the draft was trained for another target")
    return {"summary": "The evidence points at: " + "; ".join(points) + ".", "points": points,
            "label_coverage": coverage,
            "raw_id_accuracy": raw, "no_input_accuracy": blind_acc, "distinct_predictions": len(distinct)}


def _settle(report: Report, results: List[dict], conf_res: dict, margin: float, n: int) -> None:
    """Replay is the evidence the config lacks: when the configured wiring beats every other reading of the
    ids (W_TRAINING_AMBIGUOUS) or every other candidate (W_NO_TRAINING_IDS) clearly, the warning is settled."""
    for code, rivals in ((codes.W_TRAINING_AMBIGUOUS, [r for r in results if r["label"].startswith("reading ")]),
                         (codes.W_NO_TRAINING_IDS, results)):
        found = find_finding(report.findings, code)
        others = [r for r in rivals if r is not conf_res and r["boundaries"] != conf_res["boundaries"]]
        if found is None or not others or not all(clearly_better(conf_res["_correct"], r["_correct"], margin)
                                                  for r in others):
            continue
        report.findings.remove(found)
        report.add(codes.I_REPLAY_SETTLED,
                   f"Replay settles what the config could not ({code}): the configured wiring "
                   f"{conf_res['boundaries']} scores {100 * conf_res['accuracy']:.1f}% top-1 on {n} positions, clearly "
                   f"above every alternative scored (best of them: "
                   f"{max(others, key=lambda r: r['accuracy'])['label']} "
                   f"{100 * max(r['accuracy'] for r in others):.1f}%).", "Keep the ids.")


def _ids_location(engine: str) -> str:
    from .engines import IDS_LOCATION

    return IDS_LOCATION[engine]
