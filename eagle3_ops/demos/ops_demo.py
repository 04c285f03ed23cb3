"""``python -m eagle3_ops demo``: stock SGLang draft input (clone + cat + F.linear) vs eagle3_ops
(capture into one buffer + fused draft_fc) on a random case, with errors vs a float64 reference.
When SGLang is importable, the SGLang part (tiny target + draft, stock vs plugin) follows.

Times are shown only where they compare like with like: on a GPU whose capture and draft_fc are
served by a kernel of ours (cuda or triton), both paths timed in the same run with CUDA events and
the column naming the GPU. On a CPU (or wherever the reference backend serves) there is no time
column and the demo says why: there eagle3_ops is plain PyTorch computing in float32 while stock's
F.linear runs in bfloat16, so a ratio of the two would measure that difference, not the ops.
"""
from __future__ import annotations

import importlib.util
from typing import Dict, Optional

import torch
import torch.nn.functional as F

from .. import dispatch
from ..buffer import AuxCaptureBuffer
from ..ops import capture, draft_fc
from ..timing import device_label, median_ms
from .table import print_table

TIMED_OPS = ("capture", "draft_fc")  # the ops the eagle3_ops path runs


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def why_untimed(device: torch.device, served: Dict[str, str]) -> Optional[str]:
    """Why this run shows no times (None: both paths are timed on ``device``, with CUDA events).

    ``served``: the backend of each op on ``device`` (``dispatch.backends``)."""
    if device.type != "cuda":
        return ("no time column on a CPU: here eagle3_ops runs its reference backend (plain PyTorch computing "
                "in float32, there to be right, not fast) while stock's F.linear runs in bfloat16, so their CPU "
                "times would compare two different computations and say nothing about either on a GPU. On a GPU "
                "this demo times both paths in one run with CUDA events; benchmarks/device_check.sh measures the "
                "kernels (benchmarks/NOTES.md has every measured version)")
    reference = [op for op in TIMED_OPS if served.get(op) == "reference"]
    if reference:
        return (f"no time column: {', '.join(reference)} served by the reference backend on "
                f"{torch.cuda.get_device_name(device)} "
                "(plain PyTorch computing in float32, not a kernel of ours), so a time would compare it with "
                "stock's bfloat16 F.linear, not the ops (EAGLE3_OPS_BACKEND, or no cuda/triton backend for this GPU)")
    return None


def kernel_demo(device: torch.device) -> list:
    """Runs the draft input path both ways on a random bf16 case on ``device`` (T=64, K=3, H=7168 on a GPU, 256 on a
    CPU), prints each path's max rel err vs float64 (and its median ms where that compares like with like), and returns
    the table rows."""
    on_gpu = device.type == "cuda"
    T, H, K = (64, 7168, 3) if on_gpu else (64, 256, 3)
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    hiddens = [torch.randn(T, H, generator=gen).to(device, dtype) for _ in range(K)]
    residuals = [torch.randn(T, H, generator=gen).to(device, dtype) for _ in range(K)]
    weight = (torch.randn(H, K * H, generator=gen) / (K * H) ** 0.5).to(device, dtype)

    # float64 ground truth of the whole draft input path
    x64 = torch.cat([h.double() + r.double() for h, r in zip(hiddens, residuals)], dim=-1)
    y64 = x64 @ weight.double().t()

    def stock():
        aux = [(h + r).clone() for h, r in zip(hiddens, residuals)]
        return F.linear(torch.cat(aux, dim=-1), weight)

    buf = AuxCaptureBuffer(T, H, K, dtype, device)

    def ours():
        for k in range(K):
            capture(hiddens[k], residuals[k], buf.buffer, k)
        return draft_fc(buf.view(T), weight)

    served = dispatch.backends(device)
    untimed = why_untimed(device, served)
    time_column = f"median ms on {device_label(device)}"
    rows = []
    for name, fn in (("stock (add+clone+cat+F.linear)", stock), ("eagle3_ops (capture+draft_fc)", ours)):
        y = fn()
        row = {"path": name, "max rel err vs fp64": f"{_rel_err(y, y64):.2e}"}
        if untimed is None:  # both timed in this one run, on this GPU, with CUDA events
            row[time_column] = f"{median_ms(fn, device):.4f}"
        rows.append(row)
    cap_err = _rel_err(buf.view(T), x64)
    where = (device_label(device) if untimed is None else
             torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU")
    print(f"eagle3_ops demo on {where}: T={T}, H={H}, K={K}, dtype={dtype}")
    print("backends:", served)
    print(f"capture buffer max rel err vs fp64: {cap_err:.2e}")
    print_table(rows)
    if untimed is not None:
        print(f"({untimed})")
    return rows


def main() -> int:
    """``python -m eagle3_ops demo``: :func:`kernel_demo` on the GPU if there is one (else the CPU), then the SGLang
    demo when SGLang is importable; returns exit status 0."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    kernel_demo(device)
    if importlib.util.find_spec("sglang") is not None:
        from .sglang_demo import run_sglang_demo

        print()
        run_sglang_demo()
    return 0
