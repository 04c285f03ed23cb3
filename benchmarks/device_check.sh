#!/usr/bin/env bash
# Device check of eagle3_ops on a machine with one NVIDIA GPU and no network:
#   1. build the CUDA extension for the GPU found here (pip install --no-build-isolation -e .,
#      against the machine's own torch; TORCH_CUDA_ARCH_LIST = this GPU only, e.g. 9.0a on H200),
#   2. run the `gpu` tests (pytest -m gpu tests),
#   3. run every benchmarks/bench_*.py (pytest benchmarks; JSON rows in $OUT/bench.json),
#   4. print a short table last (also in $OUT/table.txt).
# Needs: python with torch (CUDA) + triton + pytest, nvcc. Not needed: sglang, network.
# Budget: < ~8 min on an H200 (each step has its own timeout, below).
#
# Usage (from the repository root or anywhere):
#   bash benchmarks/device_check.sh
#   OUT=/some/dir PYTHON=python3.12 bash benchmarks/device_check.sh
# Env:
#   PYTHON             interpreter to use (default: python3)
#   OUT                where results go (default: /tmp/eagle3_device_check): env.txt build.log gpu_tests.log
#                      gpu_tests.xml bench.log bench.json table.txt
#   MAX_JOBS           parallel compile jobs (default: number of CPUs)
#   EAGLE3_WHEELS      a folder of wheels to install pytest / pytest-benchmark from, offline, if missing
#   SKIP_BUILD=1       reuse the extension already built in this tree
#   BUILD_TIMEOUT / TESTS_TIMEOUT / BENCH_TIMEOUT   seconds per step (default 270 / 180 / 150)
# Exit status: 0 when the build, the gpu tests and the benchmarks all succeeded, else 1 (the first
# table line says PASS/FAIL; test modules that cannot be imported here, e.g. needing hypothesis or
# sglang, are listed and not counted as failures).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
OUT="${OUT:-${TMPDIR:-/tmp}/eagle3_device_check}"
mkdir -p "$OUT"
BUILD_TIMEOUT="${BUILD_TIMEOUT:-270}"
TESTS_TIMEOUT="${TESTS_TIMEOUT:-180}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-150}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
T0=$SECONDS
say() { echo "[device_check $(( SECONDS - T0 ))s] $*"; }

# ---- 0. environment -------------------------------------------------------------------------------
{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi -L 2>&1 || true
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1 || echo "triton: not importable"
  (command -v nvcc && nvcc --version | tail -2) 2>&1 || echo "nvcc: not on PATH"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

CAP="$("$PY" -c "import torch; assert torch.cuda.is_available(); m, n = torch.cuda.get_device_capability(); print(f'{m}.{n}')" 2>/dev/null)"
if [ -z "$CAP" ]; then
  say "no CUDA device visible to torch: nothing to check"
  exit 1
fi
case "$CAP" in
  9.0|10.0|10.3|12.0|12.1) ARCH="${CAP}a" ;;  # arch-specific targets (what the package ships: 9.0a, 12.0a)
  *) ARCH="$CAP" ;;
esac
export TORCH_CUDA_ARCH_LIST="$ARCH"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    if [ -x "$d/nvcc" ]; then export PATH="$d:$PATH"; break; fi
  done
fi

# pytest (and pytest-benchmark, optional: benchmarks/conftest.py has a stand-in) from local wheels
if ! "$PY" -c "import pytest" 2>/dev/null || ! "$PY" -c "import pytest_benchmark" 2>/dev/null; then
  if [ -n "${EAGLE3_WHEELS:-}" ] && [ -d "$EAGLE3_WHEELS" ]; then
    "$PY" -m pip install -q --no-index --find-links "$EAGLE3_WHEELS" pytest pytest-benchmark >> "$OUT/env.txt" 2>&1 || true
  fi
fi
if ! "$PY" -c "import pytest" 2>/dev/null; then
  say "pytest is not installed (set EAGLE3_WHEELS to a folder with its wheel)"
  exit 1
fi

# ---- 1. build -------------------------------------------------------------------------------------
BUILD_OK=0
if [ "${SKIP_BUILD:-0}" = "1" ]; then
  say "SKIP_BUILD=1: using the extension already in the tree"
else
  say "building eagle3_ops._C for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST with MAX_JOBS=$MAX_JOBS"
  if ! timeout "$BUILD_TIMEOUT" "$PY" -m pip install --no-build-isolation --no-deps --no-index -v -e . \
      > "$OUT/build.log" 2>&1; then
    say "pip install -e . failed (tail of build.log below); trying setup.py build_ext --inplace"
    tail -15 "$OUT/build.log"
    timeout "$BUILD_TIMEOUT" "$PY" setup.py build_ext --inplace >> "$OUT/build.log" 2>&1 || true
  fi
fi
if "$PY" -c "import eagle3_ops, eagle3_ops._C; print('build info:', eagle3_ops.build_info()); print('backends:', eagle3_ops.backends())" \
    > "$OUT/build_info.txt" 2>&1; then
  BUILD_OK=1
fi
cat "$OUT/build_info.txt"
[ "$BUILD_OK" = 1 ] && say "extension importable" || { say "BUILD FAILED: extension not importable"; tail -30 "$OUT/build.log"; }

# ---- 2. gpu tests ---------------------------------------------------------------------------------
say "pytest -m gpu tests (timeout ${TESTS_TIMEOUT}s)"
timeout "$TESTS_TIMEOUT" "$PY" -m pytest -m gpu tests -q -ra -p no:cacheprovider --continue-on-collection-errors \
  --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.log" 2>&1
TESTS_RC=$?
tail -25 "$OUT/gpu_tests.log"

# ---- 3. benchmarks --------------------------------------------------------------------------------
say "pytest benchmarks (timeout ${BENCH_TIMEOUT}s)"
rm -f "$OUT/bench.json"
EAGLE3_BENCH_JSON="$OUT/bench.json" timeout "$BENCH_TIMEOUT" "$PY" -m pytest benchmarks -q -p no:cacheprovider \
  > "$OUT/bench.log" 2>&1
BENCH_RC=$?
grep -E "passed|failed|error" "$OUT/bench.log" | tail -5

# ---- 4. table (last) ------------------------------------------------------------------------------
say "done in $(( SECONDS - T0 ))s"
"$PY" - "$OUT" "$BUILD_OK" "$TESTS_RC" "$BENCH_RC" "$TORCH_CUDA_ARCH_LIST" <<'EOF' | tee "$OUT/table.txt"
import json, os, sys
import xml.etree.ElementTree as ET

out, build_ok, tests_rc, bench_rc, arch = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]


def rc_text(rc):
    return "ok" if rc == 0 else ("TIMED OUT" if rc in (124, 137) else f"FAILED (rc={rc})")


# gpu tests pass when nothing failed and every error is a module that cannot be imported on this
# machine (e.g. needs hypothesis or sglang; listed below), and at least one test ran.
tests, tests_ok, unimportable = "no junit report", False, []
try:
    root = ET.parse(os.path.join(out, "gpu_tests.xml")).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    a = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    for case in suite.iter("testcase"):
        err = case.find("error")
        if err is not None and err.get("message") == "collection failure":
            unimportable.append(case.get("name"))
    passed = a["tests"] - a["failures"] - a["errors"] - a["skipped"]
    tests = f"{passed} passed, {a['failures']} failed, {a['errors']} errors, {a['skipped']} skipped"
    tests_ok = tests_rc in (0, 1) and a["failures"] == 0 and a["errors"] == len(unimportable) and passed > 0
except Exception as e:  # no report (timeout) or unreadable
    tests = f"no junit report ({type(e).__name__})"

print()
print("=" * 100)
verdict = build_ok and tests_ok and bench_rc == 0
print(f"eagle3_ops device check: {'PASS' if verdict else 'FAIL'}   build ({arch}): {'ok' if build_ok else 'FAILED'}   "
      f"gpu tests: {'ok' if tests_ok else (rc_text(tests_rc) if tests_rc else 'FAILED (no test passed)')} [{tests}]   benchmarks: {rc_text(bench_rc)}")
if unimportable:
    print("test modules not importable here (not counted as failures): " + ", ".join(unimportable))
path = os.path.join(out, "bench.json")
if not os.path.exists(path):
    print("no benchmark rows (bench.json missing)")
    sys.exit(0 if verdict else 1)
data = json.load(open(path))
meta, rows = data["meta"], data["rows"]
print(f"device: {meta['device']}   copy bandwidth (measured here, {meta['copy_bytes'] >> 20} MiB D2D, read+write): "
      f"{meta['copy_bw_GBps']} GB/s   torch {meta['torch']}, triton {meta['triton']}   timing: {meta['timing']}")
if meta.get("smoke"):
    print("SMOKE TEST ON THE CPU: these numbers say nothing about GPU kernels")
cols = ["bench", "shape", "ours", "ours_us", "stock_us", "speedup", "floor_us", "GB/s", "%copy-bw"]
table = [[r.get(c) if r.get(c) is not None else "-" for c in cols] for r in rows]
try:
    from tabulate import tabulate
    print(tabulate(table, headers=cols, floatfmt=".4g"))
except ImportError:
    widths = [max(len(str(c)), *(len(str(row[i])) for row in table)) for i, c in enumerate(cols)]
    print("  ".join(str(c).rjust(w) for c, w in zip(cols, widths)))
    for row in table:
        print("  ".join(str(v).rjust(w) for v, w in zip(row, widths)))
stocks = sorted({f"{r['bench']}: {r['stock']}" for r in rows if r.get("stock")})
print("stock paths: " + " | ".join(stocks))
sys.exit(0 if verdict else 1)
EOF
exit "${PIPESTATUS[0]}"
