"""Host cost of the SGLang plugin's hot calls: what the plugin's hooks run per forward, with the backend
function replaced by one that does nothing (so only the host path is timed), on tiny CPU tensors.

Three calls, each exactly what its hook runs:

* ``draft fc forward``: the draft hook's whole forward (``draft_fc_hooks._run_draft_forward``: the checks
  on the draft's input, the row bucket's planned call, the fused fc, the swap of the draft's input, SGLang's
  forward, here a no-op) for a draft state planned to the reference backend;
* ``capture``: one capture into the persistent buffer, as ``ForwardCapture.write`` makes it;
* ``fused norm capture``: one ``fused_add_rmsnorm_capture`` as the fused-norm hook makes it.

Per call: the median of ``ROUNDS`` rounds of ``CALLS`` calls, thread CPU time (``time.thread_time``: what the
call costs, not time spent waiting for a core on a loaded box).

    python benchmarks/bench_plugin_host.py                 # this tree
    python benchmarks/bench_plugin_host.py --against REV   # REV's tree and this one, alternately, one run

``--against`` checks REV out into a temporary git worktree (with this tree's built extension copied in: REV's
own sources must match it, which holds for the commit before a change that did not rebuild) and runs this
same script there and here, twice each, alternately, so that load from other processes hits both alike;
``--against-tree DIR`` does the same with a checkout that has its own extension built. The
script works with both APIs: the hooks' planned call before issue 39 (``dispatch.using`` + ``plans.forced_path``
around the public face) and after it (the bound call made at install).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

CALLS = int(os.environ.get("EAGLE3_HOST_BENCH_CALLS", "400"))
ROUNDS = int(os.environ.get("EAGLE3_HOST_BENCH_ROUNDS", "15"))
ROOT = Path(__file__).resolve().parents[1]


def _noop(*args, **kwargs):
    return None


def _draft_case():
    """(name, call) for the draft hook's forward on a state planned to the (no-op) reference backend."""
    from eagle3_ops import qualify
    from eagle3_ops.sglang import draft_fc_hooks as hooks

    H, K, M = 64, 3, 4
    fc = torch.nn.Linear(K * H, H, bias=False, dtype=torch.bfloat16)
    fc.weight.requires_grad_(False)
    norms = [types.SimpleNamespace(weight=torch.nn.Parameter(torch.ones(H, dtype=torch.bfloat16),
                                                             requires_grad=False)) for _ in range(K)]
    inner = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=H))
    head = hooks.DraftHead("replicated", type(inner), fc, None, norms, 1e-6, K)
    state = hooks.DraftFcState(inner, head)
    shape = qualify.Shape("draft_fc", H, K, H, "bfloat16", False, True, False)
    state.plan = qualify.Plan("cpu", shape, [qualify.Choice("draft_fc", 8, "reference", None, 0.0, 1.0, 1.0, "stock")])
    if hasattr(hooks, "bind_calls"):  # after issue 39: the install binds the planned calls
        hooks.bind_calls(state, "reference")
        state.allocate_workspace(8)
    h = torch.randn(M, K * H, dtype=torch.bfloat16)
    batch = types.SimpleNamespace(spec_info=types.SimpleNamespace(hidden_states=h))
    kwargs = {"forward_batch": batch}

    def call():
        hooks._run_draft_forward(state, _noop, inner, (), kwargs)

    return "draft fc forward", call


def _capture_cases():
    """(name, call) for one capture and one fused norm capture, as the target's hooks make them."""
    T, H, K = 4, 64, 3
    buf = torch.zeros(T, K * H, dtype=torch.bfloat16)
    value = torch.randn(T, H, dtype=torch.bfloat16)
    x, residual = torch.randn(T, H, dtype=torch.bfloat16), torch.randn(T, H, dtype=torch.bfloat16)
    weight = torch.ones(H, dtype=torch.bfloat16)
    if importlib.util.find_spec("eagle3_ops.bound") is not None:
        # after issue 39: the hooks call what the install bound (state.copy, state.fused)
        from eagle3_ops import bound

        copy = bound.capture("reference", torch.device("cpu"), torch.bfloat16)
        fused = bound.fused_add_rmsnorm_capture("reference", torch.device("cpu"), torch.bfloat16)
        return [("capture", lambda: copy(value, None, buf, 1)),
                ("fused norm capture", lambda: fused(x, residual, weight, 1e-6, buf, 2))]
    from eagle3_ops import dispatch, ops

    def fused_call():
        with dispatch.using("reference"):
            ops.fused_add_rmsnorm_capture(x, residual, weight, 1e-6, buf, 2)

    return [("capture", lambda: ops.capture(value, None, buf, 1)), ("fused norm capture", fused_call)]


def measure() -> dict:
    from eagle3_ops import reference

    for name in ("draft_fc", "capture", "fused_add_rmsnorm_capture"):  # before any call resolves them
        setattr(reference, name, _noop)
    cases = [_draft_case()] + _capture_cases()
    out = {}
    with torch.no_grad():
        for _name, fn in cases:
            for _ in range(50):
                fn()
        times = {name: [] for name, _ in cases}
        for _ in range(ROUNDS):
            for name, fn in cases:
                t0 = time.thread_time()
                for _ in range(CALLS):
                    fn()
                times[name].append((time.thread_time() - t0) / CALLS * 1e6)
    for name, ts in times.items():
        out[name] = {"median_us": round(statistics.median(ts), 2), "min_us": round(min(ts), 2),
                     "max_us": round(max(ts), 2)}
    return out


def _run(tree: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--json"], cwd=tree, env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _compare(label: str, tree: Path) -> None:
    runs = {label: [], "this tree": []}
    for _ in range(2):
        runs[label].append(_run(tree))
        runs["this tree"].append(_run(ROOT))
    names = list(runs["this tree"][0])
    print(f"host µs per call (thread CPU time; median of {ROUNDS} rounds x {CALLS} calls; two runs each, "
          f"alternately)")
    print(f"{'call':<20} | {label:>22} | {'this tree':>22}")
    for n in names:
        cells = [" / ".join(f"{r[n]['median_us']:.2f}" for r in runs[k]) for k in (label, "this tree")]
        print(f"{n:<20} | {cells[0]:>22} | {cells[1]:>22}")


def _against(rev: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="eagle3-host-"))
    tree = tmp / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), rev], check=True)
    try:
        for so in (ROOT / "eagle3_ops").glob("_C*.so"):
            shutil.copy2(so, tree / "eagle3_ops" / so.name)
        _compare(rev, tree)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", metavar="REV", help="also time REV's tree (a git worktree), alternately with this one")
    ap.add_argument("--against-tree", metavar="DIR", help="also time the checkout in DIR with the extension built "
                    "there (e.g. a worktree of an older commit after `python setup.py build_ext --inplace`)")
    ap.add_argument("--json", action="store_true", help="print one JSON line (what --against reads)")
    args = ap.parse_args(argv)
    if args.against_tree:
        _compare(Path(args.against_tree).name, Path(args.against_tree).resolve())
        return 0
    if args.against:
        _against(args.against)
        return 0
    result = measure()
    if args.json:
        print(json.dumps(result))
    else:
        for name, r in result.items():
            print(f"{name:<20} {r['median_us']:7.2f} µs (min {r['min_us']:.2f}, max {r['max_us']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
