"""``python -m eagle3_ops demo``: stock SGLang draft input (clone + cat + F.linear) vs eagle3_ops
(capture into one buffer + fused draft_fc) on a random case, with errors vs a float64 reference.
When SGLang is importable, the SGLang part (tiny target + draft, stock vs plugin) follows."""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from .. import dispatch
from ..buffer import AuxCaptureBuffer
from ..ops import capture, draft_fc
from ..timing import device_label, median_ms
from .table import print_table


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def kernel_demo(device: torch.device) -> list:
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

    rows = []
    for name, fn in (("stock (add+clone+cat+F.linear)", stock), ("eagle3_ops (capture+draft_fc)", ours)):
        y = fn()
        ms = median_ms(fn, device)
        rows.append({"path": name, "max rel err vs fp64": f"{_rel_err(y, y64):.2e}", "median ms": f"{ms:.4f}"})
    cap_err = _rel_err(buf.view(T), x64)
    print(f"eagle3_ops demo on {device_label(device)}: T={T}, H={H}, K={K}, dtype={dtype}")
    print("backends:", dispatch.backends(device))
    print(f"capture buffer max rel err vs fp64: {cap_err:.2e}")
    print_table(rows)
    return rows


def main() -> int:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    kernel_demo(device)
    if importlib.util.find_spec("sglang") is not None:
        from .sglang_demo import run_sglang_demo

        print()
        run_sglang_demo()
    return 0
