"""Reading the built kernels' SASS and resources (``cuobjdump -sass`` / ``-res-usage`` text): what
``tests/test_build.py`` checks in CI and what the static model (``benchmarks/static_model.py``)
reads. Pure text analysis: no torch, no GPU, no CUDA toolkit (the caller runs cuobjdump). A maintainer
tool (``tools/``): nothing in the eagle3_ops package imports it.

* :func:`parse_sass` splits a listing into functions of :class:`Instr` (address, predicate,
  opcode, operands).
* :func:`loops` finds the loops (a backward branch and its target); :func:`hot_loop` the one that
  streams the weight: the innermost loop holding the most MMAs (``HMMA``).
* :func:`pipeline` measures how deep the weight stream of a loop is **across its back-edge**:

  - a shared-memory ring (``LDGSTS`` copies, ``LDGDEPBAR`` commits, ``DEPBAR.LE SB0, n`` waits):
    the commit groups still in flight when the loop jumps back = ``n`` of the last wait in the loop
    plus the commits after it (in the steady state, every group the wait did not wait for is
    still in flight); steps per iteration = commits per iteration;
  - a register pipeline (global loads ``LDG`` into registers): per load, the distance from the load
    to the first instruction that reads (or overwrites) its destination registers, walking on
    through the back-edge; a load whose first use lies in a later iteration is in flight across
    the back-edge.

  A collapsed pipeline (every copy waited for in the iteration that issued it; every load used
  before the back-edge) measures 0 stages in flight: the build test fails it
  (``tests/test_build.py`` also runs the analyser on synthetic listings that show it can fail).
* :func:`resource_usage` parses ``cuobjdump -res-usage`` (registers, stack, shared, local).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_PRED = re.compile(r"^(@!?U?P(?:T|\d))\s+")
_BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)")


@dataclass(frozen=True)
class Instr:
    addr: int
    pred: str      # "" or e.g. "@!P4"
    opcode: str    # e.g. "LDGSTS.E.BYPASS.LTC256B.128"
    operands: str  # the rest, as printed

    @property
    def base(self) -> str:
        """The opcode without modifiers: LDGSTS, DEPBAR, HMMA, ..."""
        return self.opcode.split(".")[0]

    def dest_regs(self) -> Tuple[int, ...]:
        """Registers written by a load (the first operand; a .64/.128 load writes 2/4 registers)."""
        first = self.operands.split(",")[0].strip()
        m = re.fullmatch(r"R(\d+)", first)
        if not m:
            return ()
        width = 4 if ".128" in self.opcode else 2 if ".64" in self.opcode else 1
        return tuple(range(int(m.group(1)), int(m.group(1)) + width))

    def source_regs(self) -> Tuple[int, ...]:
        """Registers read: every R operand after the first (memory operands' address registers, a
        .64 address pair) and, for stores and compares, the first too; an HMMA reads its A (4), B (2)
        and C (4) register groups. Used only to find the first reader of a load's destination, where
        counting too many readers only makes the distance shorter (the conservative side)."""
        ops = [o.strip() for o in self.operands.split(",")]
        if self.base == "HMMA" and len(ops) >= 4:
            regs = set()
            for op, n in ((ops[1], 4), (ops[2], 2), (ops[3], 4)):
                if m := re.fullmatch(r"R(\d+)(?:\.reuse)?", op):
                    regs.update(range(int(m.group(1)), int(m.group(1)) + n))
            return tuple(sorted(regs))
        rest = ", ".join(ops[1:])
        regs = set()
        for m in re.finditer(r"R(\d+)(\.64)?", rest):
            regs.add(int(m.group(1)))
            if m.group(2):
                regs.add(int(m.group(1)) + 1)
        if self.base in ("STG", "STS", "ST", "RED", "ATOM", "ISETP", "FSETP"):
            regs.update(int(m.group(1)) for m in re.finditer(r"R(\d+)", ops[0]))
        return tuple(sorted(regs))


def parse_sass(text: str) -> Dict[Tuple[str, str], List[Instr]]:
    """(arch, function symbol) -> its instructions, from ``cuobjdump -sass`` output."""
    out: Dict[Tuple[str, str], List[Instr]] = {}
    arch, fn, body = None, None, []

    def flush():
        if fn is not None:
            out[(arch, fn)] = list(body)

    for line in text.splitlines():
        if m := re.match(r"\s*code for (sm_\d+a?)", line):
            # A new cubin: the function before this line belongs to the previous one's arch.
            flush()
            arch, fn, body = m.group(1), None, []
        elif m := re.match(r"\s*Function : (\S+)", line):
            flush()
            fn, body = m.group(1), []
        elif fn is not None and (m := _LINE.match(line)):
            text_ = m.group(2).strip()
            pred = ""
            if pm := _PRED.match(text_):
                pred, text_ = pm.group(1), text_[pm.end():]
            opcode, _, operands = text_.partition(" ")
            body.append(Instr(int(m.group(1), 16), pred, opcode, operands.strip()))
    flush()
    return out


@dataclass(frozen=True)
class Loop:
    head: int  # index of the branch target
    tail: int  # index of the backward branch

    def body(self, ins: Sequence[Instr]) -> List[Instr]:
        return list(ins[self.head:self.tail + 1])


def loops(ins: Sequence[Instr]) -> List[Loop]:
    """Every backward branch (a ``BRA`` to an earlier address) with its target: one loop each."""
    index = {x.addr: i for i, x in enumerate(ins)}
    found = []
    for i, x in enumerate(ins):
        if x.base != "BRA":
            continue
        m = _BRANCH_TARGET.search(x.operands)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target < x.addr and target in index and x.addr != target:
            found.append(Loop(index[target], i))
    return found


def count(body: Sequence[Instr], base: str) -> int:
    return sum(1 for x in body if x.base == base)


def hot_loop(ins: Sequence[Instr]) -> Optional[Loop]:
    """The loop that streams the weight through the tensor cores: the one with the most MMAs
    (ties: the innermost, i.e. the shortest). None when no loop has an MMA."""
    best = None
    for lp in loops(ins):
        n = count(lp.body(ins), "HMMA")
        if n == 0:
            continue
        key = (n, -(lp.tail - lp.head))
        if best is None or key > best[0]:
            best = (key, lp)
    return best[1] if best else None


@dataclass
class Pipeline:
    """How deep a loop's load stream is across its back-edge (see the module doc)."""

    kind: str                 # "ring" (LDGSTS + DEPBAR) or "registers" (LDG) or "none"
    steps_per_iteration: int  # ring: commit groups per iteration; registers: 1
    in_flight: int            # ring: groups in flight at the back-edge; registers: loads used only after it
    loads: int                # the loop's streaming copies / loads
    distances: List[int] = field(default_factory=list)  # registers: per load, instructions to first use

    @property
    def stages_in_flight(self) -> float:
        """Steps of the stream outstanding at the back-edge (ring: groups; registers: the loads in
        flight across the back-edge over the loads per iteration)."""
        if self.kind == "ring":
            return float(self.in_flight)
        if self.kind == "registers" and self.loads:
            return self.in_flight / self.loads
        return 0.0


_DEPBAR = re.compile(r"SB0,\s*0x([0-9a-f]+)")


def pipeline(ins: Sequence[Instr], loop: Loop, load_pattern: str = r"^(LDGSTS|LDG)\b") -> Pipeline:
    """The pipeline depth of ``loop`` for the loads whose opcode matches ``load_pattern``."""
    body = loop.body(ins)
    pat = re.compile(load_pattern)
    copies = [x for x in body if pat.search(x.opcode) and x.base == "LDGSTS"]
    if copies:
        commits = [i for i, x in enumerate(body) if x.base == "LDGDEPBAR"]
        waits = [i for i, x in enumerate(body) if x.base == "DEPBAR" and _DEPBAR.search(x.operands)]
        if not waits:  # nothing waits in the loop: every copy is waited for after it
            return Pipeline("ring", len(commits), 0, len(copies))
        last = waits[-1]
        pending = int(_DEPBAR.search(body[last].operands).group(1), 16)
        in_flight = pending + sum(1 for i in commits if i > last)
        return Pipeline("ring", max(1, len(commits)), in_flight, len(copies))
    loads = [i for i, x in enumerate(body) if pat.search(x.opcode) and x.base == "LDG" and x.dest_regs()]
    if not loads:
        return Pipeline("none", 0, 0, 0)
    n = len(body)
    across, distances = 0, []
    for i in loads:
        dest = set(body[i].dest_regs())
        dist = None
        for step in range(1, 2 * n + 1):  # on through the back-edge into the next iteration
            x = body[(i + step) % n]
            if dest & set(x.source_regs()) or (step % n != 0 and dest & set(x.dest_regs())):
                dist = step
                break
        distances.append(dist if dist is not None else 2 * n)
        if dist is None or i + dist > n - 1:
            across += 1
    return Pipeline("registers", 1, across, len(loads), distances)


def hot_loop_instructions_per_step(ins: Sequence[Instr], loop: Loop) -> float:
    """Instructions the loop issues per step of the stream (ring: per commit group), without
    NOPs: the issue cost that the build test compares between kernel variants."""
    body = [x for x in loop.body(ins) if x.base != "NOP" and x.pred != "@!PT"]  # @!PT: never executes
    commits = count(body, "LDGDEPBAR")
    return len(body) / max(1, commits)


# The build's criteria (tests/test_build.py; tests/test_sass_analysis.py shows they fail on a
# collapsed pipeline and on a norm loop with the gains back in it): issue 21 items 1 and 2.
PIPELINE_MIN_STAGES = 2     # weight steps in flight across the hot loop's back-edge
NORM_LOOP_MAX_RATIO = 1.25  # a norm variant's hot-loop instructions per step over the plain one's

# The weight stream of the skinny kernels: LDGSTS (or LDG) with the 256-byte L2 prefetch, which only
# the weight copies ask for (x copies and every other access do not).
WEIGHT_LOAD = r"^LDG(STS)?\..*LTC256B"


def weight_stages_in_flight(ins: Sequence[Instr]) -> float:
    """Steps of the weight stream in flight across the hot loop's back-edge (0 without a hot loop)."""
    lp = hot_loop(ins)
    return pipeline(ins, lp, WEIGHT_LOAD).stages_in_flight if lp is not None else 0.0


def hot_loop_ratio(ins: Sequence[Instr], baseline: Sequence[Instr]) -> float:
    """Hot-loop instructions per step of ``ins`` over those of ``baseline`` (inf without a hot loop)."""
    a, b = hot_loop(ins), hot_loop(baseline)
    if a is None or b is None:
        return float("inf")
    return hot_loop_instructions_per_step(ins, a) / hot_loop_instructions_per_step(baseline, b)


def arch_base(arch: Optional[str]) -> Optional[str]:
    """``sm_90a`` -> ``sm_90``: cuobjdump spells one cubin's arch both ways (the 12.8 copy triton 3.6 ships prints
    ``code for sm_90`` in ``-sass`` and ``arch = sm_90a`` in ``-res-usage``; a 13.x toolkit prints sm_90a in
    both), so listings are matched on the base."""
    return arch[:-1] if arch and arch[-1] in "af" and arch[-2:-1].isdigit() else arch


def resources(usage: Dict[Tuple[str, str], Dict[str, int]], arch: Optional[str], fn: str) -> Dict[str, int]:
    """``usage`` (:func:`resource_usage`) of kernel ``fn`` in the cubin of ``arch`` as ``-sass`` spelled it:
    the same spelling, else the same base arch (:func:`arch_base`), else a bare cubin's (no arch line)."""
    if (arch, fn) in usage:
        return usage[(arch, fn)]
    same = [v for (a, f), v in usage.items() if f == fn and a is not None and arch_base(a) == arch_base(arch)]
    if len(same) == 1:
        return same[0]
    if (None, fn) in usage:
        return usage[(None, fn)]
    raise KeyError(f"no -res-usage entry for {fn} in the {arch} cubin (found: "
                   f"{sorted({a for a, f in usage if f == fn}, key=str) or 'none'})")


def resource_usage(text: str) -> Dict[Tuple[str, str], Dict[str, int]]:
    """(arch, function symbol) -> {"REG", "STACK", "SHARED", "LOCAL"} from ``cuobjdump -res-usage``."""
    usage, arch, fn = {}, None, None
    for line in text.splitlines():
        if m := re.match(r"\s*arch = (\S+)", line):
            arch = m.group(1)
        elif m := re.match(r"\s*Function (\S+):", line):
            fn = m.group(1)
        elif m := re.match(r"\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line):
            usage[(arch, fn)] = dict(zip(("REG", "STACK", "SHARED", "LOCAL"), map(int, m.groups())))
    return usage


__all__ = ["Instr", "Loop", "NORM_LOOP_MAX_RATIO", "PIPELINE_MIN_STAGES", "Pipeline", "WEIGHT_LOAD", "arch_base",
           "count",
           "hot_loop", "hot_loop_instructions_per_step", "hot_loop_ratio", "loops", "parse_sass", "pipeline",
           "resource_usage", "resources", "weight_stages_in_flight"]
