"""Host cost of the speculation report (eagle3_ops/sglang/spec_report.py) per decode cycle, and, on a GPU, its
timing code checked against a GPU wait of known length. No SGLang needed: the hooks are called as SGLang's
HookRegistry calls them (``hook(original, *args)``), around functions that do nothing.

    python benchmarks/bench_spec_report.py                 # CPU: the host clock marks
    python benchmarks/bench_spec_report.py --device cuda   # GPU: CUDA event marks (benchmarks/device_check.sh)

Rows (thread CPU time, median of ROUNDS rounds of CALLS cycles):

* ``count``: the AFTER hook's count of one verify step of 16 requests (what every cycle pays);
* ``cycle hook, not sampled``: the AROUND hook of ``forward_batch_generation`` on the 63 cycles in 64 it does not time;
* ``cycle, sampled``: a timed cycle with its three phase hooks (marks recorded, earlier samples read), per cycle;
* ``per cycle, amortised``: count + (63 unsampled + 1 sampled) / 64.

With ``--device cuda`` it also times a GPU wait of known length (``torch.cuda._sleep``) as the verify phase and
prints what the report measured for it against CUDA events recorded around it directly (the same clock, so they
must agree), with no ``torch.cuda.synchronize`` on the timed path: the samples are read once complete.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_ops.sglang import spec_report as sr  # noqa: E402 - after the repository root is importable

CALLS = int(os.environ.get("EAGLE3_HOST_BENCH_CALLS", "640"))
ROUNDS = int(os.environ.get("EAGLE3_HOST_BENCH_ROUNDS", "15"))


class _Mode:
    def is_extend(self):
        return False

    def is_idle(self):
        return False


def _noop(*args, **kwargs):
    return None


def _median_us(fn, calls=CALLS, rounds=ROUNDS) -> float:
    for _ in range(64):
        fn()
    per = []
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        per.append((time.thread_time() - t0) / calls * 1e6)
    return statistics.median(per)


def measure(device_type: str) -> dict:
    """{row: µs} (see the module doc)."""
    sr.FIRST_AFTER_CYCLES = 1 << 62  # never logs or writes a report here (the count's cost is what is timed)
    sr._report = sr.SpecReport(4, 1, 5, "bench", device_type)
    worker, batch = types.SimpleNamespace(), types.SimpleNamespace(forward_mode=_Mode(), is_extend_in_batch=False)
    correct = [0, 2, 4, 1, 3, 3, 0, 4, 2, 2, 1, 4, 0, 3, 4, 1]
    hooks = [sr.around_phase(p) for p in sr.PHASES]

    def phases(*args):
        for hook in hooks:
            hook(_noop)

    out = {"count": _median_us(lambda: sr.after_resolve_spec_tokens(correct))}
    times = sr._report.times
    times.sample_every = 1 << 30  # never sampled after the first
    times.seen = 1
    out["cycle hook, not sampled"] = _median_us(lambda: sr.around_cycle(_noop, worker, batch)) - \
        _median_us(lambda: _noop(worker, batch))
    times.sample_every = 1  # every cycle sampled, phases included
    out["cycle, sampled"] = _median_us(lambda: sr.around_cycle(phases, worker, batch)) - \
        _median_us(lambda: phases(worker, batch))
    if device_type == "cuda":
        torch.cuda.synchronize()  # outside the timed calls: drop what the loops above left
    out["per cycle, amortised"] = out["count"] + (63 * out["cycle hook, not sampled"] + out["cycle, sampled"]) / 64
    return out


def gpu_wait_check(cycles: int = 20_000_000) -> dict:
    """A GPU wait as the verify phase of one timed cycle: what the report reads, and CUDA events around it."""
    sr._report = sr.SpecReport(4, 1, 5, "bench", "cuda")
    sr._report.times.sample_every = 1
    verify = sr.around_phase("verify")
    direct = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]

    def cycle_body(*args):
        def wait():
            direct[0].record()
            torch.cuda._sleep(cycles)
            direct[1].record()
        verify(wait)

    t0 = time.perf_counter()
    sr.around_cycle(cycle_body, types.SimpleNamespace(), types.SimpleNamespace(forward_mode=_Mode(),
                                                                                 is_extend_in_batch=False))
    host_s = time.perf_counter() - t0  # the hooks returned without waiting for the GPU
    times = sr._report.times
    waited = 0
    while times.pending and waited < 1000:
        time.sleep(0.01)
        times.collect()
        waited += 1
    got = times.done[-1]
    return {"report_verify_ms": got["verify"], "events_ms": direct[0].elapsed_time(direct[1]),
            "cycle_ms": got["cycle"], "host_ms_to_return": host_s * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    rows = measure(args.device)
    print(f"speculation report host cost per decode cycle ({args.device} marks; thread CPU time, median of {ROUNDS} "
          f"rounds x {CALLS} calls)")
    for name, us in rows.items():
        print(f"  {name:<26} {us:7.2f} µs")
    if args.device == "cuda":
        c = gpu_wait_check()
        print(f"  GPU wait as the verify phase: the report read {c['report_verify_ms']:.3f} ms, CUDA events around it "
              f"{c['events_ms']:.3f} ms (cycle {c['cycle_ms']:.3f} ms); the hooks returned after "
              f"{c['host_ms_to_return']:.3f} ms of host time (no sync)")
    sr.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
