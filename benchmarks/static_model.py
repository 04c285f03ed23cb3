"""Static model of the CUDA skinny draft fc: a PREDICTION, not a measurement.

Reads the built extension's cubins (``cuobjdump -res-usage`` and ``-sass`` of ``eagle3_ops/_C*.so``:
registers, shared memory, the weight ring's steps in flight across the hot loop's back-edge and the
hot loop's instructions per step, per kernel and arch), takes the block shape and split plan the planner
makes for each shape (``eagle3_ops.skinny_model.best_plan``, the function ``cuda_backend.skinny_choice``
calls; the script checks that the planner's own tables give the same plan), and prints per shape
and device the predicted fraction of the read bandwidth and its limiting factor
(``eagle3_ops/skinny_model.py`` documents the model and every device number, all datasheet figures
or design estimates).

    python benchmarks/static_model.py                  # the table (markdown)
    python benchmarks/static_model.py --detail         # one row per (device, shape, M, variant)
    python benchmarks/static_model.py --write-docs     # regenerate the table in docs/kernels.md
    python benchmarks/static_model.py --check-docs     # exit 1 if docs/kernels.md's table differs (or the
                                                       # planner's tables plan other splits than the cubins)

Shapes (issue 21): the Kimi-K2.5 draft fc N = 7168, K*H = 21504 replicated and N = 896 per rank at
TP = 8; Llama-3.1-8B N = 4096, K*H = 12288; M in {1, 8, 16, 32, 64}; bf16. Variants: plain (no norm),
norm (fc_norm: K = 3 chunk norms, the pre-pass writes x*g) and folded (the same norms folded into the
weight, the pre-pass writes only the statistics). Targets (issue 21, predicted): >= 80% of the read
bandwidth at M <= 16, >= 70% at M = 64.
"""
from __future__ import annotations

import argparse
import glob
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle3_ops import skinny_model  # noqa: E402
from tools import sass  # noqa: E402

SHAPES = (("Kimi-K2.5", 7168, 21504), ("Kimi-K2.5 TP=8", 896, 21504), ("Llama-3.1-8B", 4096, 12288))
MS = (1, 8, 16, 32, 64)
VARIANTS = (("plain", 1, False, False), ("norm", 3, True, False), ("folded", 3, True, True))
DEVICES = ("H100", "H200", "RTX PRO 6000")  # the docs table's; --device auto: the GPU this runs on
DOCS = ROOT / "docs" / "kernels.md"
BEGIN, END = "<!-- static_model table: begin -->", "<!-- static_model table: end -->"
SHORT = {"DRAM bandwidth": "bw", "fill latency": "lat", "bytes in flight": "infl", "L2 bandwidth": "L2",
         "issue rate": "issue", "tensor rate": "mma", "split-K partials": "part", "norm pre-pass": "pre",
         "reducer": "red"}
_SKINNY = re.compile(r"fc_skinny_kernelIN3c10(\d+)(BFloat16|Half)ELi(\d+)ELi(\d+)ELi(\d+)E")


def target(M: int) -> Optional[float]:
    return 0.8 if M <= 16 else 0.7 if M == 64 else None


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton

        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    raise SystemExit("static_model: cuobjdump not found (CUDA toolkit or triton's copy)")


def extension_path(path: Optional[str]) -> str:
    if path:
        return path
    built = sorted(glob.glob(str(ROOT / "eagle3_ops" / "_C*.so")))
    if not built:
        raise SystemExit("static_model: no eagle3_ops/_C*.so: build the extension first (setup.py build_ext --inplace)")
    return built[0]


def kernels_from_cubins(so: str, dtype: str = "BFloat16") -> Dict[str, Dict[tuple, skinny_model.Kernel]]:
    """arch ("sm_90" / "sm_120") -> (NT, rows, stages) -> the model's Kernel, from the built cubins."""
    tool = cuobjdump()
    usage = sass.resource_usage(subprocess.run([tool, "-res-usage", so], capture_output=True, text=True,
                                               check=True).stdout)
    code = sass.parse_sass(subprocess.run([tool, "-sass", so], capture_output=True, text=True, check=True).stdout)
    return kernels_from(usage, code, dtype)


def kernels_from(usage: dict, code: dict, dtype: str = "BFloat16") -> Dict[str, Dict[tuple, skinny_model.Kernel]]:
    """The same from parsed ``cuobjdump -res-usage`` / ``-sass`` (sass.resource_usage / parse_sass).
    The ring's depth is what the SASS keeps in flight (+ 1); its shared memory is the static
    allocation, or for a dynamic ring (nothing static) the size the launch passes."""
    out: Dict[str, Dict[tuple, skinny_model.Kernel]] = {}
    for (arch, fn), ins in code.items():
        m = _SKINNY.search(fn)
        if not m or m.group(2) != dtype:
            continue
        nt, rows, built_stages = int(m.group(3)), int(m.group(4)), int(m.group(5))
        lp = sass.hot_loop(ins)
        depth = int(sass.pipeline(ins, lp, sass.WEIGHT_LOAD).stages_in_flight) + 1
        res = sass.resources(usage, arch, fn)  # either spelling of the arch (sm_90 / sm_90a), or a bare cubin's
        base = sass.arch_base(arch)
        shared = res["SHARED"] - skinny_model.SM_LIMITS[base].shared_reserved_per_block  # cuobjdump counts it in
        if shared == 0:  # dynamic ring
            shared = skinny_model.shared_bytes(nt, rows, built_stages)
        out.setdefault(base, {})[(nt, rows, built_stages)] = skinny_model.Kernel(
            nt, res["REG"], shared, depth, sass.hot_loop_instructions_per_step(ins, lp), 2, rows)
    return out


@dataclass
class Row:
    device: str
    shape: str
    N: int
    KH: int
    M: int
    variant: str
    p: skinny_model.Prediction
    kernel: skinny_model.Kernel
    planner_agrees: bool


def predict_all(kernels, devices=DEVICES) -> List[Row]:
    """Rows for ``devices``: names of skinny_model.DEVICES, or Device objects (the GPU this runs on)."""
    rows = []
    for d in devices:
        dev = skinny_model.DEVICES[d] if isinstance(d, str) else d
        dname = dev.name
        if dev.arch not in kernels:
            continue
        for shape, N, KH in SHAPES:
            for variant, NC, norm, folded in VARIANTS:
                for M in MS:
                    ks = [kernels[dev.arch][s] for s in skinny_model.shapes_for(skinny_model.token_groups(M))]
                    k, asked, p = skinny_model.best_plan(M, N, KH // NC, NC, dev, ks, norm, folded)
                    rows.append(Row(dname, shape, N, KH, M, variant, p, k,
                                    _planner_agrees(M, N, KH, NC, dev, k, norm, folded, asked)))
    return rows


def _planner_agrees(M, N, KH, NC, dev, k, norm, folded, asked) -> bool:
    """Whether cuda_backend (its tables of the cubins, torch imported) plans the same block shape and
    splits."""
    try:
        import torch

        from eagle3_ops import cuda_backend
    except ImportError:
        return True  # no torch here: the planner cannot be asked (the tables are checked in CI)
    tables = tuple(cuda_backend.kernel_model(dev.arch, s, torch.bfloat16) for s in skinny_model.shapes_for(k.nt))
    bpsm = tuple(cuda_backend.table_blocks_per_sm(dev.arch, t.shape, torch.bfloat16) for t in tables)
    chosen, splits, _ = cuda_backend.skinny_choice(M, N, KH // NC, NC, dev, tables, bpsm, norm, folded)
    return chosen.shape == k.shape and splits == asked


def markdown(rows: List[Row]) -> str:
    """One row per (device, shape, variant): per M the predicted % of read bandwidth, the limiting
    factor (abbreviated) and the split count."""
    head = ("| device | shape (N x K*H) | variant | " + " | ".join(f"M = {m}" for m in MS) + " |\n"
            "|---|---|---|" + "---|" * len(MS))
    lines = [head]
    groups: Dict[Tuple[str, str, str], List[Row]] = {}
    for r in rows:
        groups.setdefault((r.device, r.shape, r.variant), []).append(r)
    for (dev, shape, variant), rs in groups.items():
        cells = []
        for r in sorted(rs, key=lambda r: r.M):
            t = target(r.M)
            miss = "" if t is None or r.p.fraction >= t else " **below target**"
            k = r.kernel
            wide = "" if k.rows == skinny_model.DEFAULT_ROWS else f" B={k.rows}x{k.stages}"
            cells.append(f"{100 * r.p.fraction:.0f}% {SHORT[r.p.limiter]} S={r.p.S}{wide}{miss}")
        r0 = rs[0]
        lines.append(f"| {dev} | {shape} ({r0.N} x {r0.KH}) | {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail(rows: List[Row]) -> str:
    out = ["device        shape            M  variant  S   block  blocks bpsm waves  in-flight MB  time us  floor us  "
           "% read bw  limiter            losses (us)"]
    for r in rows:
        p = r.p
        losses = ", ".join(f"{k} {v * 1e6:.2f}" for k, v in p.losses.items() if v > 0)
        out.append(f"{r.device:13s} {r.shape:15s} {r.M:3d}  {r.variant:7s} {p.S:3d}  "
                   f"{r.kernel.rows:4d}x{r.kernel.stages} {p.blocks:5d}  {p.blocks_per_sm:3d} "
                   f"{p.waves:5.2f}  {p.in_flight / 1e6:10.2f}  {p.time * 1e6:7.1f}  {p.floor * 1e6:7.1f}  "
                   f"{100 * p.fraction:7.1f}%  {p.limiter:18s} {losses}"
                   + ("" if r.planner_agrees else "  PLANNER DIFFERS"))
    return "\n".join(out)


def this_gpu() -> skinny_model.Device:
    """The model's device for the GPU this runs on, read off it (cuda_backend.device_model: its name, SM count,
    reported bandwidth and clock)."""
    import torch

    from eagle3_ops import cuda_backend

    if not torch.cuda.is_available():
        raise SystemExit("static_model: --device auto needs a CUDA device (name a modelled device instead: "
                         + ", ".join(skinny_model.DEVICES) + ")")
    return cuda_backend.device_model(torch.device("cuda"))


def header(kernels, so: str, devices=DEVICES) -> str:
    lines = [f"Static model of the CUDA skinny draft fc (PREDICTION, not a measurement) from {Path(so).name}:"]
    for arch, ks in sorted(kernels.items()):
        lines.append(f"  {arch}: " + "; ".join(f"NT={nt} x {rows} rows: {k.regs} regs, {k.shared // 1024} KB "
                                                f"shared, {k.stages - 1} steps in flight, "
                                                f"{k.instructions_per_step:.0f} instr/step"
                                                for (nt, rows, _), k in sorted(ks.items())))
    for d in devices:
        d = skinny_model.DEVICES[d] if isinstance(d, str) else d
        lines.append(f"  {d.name}: {d.sms} SMs, read {d.read_bw / 1e12:.2f} TB/s, latency {d.latency * 1e6:.1f} us "
                     f"(needs {d.bytes_in_flight_needed / 1e6:.1f} MB in flight), L2 {d.l2_bw / 1e12:.1f} TB/s, "
                     f"mma.sync {d.mma_rate / 1e12:.0f} TFLOP/s, {d.clock / 1e9:.2f} GHz (design estimates, "
                     f"eagle3_ops/skinny_model.py)")
    return "\n".join(lines)


LEGEND = ("Cells: predicted % of the read bandwidth (weight bytes / read_bw over the modelled time), the "
          "limiting factor (bw: DRAM bandwidth, lat: fill latency, infl: bytes in flight, L2: L2 -> SM "
          "traffic, issue, mma: tensor rate, part: split-K partials, pre: norm pre-pass, red: reducer), the "
          "split count S, and B=128x4 / B=128x6 where the planner chose 128-row blocks with a 4- or 6-stage "
          "ring (else 64-row blocks). Targets (issue 21): "
          ">= 80% at M <= 16, >= 70% at M = 64.")


def docs_block(rows: List[Row]) -> str:
    return (f"{BEGIN}\n**Prediction** (generated by `python benchmarks/static_model.py --write-docs` from the "
            f"built cubins; not a measurement). {LEGEND}\n\n{markdown(rows)}\n{END}")


def replace_docs(text: str, block: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"static_model: {DOCS} has no '{BEGIN}' ... '{END}' block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + block + tail


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--so", help="the built extension (default: eagle3_ops/_C*.so)")
    ap.add_argument("--detail", action="store_true")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--check-docs", action="store_true")
    ap.add_argument("--device", action="append", metavar="NAME|auto",
                    help=f"a modelled device ({', '.join(skinny_model.DEVICES)}) or auto (the GPU this runs on, read "
                         f"off it); repeatable; default: {', '.join(DEVICES)} (the docs table's)")
    args = ap.parse_args(argv)
    so = extension_path(args.so)
    kernels = kernels_from_cubins(so)
    devices = DEVICES
    if args.device and not (args.write_docs or args.check_docs):
        unknown = [d for d in args.device if d != "auto" and d not in skinny_model.DEVICES]
        if unknown:
            raise SystemExit(f"static_model: unknown --device {unknown[0]!r} (known: "
                             f"{', '.join(skinny_model.DEVICES)}, auto)")
        devices = tuple(this_gpu() if d == "auto" else d for d in args.device)
    rows = predict_all(kernels, devices)
    if args.write_docs or args.check_docs:
        text = DOCS.read_text()
        new = replace_docs(text, docs_block(rows))
        if args.check_docs:
            if new != text:
                print("docs/kernels.md's prediction table differs from the static model of the built cubins; run "
                      "python benchmarks/static_model.py --write-docs")
                return 1
            if not all(r.planner_agrees for r in rows):
                print("cuda_backend's tables plan different splits than the cubins for some rows (regenerate them)")
                return 1
            print("docs/kernels.md's PREDICTION table is the static model of the built cubins; the planner agrees")
            return 0
        DOCS.write_text(new)
        print(f"wrote the prediction table into {DOCS}")
        return 0
    print(header(kernels, so, devices))
    print()
    print(detail(rows) if args.detail else LEGEND + "\n\n" + markdown(rows))
    if not all(r.planner_agrees for r in rows):
        print("\nWARNING: cuda_backend's tables plan different splits for some rows (regenerate the tables)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
