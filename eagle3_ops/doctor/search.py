"""The replay's wiring search: which recorded boundary, one per fc slot, the draft predicts the target best with.

A real draft can be off in any slot by any number of layers, so the search covers every boundary the
states hold in every slot, and scales by three facts:

- **The fc is linear in each slot**: ``fc(x) = sum_s W_s n_s(x_s) + bias`` (``W_s``: the fc weight's
  columns of slot ``s``; ``n_s``: the slot's own pre-fc norm, the head's module). The slot-``s`` projection
  of every recorded boundary is computed once (``K x (L+1)`` projections, a third of an fc each), and any
  wiring's fc output is a sum of ``K`` of them. A whole-row ``input_norm`` keeps that too: its scale is
  ``rsqrt(mean of the slots' mean squares + eps)``, a per-position scalar applied after the sum. (With
  both norms the slot norm's own ``eps`` makes the sum an approximation; the verdict is exact.)
- **The head skips its fc when fed a hidden-size-wide input** (SGLang's own rule in ``llama_eagle3`` and
  ``kimi_k25_eagle3``: ``hidden_states.shape[-1] != embeds.shape[-1]``; the plain twin follows it), so the
  rest of the draft runs on that sum through the head's own code.
- **The scan needs fewer positions than the verdict**: it ranks wirings by the mean log-probability of the
  target's next token, a continuous score that separates wirings on far fewer positions than top-1
  agreement: every wiring of a sweep on the first :data:`QUICK_POSITIONS` positions, the best :data:`KEEP`
  (and the current one) on :data:`SCAN_POSITIONS`.

Steps (:func:`search`): scan the named wirings (the served one, the config's readings, the engine default,
the neighbourhood of :func:`..replay.candidate_wirings`); from the best of them, sweep one slot at a time
over every boundary with the other slots fixed, sweeping a slot again whenever another slot changed since
its last sweep (at most :data:`MAX_ROUNDS` rounds); scan the slot permutations of the best. The caller
(:func:`..replay._replay`) then scores the named wirings and the best of the scan (:data:`FINALISTS` by
log-probability, as many by top-1) on every position through the head's full forward (its own fc), by top-1
agreement: that is the verdict.

Cost, at the seed's sizes (measured, benchmarks/NOTES.md): a sweep of Kimi-K2.5's 62 boundaries runs 62 wirings
on 64 positions and 7 on 256, the draft's layer and head once per position (the fc's share is the projections,
computed once); the projections of 256 positions take 3 x 62 x 256 x 7168 x 2 bytes = 651 MiB in bfloat16.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

SCAN_POSITIONS = 256  # positions the scan ranks wirings on (the verdict uses every position)
QUICK_POSITIONS = 64  # of them, the first ones every wiring of a sweep is run on ...
KEEP = 6              # ... the best KEEP of which (and the current wiring) go on to all SCAN_POSITIONS
MAX_ROUNDS = 3        # sweeps of every slot at most (a slot is swept again only when another one changed)
FINALISTS = 4         # best wirings of the scan scored on every position, beside the named ones
BATCH_ROWS = 1024     # positions per draft forward (candidates are stacked as requests of one batch)

Wiring = Tuple[int, ...]


@dataclasses.dataclass
class Chunk:
    """Positions of one group of equally long prompts: the draft gets the captures at ``t`` and the token
    ``t + 1`` and predicts the target's next token after it."""
    ids: torch.Tensor                 # [R, n] token t+1
    embeds: Optional[torch.Tensor]    # [R, n, H] its target embedding (boundary 0), where the head takes it
    labels: torch.Tensor              # [R, n] the target's next token after t+1
    bounds: Dict[int, torch.Tensor]   # boundary -> [R, n, H] captures at t

    @property
    def positions(self) -> int:
        """The positions this chunk scores: R x n."""
        return int(self.labels.numel())


def chunks(states, max_tokens: int, uses_target_embeddings: bool) -> List[Chunk]:
    """The first ``max_tokens`` positions of ``states`` (whole prompts of each length group, in order), as
    the replay scores them: position t pairs the captures at t with token t+1; the label is the target's
    next token after t+1 (recorded ``next_token[t+1]``, else the text's token t+2)."""
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
        if used >= max_tokens:
            break
        rows = min(ids.shape[0], max(1, (max_tokens - used + n - 1) // n))
        out.append(Chunk(ids=ids[:rows, 1:n + 1], labels=labels[:rows, :n],
                         embeds=g["bounds"][0][:rows, 1:n + 1] if uses_target_embeddings else None,
                         bounds={b: t[:rows, :n] for b, t in g["bounds"].items()}))
        used += rows * n
    return out


@dataclasses.dataclass
class FcParts:
    """The head's fc and its pre-fc norms, as the head holds them (its own modules and tensors)."""
    weight: torch.Tensor                      # [H_draft, K * H_target]
    bias: Optional[torch.Tensor]
    slot_norms: Optional[Sequence[Callable]]  # per slot (fc_norm), or None
    input_norm: Optional[torch.nn.Module]     # one RMSNorm over the whole row (norm_before_fc), or None
    num_slots: int

    @property
    def slot_width(self) -> int:
        """One slot's width in the fc input: K*H_target // K = H_target."""
        return self.weight.shape[1] // self.num_slots

    @property
    def dtype(self) -> torch.dtype:
        """The fc weight's dtype (what the projections are computed in)."""
        return self.weight.dtype

    def project(self, s: int, x: torch.Tensor) -> torch.Tensor:
        """Slot ``s``'s share of the fc output for captures ``x`` [..., H_target] (no bias, no row scale)."""
        w = self.slot_width
        lead = x.shape[:-1]
        x = x.reshape(-1, w).to(self.dtype)
        if self.input_norm is not None:
            x = x * self.input_norm.weight[s * w:(s + 1) * w].to(self.dtype)
        if self.slot_norms is not None:
            x = self.slot_norms[s](x)
        return F.linear(x, self.weight[:, s * w:(s + 1) * w]).reshape(*lead, -1)

    def row_scale(self) -> bool:
        """Whether the whole-row input norm's scale applies after the sum (exact without slot norms)."""
        return self.input_norm is not None and self.slot_norms is None

    def eps(self) -> float:
        """The whole-row input norm's eps (its ``variance_epsilon`` or ``eps``; 1e-6 when it has neither)."""
        n = self.input_norm
        return float(getattr(n, "variance_epsilon", getattr(n, "eps", 1e-6)))


class Projections:
    """Every slot's projection of every boundary on the scan's chunks, and the fc output of any wiring."""

    def __init__(self, parts: FcParts, scan: List[Chunk], boundaries: Sequence[int]):
        self.parts = parts
        self.by_chunk: List[Dict[Tuple[int, int], torch.Tensor]] = []
        self.squares: List[Dict[int, torch.Tensor]] = []
        with torch.no_grad():
            for c in scan:
                self.by_chunk.append({(s, b): parts.project(s, c.bounds[b]) for s in range(parts.num_slots)
                                      for b in boundaries})
                self.squares.append({b: c.bounds[b].float().pow(2).mean(-1) for b in boundaries}
                                    if parts.row_scale() else {})

    def fc_output(self, i: int, wiring: Wiring, rows: slice = slice(None), cols: Optional[int] = None) -> torch.Tensor:
        """The fc output of ``wiring`` on scan chunk ``i`` (its ``rows``, their first ``cols`` positions; a
        float32 sum, in the head's dtype)."""
        p = self.parts
        h = sum(self.by_chunk[i][(s, b)][rows, :cols].float() for s, b in enumerate(wiring))
        if p.row_scale():
            ms = sum(self.squares[i][b][rows, :cols] for b in wiring) / len(wiring)
            h = h * torch.rsqrt(ms + p.eps())[..., None]
        if p.bias is not None:
            h = h + p.bias.float()
        return h.to(p.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes the kept projections hold (the search's main memory cost)."""
        return sum(t.numel() * t.element_size() for d in self.by_chunk for t in d.values())


@dataclasses.dataclass
class ScanScore:
    """One wiring's score on one stage: mean log-probability of the target's next token, top-1 agreement, and the
    positions scored."""
    logprob: float    # mean log-probability of the target's next token (positions the draft vocabulary covers)
    top1: float       # top-1 agreement on the scan positions
    positions: int


def target_index(draft_targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """target id -> draft id (-1 where the draft vocabulary lacks it)."""
    index = torch.full((vocab,), -1, dtype=torch.long)
    index[draft_targets.long()] = torch.arange(draft_targets.numel())
    return index


class Scanner:
    """Scores wirings on the scan positions through ``runner.logits`` fed the fc output directly. Two stages:
    ``quick`` (the first rows of the scan's chunks, about :data:`QUICK_POSITIONS` positions) and ``scan``
    (:data:`SCAN_POSITIONS`); each wiring's score is kept per stage."""

    def __init__(self, runner, parts: FcParts, scan: List[Chunk], boundaries: Sequence[int], quick_positions: int):
        self.runner, self.scan = runner, scan
        self.projections = Projections(parts, scan, boundaries)
        targets = runner.draft_targets()
        vocab = int(max(int(targets.max()), max(int(c.labels.max()) for c in scan)) + 1)
        self.targets = targets
        self.index = target_index(targets, vocab)
        # pieces (chunk, first row, rows, first positions): the scan takes every chunk whole; the quick stage the
        # first quick_positions in reading order (whole prompts, then a prefix of the next one: the draft's
        # attention is causal, so a prefix scores its positions exactly as the whole prompt does)
        self.pieces = {"scan": [(i, 0, c.ids.shape[0], c.ids.shape[1]) for i, c in enumerate(scan)], "quick": []}
        left = quick_positions
        for i, c in enumerate(scan):
            R, n = c.ids.shape
            full = min(R, left // n)
            if full:
                self.pieces["quick"].append((i, 0, full, n))
                left -= full * n
            if full < R and 0 < left < n:
                self.pieces["quick"].append((i, full, 1, left))
                left = 0
            if left <= 0:
                break
        self.scores: Dict[str, Dict[Wiring, ScanScore]] = {"quick": {}, "scan": {}}
        self.forwards = 0

    def positions(self, stage: str) -> int:
        """The positions stage ``stage`` (``quick`` or ``scan``) scores each wiring on."""
        return sum(rows * cols for _, _, rows, cols in self.pieces[stage])

    def evaluate(self, wirings: Sequence[Wiring], stage: str = "scan") -> None:
        """Scores each of ``wirings`` not yet scored on ``stage``: the fc output from the projections, the head's logits
        in batches of up to ``BATCH_ROWS`` positions, kept in ``self.scores[stage]``."""
        done = self.scores[stage]
        todo = list(dict.fromkeys(w for w in wirings if w not in done))
        if not todo:
            return
        sums = {w: [0.0, 0, 0, 0] for w in todo}   # logprob sum, covered positions, top-1 hits, positions
        for i, r0, R, n in self.pieces[stage]:
            c = self.scan[i]
            rows = slice(r0, r0 + R)
            per = max(1, BATCH_ROWS // max(R * n, 1))
            labels = c.labels[rows, :n].reshape(-1)
            lab = self.index[labels]
            covered = lab >= 0
            for k in range(0, len(todo), per):
                group = todo[k:k + per]
                C = len(group)
                h = torch.cat([self.projections.fc_output(i, w, rows, n) for w in group])
                ids = c.ids[rows, :n].repeat(C, 1)
                embeds = c.embeds[rows, :n].repeat(C, 1, 1) if c.embeds is not None else None
                logits = self.runner.logits(h, ids, embeds).float()    # [C * R, n, draft vocab]
                self.forwards += 1
                logits = logits.view(C, -1, logits.shape[-1])
                lse = torch.logsumexp(logits, -1)
                picked = logits.gather(-1, lab.clamp(min=0)[None, :, None].expand(C, -1, 1)).squeeze(-1)
                logp = (picked - lse) * covered
                hits = self.targets[logits.argmax(-1)] == labels
                for j, w in enumerate(group):
                    s = sums[w]
                    s[0] += float(logp[j].sum())
                    s[1] += int(covered.sum())
                    s[2] += int(hits[j].sum())
                    s[3] += labels.numel()
        for w, (lp, cov, hit, n) in sums.items():
            done[w] = ScanScore(lp / cov if cov else float("-inf"), hit / n if n else 0.0, n)

    def key(self, w: Wiring, stage: str = "scan"):
        """The sort key of a scored wiring on ``stage``: (mean log-probability, top-1), higher is better."""
        s = self.scores[stage][w]
        return (s.logprob, s.top1)

    def best(self, wirings: Sequence[Wiring], keep: int = 0) -> Wiring:
        """The best of ``wirings`` on the scan stage; with ``keep``, only the ``keep`` best of the quick stage
        (and the first wiring, the current one) go on to it."""
        wirings = list(dict.fromkeys(wirings))
        if keep and len(wirings) > keep + 1 and self.positions("quick") < self.positions("scan"):
            self.evaluate(wirings, "quick")
            wirings = list(dict.fromkeys([wirings[0]] + sorted(wirings, key=lambda w: self.key(w, "quick"),
                                                               reverse=True)[:keep]))
        self.evaluate(wirings, "scan")
        return max(wirings, key=self.key)


@dataclasses.dataclass
class SearchResult:
    """The outcome of :func:`search`: the best wiring, every wiring scanned ranked with its score, and the cost (rounds,
    sweeps, positions, seconds, projection bytes, draft forwards)."""
    best: Wiring
    ranked: List[Wiring]              # every wiring scored on the scan stage, best first
    scores: Dict[Wiring, ScanScore]
    quick_scored: int                 # wirings scored on the quick stage only
    rounds: int
    sweeps: int
    positions: int
    quick_positions: int
    seconds: float
    projection_bytes: int
    forwards: int

    def public(self, limit: int = 16) -> dict:
        """The result as the JSON report holds it: the best wiring, counts, cost, and the ``limit`` best wirings with
        their scores."""
        return {"best": list(self.best), "wirings_scanned": len(self.ranked) + self.quick_scored,
                "positions": self.positions, "quick_positions": self.quick_positions, "rounds": self.rounds,
                "slot_sweeps": self.sweeps, "seconds": round(self.seconds, 1),
                "projection_mib": round(self.projection_bytes / 2**20, 1), "draft_forwards": self.forwards,
                "top": [{"boundaries": list(w), "mean_logprob": round(self.scores[w].logprob, 4),
                         "top1": round(self.scores[w].top1, 4)} for w in self.ranked[:limit]]}


def search(runner, states, seeds: Sequence[Sequence[int]], boundaries: Sequence[int], *,
           scan_positions: int = SCAN_POSITIONS, quick_positions: int = QUICK_POSITIONS) -> SearchResult:
    """The wiring the draft predicts the target best with, over every boundary in ``boundaries`` in every slot
    (module docstring); ``seeds``: the named wirings (the served one first)."""
    t0 = time.monotonic()
    parts = runner.fc_parts()
    scan = chunks(states, scan_positions, runner.uses_target_embeddings)
    scanner = Scanner(runner, parts, scan, boundaries, min(quick_positions, scan_positions))
    seeds = [tuple(w) for w in seeds]
    cur = scanner.best(seeds, keep=KEEP)
    K = len(cur)
    stale = set(range(K))   # slots to sweep: another slot changed since their last sweep
    rounds = sweeps = 0
    while stale and rounds < MAX_ROUNDS:
        rounds += 1
        for s in range(K):
            if s not in stale:
                continue
            stale.discard(s)
            sweeps += 1
            best = scanner.best([cur] + [cur[:s] + (b,) + cur[s + 1:] for b in boundaries], keep=KEEP)
            if best != cur:
                cur = best
                stale.update(k for k in range(K) if k != s)
    perms = [tuple(cur[i] for i in p) for p in itertools.permutations(range(K))]
    cur = scanner.best([cur] + perms)
    full = scanner.scores["scan"]
    ranked = sorted(full, key=lambda w: scanner.key(w), reverse=True)
    return SearchResult(best=cur, ranked=ranked, scores=full,
                        quick_scored=len(set(scanner.scores["quick"]) - set(full)), rounds=rounds, sweeps=sweeps,
                        positions=scanner.positions("scan"), quick_positions=scanner.positions("quick"),
                        seconds=time.monotonic() - t0, projection_bytes=scanner.projections.nbytes,
                        forwards=scanner.forwards)


def describe_change(wiring: Sequence[int], served: Optional[Sequence[int]]) -> str:
    """A found wiring's label: the slots where it differs from the served one."""
    if served is None or len(served) != len(wiring):
        return "found by the search"
    diff = [s for s in range(len(wiring)) if wiring[s] != served[s]]
    if not diff:
        return "served"
    if sorted(wiring) == sorted(served):
        return f"slots permuted {[list(served).index(b) for b in wiring]}"
    return f"search: slot {diff[0]}" if len(diff) == 1 else "found by the search"
