"""``doctor --replay STATES``: run the draft's first step on recorded target states for several
wirings and score top-1 accuracy against the target's next tokens.

For each prompt position ``t`` the draft gets the captured boundaries at ``t`` plus the embedding
of token ``t+1`` and must predict the target's next token after ``t+1`` (what EAGLE-3 drafts do
during draft-extend). Candidate wirings: the configured one, the one the draft config's training
convention implies, the engine default, every slot one layer earlier/later, all slots one layer
earlier/later (the other convention), the embeddings or the last layer's output in place of each
slot, and slot permutations (``--replay-sweep``: also every boundary in each slot). An error is reported when another wiring beats the configured one by
at least ``margin`` (absolute) and by three standard errors of the paired difference.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from .checks import Report
from .configs import DoctorInputError, TensorInfo, load_tensors
from .draft import DraftSpec, Eagle3Draft, count_draft_layers
from .engines import ENGINE_NAMES, describe_boundary, default_boundaries, ids_for_boundaries
from .capture_states import FORMAT


class States:
    """Recorded prompts, grouped by length so that each group runs as one batch.

    Each group: ``ids`` [B, T], ``hidden`` [L+1, B, T, H], ``last`` [B, T, H] or None (pre-norm output
    of the last layer), ``next`` [B, T] or None (the target's greedy next tokens)."""

    def __init__(self, path, num_layers: int, hidden_size: int, groups: List[dict]):
        self.path = Path(path)
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.groups = groups

    def boundary(self, g: dict, b: int) -> torch.Tensor:
        """Boundary ``b`` of a group, [B, T, H]. Boundary L is the pre-final-norm output when recorded."""
        if b == self.num_layers and g.get("last") is not None:
            return g["last"]
        return g["hidden"][b]


def load_states(path, target) -> States:
    p = Path(path)
    if not p.is_file():
        raise DoctorInputError(f"replay: {p} does not exist")
    try:
        from safetensors import safe_open

        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            tensors = {k: f.get_tensor(k) for k in keys}
    except Exception as e:
        raise DoctorInputError(f"replay: cannot read {p} as safetensors: {e}") from None
    if meta.get("format") not in (None, FORMAT):
        raise DoctorInputError(f"replay: {p} has format {meta.get('format')!r}, expected {FORMAT!r}")
    idx = sorted({int(k.split(".")[1]) for k in keys if k.startswith("prompt.") and k.endswith(".hidden_states")})
    if not idx:
        raise DoctorInputError(f"replay: {p} holds no prompt.N.hidden_states tensors (make it with capture-states)")
    L, H = target.num_layers, target.hidden_size
    by_len: Dict[Tuple[int, bool, bool], List[dict]] = {}
    for i in idx:
        hs = tensors[f"prompt.{i}.hidden_states"].float()
        ids = tensors.get(f"prompt.{i}.input_ids")
        if ids is None:
            raise DoctorInputError(f"replay: prompt {i} has hidden_states but no input_ids")
        if hs.dim() != 3 or hs.shape[0] != L + 1 or hs.shape[2] != H or hs.shape[1] != ids.numel():
            raise DoctorInputError(
                f"replay: prompt {i} hidden_states has shape {list(hs.shape)}; the target needs "
                f"[{L + 1}, T, {H}] with T = {ids.numel()} tokens (states from another model?)")
        last = tensors.get(f"prompt.{i}.last_layer_output")
        nxt = tensors.get(f"prompt.{i}.next_token")
        key = (ids.numel(), last is not None, nxt is not None)
        by_len.setdefault(key, []).append({"ids": ids.long(), "hidden": hs,
                                           "last": last.float() if last is not None else None,
                                           "next": nxt.long() if nxt is not None else None})
    groups = []
    for (_, has_last, has_next), items in sorted(by_len.items()):
        groups.append({"ids": torch.stack([it["ids"] for it in items]),
                       "hidden": torch.stack([it["hidden"] for it in items], dim=1),
                       "last": torch.stack([it["last"] for it in items]) if has_last else None,
                       "next": torch.stack([it["next"] for it in items]) if has_next else None})
    return States(p, L, H, groups)


def build_draft(report: Report, weights: Dict[str, TensorInfo]) -> Eagle3Draft:
    """Instantiate the plain-PyTorch draft from the checkpoint (shapes from weights, rest from config)."""
    draft, target = report.draft, report.target
    lc = draft.layer_config
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
    spec = DraftSpec(hidden_size=hidden, target_hidden_size=target.hidden_size, num_aux=K, vocab_size=vocab,
                     draft_vocab_size=draft_vocab, num_layers=n_layers, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, intermediate_size=weights["layers.0.mlp.gate_proj.weight"].shape[0],
                     hidden_act=lc.get("hidden_act", "silu"), rms_norm_eps=float(lc.get("rms_norm_eps", 1e-6)),
                     rope_theta=float(rope), norm_before_fc="input_norm.weight" in weights,
                     fc_norm="fc_norm.0.weight" in weights, fc_bias="fc.bias" in weights,
                     norm_before_residual=draft.norm_before_residual,
                     tie_word_embeddings=draft.tie_word_embeddings and lm is None)
    model = Eagle3Draft(spec)
    tensors = load_tensors(weights, list(weights))
    try:
        missing = model.load_checkpoint(tensors)
    except ValueError as e:
        raise DoctorInputError(f"replay: {e}") from None
    missing = [m for m in missing if m not in ("embed_tokens.weight", "d2t", "t2d")]
    if missing:
        raise DoctorInputError(f"replay: draft weights missing: {', '.join(missing)}")
    if "d2t" not in tensors:
        model.d2t.zero_()
    # SGLang replaces the draft's embedding with the target's (set_embed) unless the hidden sizes differ.
    model.uses_target_embeddings = hidden == target.hidden_size
    if not model.uses_target_embeddings and "embed_tokens.weight" not in tensors:
        raise DoctorInputError(f"replay: the draft's hidden size {hidden} differs from the target's "
                               f"{target.hidden_size}, so it needs its own embed_tokens.weight, which is missing")
    return model.eval()


@torch.no_grad()
def score(model: Eagle3Draft, states: States, boundaries: List[int], max_tokens: int) -> torch.Tensor:
    """Per-position correctness (bool) of the draft's top-1 under ``boundaries``.

    Position t pairs the captures at t with the embedding of token t+1; the label is the target's next
    token after t+1 (recorded ``next_token[t+1]``, else the text's token t+2)."""
    out, used = [], 0
    for g in states.groups:
        ids = g["ids"]
        T = ids.shape[1]
        if g["next"] is not None:
            n, labels = T - 1, g["next"][:, 1:]
        else:
            n, labels = T - 2, ids[:, 2:]
        if n <= 0:
            continue
        rows = min(ids.shape[0], max(1, (max_tokens - used + n - 1) // n))
        if used >= max_tokens:
            break
        aux = torch.cat([states.boundary(g, b)[:rows, :n] for b in boundaries], dim=-1)
        if model.uses_target_embeddings:
            embeds = g["hidden"][0][:rows, 1:n + 1]
        else:
            embeds = model.embed_tokens(ids[:rows, 1:n + 1])
        logits = model(aux, embeds)
        pred = model.draft_to_target(logits.argmax(-1))
        out.append((pred == labels[:rows, :n]).reshape(-1))
        used += rows * n
    if not out:
        raise DoctorInputError("replay: the states hold no usable positions (prompts need at least 3 tokens)")
    return torch.cat(out)


def candidate_wirings(configured: Optional[List[int]], trained: List[int], L: int,
                      sweep: bool = False) -> List[Tuple[str, List[int]]]:
    base = configured if configured is not None else trained
    K = len(base)
    cands: List[Tuple[str, List[int]]] = []
    if configured is not None:
        cands.append(("configured", list(configured)))
    cands.append(("trained (per draft config)", list(trained)))
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
               max_tokens: int = 4096, device: str = "cpu", sweep: bool = False) -> None:
    if report.wiring is None or report.training is None:
        report.add("info", "I_REPLAY_SKIPPED", "Replay skipped: the draft uses no aux hidden states.")
        return
    states = load_states(states_path, report.target)
    model = build_draft(report, weights).to(device)
    if device != "cpu":
        for g in states.groups:
            for k in ("ids", "hidden", "last", "next"):
                if g[k] is not None:
                    g[k] = g[k].to(device)
    with _cpu_threads(device, model.spec.hidden_size):
        _replay(report, model, states, margin=margin, max_tokens=max_tokens, sweep=sweep)


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


def _replay(report: Report, model: Eagle3Draft, states: States, *, margin: float, max_tokens: int,
            sweep: bool) -> None:
    target, wiring, opts = report.target, report.wiring, report.options
    L = target.num_layers
    K = report.fc_slots
    conf = [s.boundary for s in wiring.slots]
    configured = conf if (len(conf) == K and all(s.captured for s in wiring.slots)) else None
    trained = list(report.training.boundaries)
    if len(trained) != K:
        trained = configured if configured is not None else default_boundaries(L)[:K]
    cands = candidate_wirings(configured, trained, L, sweep=sweep)

    results = []
    for label, bnds in cands:
        correct = score(model, states, bnds, max_tokens)
        ids = ids_for_boundaries(opts.engine, wiring.family, bnds, L)
        results.append({"label": label, "boundaries": bnds, "accuracy": float(correct.float().mean()),
                        "ids": ids, "_correct": correct})
    n = int(results[0]["_correct"].numel())
    order = sorted(range(len(results)), key=lambda i: (-results[i]["accuracy"], i))
    best = results[order[0]]
    conf_res = results[0] if configured is not None else None
    eng = ENGINE_NAMES[opts.engine]

    def public(r):
        return {k: v for k, v in r.items() if not k.startswith("_")}

    report.replay = {"states": str(states.path), "tokens": n, "margin": margin,
                     "configured": public(conf_res) if conf_res else None, "best": public(best),
                     "candidates": [public(results[i]) for i in order]}
    if n < 200:
        report.add("warning", "W_REPLAY_FEW_TOKENS",
                   f"Replay scored only {n} positions; differences of a few points are noise. Record more prompts.")

    def fmt(r):
        return (f"{r['label']} {r['boundaries']} "
                f"({'; '.join(describe_boundary(b, L) for b in r['boundaries'])}): {100 * r['accuracy']:.1f}%")

    if conf_res is None:
        report.add("info", "I_REPLAY_BEST",
                   f"Replay on {n} positions: the configured wiring cannot run (see the errors above). Best wiring: "
                   f"{fmt(best)}" + (f"; for {eng} write ids {best['ids']}." if best["ids"] else "."))
        return
    diff = (best["_correct"].float() - conf_res["_correct"].float())
    gain = float(diff.mean())
    se = float(diff.std(unbiased=True)) / math.sqrt(n) if n > 1 else float("inf")
    report.replay["gain"] = gain
    report.replay["gain_stderr"] = se
    if best is not conf_res and gain >= margin and gain >= 3 * se:
        fix = (f"Set {_ids_location(opts.engine)} to {best['ids']}." if best["ids"] is not None else
               f"{eng} cannot capture these boundaries in this order; retrain or serve elsewhere.")
        report.add("error", "E_REPLAY_BETTER_WIRING",
                   f"Replay on {n} positions: the configured wiring scores {100 * conf_res['accuracy']:.1f}% top-1, "
                   f"but {fmt(best)} (+{100 * gain:.1f} points, {gain / se if se > 0 else float('inf'):.0f} standard "
                   f"errors). The draft was most likely trained on the latter. {fix}")
    else:
        runner = results[order[1]] if order[0] == 0 and len(order) > 1 else best
        report.add("info", "I_REPLAY_CONFIGURED_BEST",
                   f"Replay on {n} positions: the configured wiring {conf_res['boundaries']} scores "
                   f"{100 * conf_res['accuracy']:.1f}% top-1; the best alternative, {fmt(runner)}, is not clearly "
                   f"better (margin {100 * margin:.0f} points and 3 standard errors).")
    if best["accuracy"] < 0.05:
        report.add("warning", "W_REPLAY_LOW_ACCURACY",
                   f"The draft predicts under {100 * best['accuracy']:.0f}% of next tokens with every wiring tried: "
                   f"the problem is likely not the wiring (vocab maps, the draft/target pairing, or the states file).")


def _ids_location(engine: str) -> str:
    from .engines import IDS_LOCATION

    return IDS_LOCATION[engine]
