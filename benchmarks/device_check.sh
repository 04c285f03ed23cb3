#!/usr/bin/env bash
# Device check of eagle3_ops on a machine with one NVIDIA GPU and no network, inside a hard time
# budget (default 570 s: fits a 10-minute device call on one H200, build included):
#   0. environment (GPU, driver, torch, triton, nvcc) -> env.txt
#   1. build the CUDA extension for THIS GPU's arch only (TORCH_CUDA_ARCH_LIST=9.0a on an H200,
#      MAX_JOBS=16 or the CPU count; setup.py build_ext --inplace against the machine's own torch);
#      build.log ends with the static model of the skinny fc from these cubins (a prediction)
#   2. the `gpu` tests: GPU_TESTS=full (default: every `pytest -m gpu tests` case, ~1250, in
#      parallel over TEST_WORKERS pytest-xdist workers when xdist is installed) or quick (bf16 and
#      dtype-free cases without torch.compile, ~700) or skip
#   3. qualification, if `python -m eagle3_ops qualify --help` works here: Kimi-K2.5 (H=7168 K=3
#      N=7168, replicated and --tp 8 = N/8 rows per rank) and Llama-3.1-8B (H=4096 K=3), --json
#   4. the benchmarks (pytest benchmarks/bench_draft_fc.py benchmarks/bench_capture.py; rows written
#      after each one, so a stage cut short by its timeout keeps what it measured); then the host
#      path (benchmarks/bench_host_path.py: each eager face against its backend function), appended
#      to bench.log
#   5. the report: qualification tables and a short benchmark table printed LAST (the complete
#      tables in summary.txt)
# Everything goes to ONE results folder (8 files, what the device tool brings back):
#   env.txt build.log gpu_tests.log gpu_tests.xml qualify.json bench.log bench.json summary.txt
# in $OUT/results-<UTC stamp> when OUT is set, else benchmarks/results/<UTC stamp>-<gpu name>/
# (RESULTS_DIR overrides both). benchmarks/NOTES.md cites that folder.
#
# Time budget: every stage runs under `timeout` with min(its cap, what is left of TOTAL_BUDGET
# after the minimum reserved for the stages after it); a stage left with < 20 s is skipped and
# says so. pytest stages get SIGINT first (junit report and bench JSON still written), then KILL.
#
# Usage (from anywhere):
#   bash benchmarks/device_check.sh
#   GPU_TESTS=quick BENCH_SET=quick bash benchmarks/device_check.sh      # a shorter run
#   DRY_RUN=1 bash benchmarks/device_check.sh   # CPU: print every stage's command and timeout, run
#                                               # nothing on a GPU (CUDA_VISIBLE_DEVICES=""), run the
#                                               # CPU smoke benchmarks and the report
# Env:
#   PYTHON            interpreter (default python3)        OUT / RESULTS_DIR  where results go (above)
#   TOTAL_BUDGET      seconds for the whole script (570)   MAX_JOBS  compile jobs (min(16, CPUs))
#   BUILD_TIMEOUT / TESTS_TIMEOUT / QUALIFY_TIMEOUT (each run) / BENCH_TIMEOUT: caps (240/200/60/200)
#   GPU_TESTS         full | quick | skip (full)           TEST_WORKERS  xdist workers (4; 0 = none)
#   BENCH_SET         full | quick | skip (full)           SKIP_BUILD=1  reuse the extension in the tree
#   EAGLE3_WHEELS     a folder of wheels to install pytest / pytest-benchmark from, offline, if missing
#   DRY_RUN=1         see above; DRY_RUN_BENCH=0 / DRY_RUN_QUALIFY=0 skip even the CPU smoke benchmarks /
#                     the tiny CPU qualification it runs
# Needs: python with torch (CUDA) + triton + pytest, nvcc. Not needed: sglang, network.
# Exit status: 0 when the report's verdict is PASS (build, gpu tests, every qualification run that
# exists here, benchmarks), else 1.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
DRY_RUN="${DRY_RUN:-0}"
TOTAL_BUDGET="${TOTAL_BUDGET:-570}"
BUILD_TIMEOUT="${BUILD_TIMEOUT:-240}"
TESTS_TIMEOUT="${TESTS_TIMEOUT:-200}"
QUALIFY_TIMEOUT="${QUALIFY_TIMEOUT:-60}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-200}"
GPU_TESTS="${GPU_TESTS:-full}"
TEST_WORKERS="${TEST_WORKERS:-4}"
BENCH_SET="${BENCH_SET:-full}"
# The least each later stage is guaranteed (seconds), subtracted from what an earlier stage may use.
RESERVE_TESTS=60
RESERVE_QUALIFY=25   # per qualification run
RESERVE_BENCH=120
RESERVE_REPORT=15
MIN_STAGE=20
QUICK_TESTS_K="not float32 and (bfloat16 or not float16) and not torch_compile"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
export PYTHONUNBUFFERED=1
T0=$SECONDS
say() { echo "[device_check $(( SECONDS - T0 ))s] $*"; }
die_usage() { echo "device_check: $*" >&2; exit 2; }
case "$GPU_TESTS" in full|quick|skip) ;; *) die_usage "GPU_TESTS must be full, quick or skip (got '$GPU_TESTS')";; esac
case "$BENCH_SET" in full|quick|skip) ;; *) die_usage "BENCH_SET must be full, quick or skip (got '$BENCH_SET')";; esac
case "$DRY_RUN" in 0|1) ;; *) die_usage "DRY_RUN must be 0 or 1 (got '$DRY_RUN')";; esac

# budget CAP RESERVE -> the seconds a stage may take: min(CAP, TOTAL_BUDGET - elapsed - RESERVE)
budget() {
  local left=$(( TOTAL_BUDGET - (SECONDS - T0) - $2 ))
  if [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}
# run_timed SECONDS SIGNAL LOG CMD... : CMD under timeout (SIGNAL first, KILL 15 s later), output to
# LOG; sets RC (124 = timed out). In DRY_RUN it only prints the command.
run_timed() {
  local t=$1 sig=$2 log=$3; shift 3
  if [ "$DRY_RUN" = 1 ]; then
    echo "    DRY RUN, would run (timeout ${t}s, SIG$sig): $*"
    RC=0
    return
  fi
  timeout -s "$sig" -k 15 "$t" "$@" > "$log" 2>&1
  RC=$?
}

if [ "$DRY_RUN" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""   # nothing below may touch a GPU
  say "DRY RUN: stages and commands are printed; only CPU-safe parts run (CPU smoke benchmarks, report)"
fi

# ---- results folder --------------------------------------------------------------------------------
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
GPU_NAME=""
if [ "$DRY_RUN" != 1 ] && command -v nvidia-smi >/dev/null 2>&1; then
  GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
fi
SLUG="$(printf '%s' "${GPU_NAME:-cpu-dry-run}" | tr -c 'A-Za-z0-9._-' '_' | sed 's/__*/_/g; s/_$//')"
if [ -n "${RESULTS_DIR:-}" ]; then
  RES="$RESULTS_DIR"
elif [ -n "${OUT:-}" ]; then
  RES="$OUT/results-$STAMP"
else
  RES="$ROOT/benchmarks/results/$STAMP-$SLUG"
fi
mkdir -p "$RES" || die_usage "cannot create $RES"
RES="$(cd "$RES" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/eagle3_device_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
say "results folder: $RES (budget ${TOTAL_BUDGET}s)"

# ---- 0. environment --------------------------------------------------------------------------------
{
  echo "date: $(date -u +%FT%TZ)   budget: ${TOTAL_BUDGET}s   GPU_TESTS=$GPU_TESTS BENCH_SET=$BENCH_SET DRY_RUN=$DRY_RUN"
  echo "git: $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo 'no git')$(git -C "$ROOT" status --porcelain 2>/dev/null | head -c1 | sed 's/./ (uncommitted changes)/')"
  if [ "$DRY_RUN" != 1 ]; then
    nvidia-smi -L 2>&1 || true
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv 2>&1 || true
  fi
  "$PY" - <<'EOF' 2>&1
import sys, torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu visible:", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device:", p.name, "cc %d.%d" % (p.major, p.minor), p.multi_processor_count, "SMs, L2",
          getattr(p, "L2_cache_size", "?"), "B")
for name in ("triton", "pytest", "xdist", "pytest_timeout", "pytest_benchmark", "sgl_kernel", "flashinfer"):
    try:
        m = __import__(name)
        print(name, getattr(m, "__version__", "importable"))
    except Exception as e:
        print(name, "not importable:", type(e).__name__)
EOF
  (command -v nvcc && nvcc --version | tail -2) 2>&1 || echo "nvcc: not on PATH"
} > "$RES/env.txt" 2>&1
cat "$RES/env.txt"

CAP="$("$PY" -c "import torch; assert torch.cuda.is_available(); m, n = torch.cuda.get_device_capability(); print(f'{m}.{n}')" 2>/dev/null)"
if [ -z "$CAP" ] && [ "$DRY_RUN" != 1 ]; then
  say "no CUDA device visible to torch: nothing to check (DRY_RUN=1 shows the stages on a CPU)"
  exit 1
fi
[ -z "$CAP" ] && CAP="9.0"  # dry run: show the H200's commands
case "$CAP" in
  9.0|10.0|10.3|12.0|12.1) ARCH="${CAP}a" ;;  # arch-specific targets (what the package ships: 9.0a, 12.0a)
  *) ARCH="$CAP" ;;
esac
export TORCH_CUDA_ARCH_LIST="$ARCH"
NPROC="$(nproc 2>/dev/null || echo 4)"
export MAX_JOBS="${MAX_JOBS:-$(( NPROC < 16 ? NPROC : 16 ))}"
if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    if [ -x "$d/nvcc" ]; then export PATH="$d:$PATH"; break; fi
  done
fi
if ! "$PY" -c "import pytest" 2>/dev/null || ! "$PY" -c "import pytest_benchmark" 2>/dev/null; then
  if [ -n "${EAGLE3_WHEELS:-}" ] && [ -d "$EAGLE3_WHEELS" ]; then
    "$PY" -m pip install -q --no-index --find-links "$EAGLE3_WHEELS" pytest pytest-benchmark >> "$RES/env.txt" 2>&1 || true
  fi
fi
if ! "$PY" -c "import pytest" 2>/dev/null; then
  say "pytest is not installed (set EAGLE3_WHEELS to a folder with its wheel)"
  exit 1
fi

# ---- 1. build --------------------------------------------------------------------------------------
BUILD="FAILED"
if [ "${SKIP_BUILD:-0}" = "1" ]; then
  say "SKIP_BUILD=1: using the extension already in the tree"
  BUILD="skipped"
else
  T="$(budget "$BUILD_TIMEOUT" $(( RESERVE_TESTS + 3 * RESERVE_QUALIFY + RESERVE_BENCH + RESERVE_REPORT )))"
  if [ "$T" -lt "$MIN_STAGE" ]; then
    say "1. build: SKIPPED, out of time budget (TOTAL_BUDGET=${TOTAL_BUDGET}s is too small)"
    echo "skipped: out of time budget" > "$RES/build.log"
  else
    say "1. build eagle3_ops._C for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS (timeout ${T}s)"
    run_timed "$T" TERM "$RES/build.log" "$PY" setup.py build_ext --inplace
    [ "$DRY_RUN" = 1 ] && echo "(dry run: no build)" > "$RES/build.log"
    [ "$RC" = 124 ] && say "build TIMED OUT after ${T}s"
  fi
fi
if [ "$DRY_RUN" = 1 ]; then
  BUILD="dry-run"
elif "$PY" -c "import eagle3_ops, eagle3_ops._C; print('build info:', eagle3_ops.build_info()); print('backends:', eagle3_ops.backends())" \
    > "$WORK/build_info.txt" 2>&1; then
  [ "$BUILD" = "skipped" ] || BUILD="ok"
else
  BUILD="FAILED"
fi
[ -f "$WORK/build_info.txt" ] && { cat "$WORK/build_info.txt"; cat "$WORK/build_info.txt" >> "$RES/env.txt"; }
# the static model of the skinny fc from the cubins just built (a prediction, next to what is measured)
if [ "$DRY_RUN" != 1 ] && [ "$BUILD" != FAILED ]; then
  { echo; echo "---- benchmarks/static_model.py --detail (PREDICTION from these cubins) ----"
    timeout 60 "$PY" benchmarks/static_model.py --detail 2>&1; } >> "$RES/build.log" || true
fi
grep "eagle3_ops build:" "$RES/build.log" 2>/dev/null | tail -3
case "$BUILD" in ok|skipped|dry-run) say "extension: $BUILD" ;; *) say "BUILD FAILED: extension not importable"; tail -30 "$RES/build.log" ;; esac

# ---- 2. gpu tests ----------------------------------------------------------------------------------
TESTS_RC=""
if [ "$GPU_TESTS" = skip ]; then
  say "2. gpu tests: skipped (GPU_TESTS=skip)"
else
  T="$(budget "$TESTS_TIMEOUT" $(( 3 * RESERVE_QUALIFY + RESERVE_BENCH + RESERVE_REPORT )))"
  ARGS=(-m pytest -m gpu tests -q -ra -p no:cacheprovider --continue-on-collection-errors --junitxml="$RES/gpu_tests.xml")
  [ "$GPU_TESTS" = quick ] && ARGS+=(-k "$QUICK_TESTS_K")
  if [ "$TEST_WORKERS" != 0 ] && "$PY" -c "import xdist" 2>/dev/null; then ARGS+=(-n "$TEST_WORKERS"); fi
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then ARGS+=(--timeout=120); fi
  if [ "$T" -lt "$MIN_STAGE" ]; then
    say "2. gpu tests: SKIPPED, out of time budget (${T}s left for them)"
    TESTS_RC=124
  else
    say "2. gpu tests ($GPU_TESTS) (timeout ${T}s)"
    run_timed "$T" INT "$RES/gpu_tests.log" "$PY" "${ARGS[@]}"
    TESTS_RC=$RC
    [ "$DRY_RUN" = 1 ] || tail -15 "$RES/gpu_tests.log"
    [ "$TESTS_RC" = 124 ] && say "gpu tests TIMED OUT after ${T}s (the junit report holds the cases that ran)"
  fi
fi

# ---- 3. qualification ------------------------------------------------------------------------------
rm -f "$RES/qualify.json"
if "$PY" -m eagle3_ops qualify --help > "$WORK/qualify_help.txt" 2>&1; then
  NOCACHE=()
  grep -q -- "--no-cache" "$WORK/qualify_help.txt" && NOCACHE=(--no-cache)
  if [ "$DRY_RUN" = 1 ] && [ "${DRY_RUN_QUALIFY:-1}" = 0 ]; then
    QUAL_NAMES=()
    QUAL_ARGS=()
  elif [ "$DRY_RUN" = 1 ]; then
    # the real shapes would run the Triton interpreter at H=7168: print them, run one tiny shape
    QUAL_NAMES=(tiny-cpu-dry-run)
    QUAL_ARGS=("--hidden 64 --captures 3 --rows 1,4 --reps 1")
  else
    QUAL_NAMES=(kimi-k2.5 kimi-k2.5-tp8 llama-3.1-8b)
    QUAL_ARGS=("--hidden 7168 --captures 3 --out-features 7168"
               "--hidden 7168 --captures 3 --out-features 7168 --tp 8"
               "--hidden 4096 --captures 3")
  fi
  if [ "$DRY_RUN" = 1 ]; then
    for a in "--hidden 7168 --captures 3 --out-features 7168" "--hidden 7168 --captures 3 --out-features 7168 --tp 8" \
             "--hidden 4096 --captures 3"; do
      echo "    DRY RUN, would run (timeout <=${QUALIFY_TIMEOUT}s, SIGINT): $PY -m eagle3_ops qualify $a --json ${NOCACHE[*]}"
    done
  fi
  for i in "${!QUAL_NAMES[@]}"; do
    left=$(( ${#QUAL_NAMES[@]} - i - 1 ))
    T="$(budget "$QUALIFY_TIMEOUT" $(( left * RESERVE_QUALIFY + RESERVE_BENCH + RESERVE_REPORT )))"
    read -r -a A <<< "${QUAL_ARGS[$i]}"
    if [ "$T" -lt "$MIN_STAGE" ]; then
      say "3. qualify ${QUAL_NAMES[$i]}: SKIPPED, out of time budget"
      echo "skipped: out of time budget" > "$WORK/q.err"; : > "$WORK/q.out"
      "$PY" benchmarks/device_report.py qualify-merge "$RES/qualify.json" "${QUAL_NAMES[$i]}" "${QUAL_ARGS[$i]}" 124 0 "$WORK/q.out" "$WORK/q.err"
      continue
    fi
    say "3. qualify ${QUAL_NAMES[$i]}: ${QUAL_ARGS[$i]} (timeout ${T}s)"
    S=$SECONDS
    # runs for real in a dry run too: the tiny shape is CPU work (reference + Triton interpreter)
    timeout -s INT -k 10 "$T" "$PY" -m eagle3_ops qualify "${A[@]}" --json "${NOCACHE[@]}" > "$WORK/q.out" 2> "$WORK/q.err"
    QRC=$?
    "$PY" benchmarks/device_report.py qualify-merge "$RES/qualify.json" "${QUAL_NAMES[$i]}" "${QUAL_ARGS[$i]}" \
      "$QRC" "$(( SECONDS - S ))" "$WORK/q.out" "$WORK/q.err"
    [ "$QRC" = 0 ] || { say "qualify ${QUAL_NAMES[$i]}: rc=$QRC"; tail -5 "$WORK/q.err"; }
  done
else
  say "3. qualification: 'python -m eagle3_ops qualify' is not available in this tree (skipped, not counted)"
  "$PY" benchmarks/device_report.py qualify-unavailable "$RES/qualify.json" \
    "'python -m eagle3_ops qualify --help' failed: $(tail -1 "$WORK/qualify_help.txt" | cut -c1-200)"
fi

# ---- 4. benchmarks ---------------------------------------------------------------------------------
BENCH_RC=""
rm -f "$RES/bench.json"
if [ "$BENCH_SET" = skip ] || { [ "$DRY_RUN" = 1 ] && [ "${DRY_RUN_BENCH:-1}" = 0 ]; }; then
  say "4. benchmarks: skipped"
else
  T="$(budget "$BENCH_TIMEOUT" "$RESERVE_REPORT")"
  if [ "$T" -lt "$MIN_STAGE" ]; then
    say "4. benchmarks: SKIPPED, out of time budget"
    BENCH_RC=124
  else
    # draft_fc first: if the stage is cut short, the fc rows (the issue's headline) are in.
    say "4. benchmarks (EAGLE3_BENCH_SET=$BENCH_SET) (timeout ${T}s)"
    BENCH_CMD=(env EAGLE3_BENCH_JSON="$RES/bench.json" EAGLE3_BENCH_SET="$BENCH_SET" "$PY" -m pytest
               benchmarks/bench_draft_fc.py benchmarks/bench_capture.py -q -p no:cacheprovider)
    if [ "$DRY_RUN" = 1 ]; then
      echo "    DRY RUN, would run on the GPU (timeout ${T}s, SIGINT): ${BENCH_CMD[*]}"
      echo "    running it now on the CPU instead (smoke rows, marked smoke):"
      timeout -s INT -k 15 "$T" "${BENCH_CMD[@]}" > "$RES/bench.log" 2>&1
      BENCH_RC=$?
    else
      run_timed "$T" INT "$RES/bench.log" "${BENCH_CMD[@]}"
      BENCH_RC=$RC
    fi
    grep -E "passed|failed|error" "$RES/bench.log" | tail -3
    [ "$BENCH_RC" = 124 ] && say "benchmarks TIMED OUT after ${T}s (bench.json holds the rows measured)"
  fi
  # The host path (issue 21 item 5): each eager face against the backend function it runs, on the
  # backend this GPU serves (host work only; ~10 s). Appended to bench.log and printed; it never
  # changes the exit status. In a dry run it times the CPU's reference backend.
  HT="$(budget 60 "$RESERVE_REPORT")"
  if [ "$HT" -lt "$MIN_STAGE" ]; then
    say "4b. host path: SKIPPED, out of time budget"
  else
    say "4b. host path (timeout ${HT}s)"
    { echo; echo "== host path (benchmarks/bench_host_path.py)"; } >> "$RES/bench.log"
    EAGLE3_HOST_BENCH_ROUNDS=7 timeout -s INT -k 5 "$HT" "$PY" benchmarks/bench_host_path.py > "$WORK/host.txt" 2>&1
    say "host path rc=$?"
    cat "$WORK/host.txt" >> "$RES/bench.log"
    grep -vE "^\s*$" "$WORK/host.txt" | tail -12
  fi
fi

# ---- 5. report (last) ------------------------------------------------------------------------------
say "done in $(( SECONDS - T0 ))s"
REPORT=(report "$RES" --build "$BUILD" --arch "$TORCH_CUDA_ARCH_LIST" --tests-mode "$GPU_TESTS"
        --bench-set "$BENCH_SET" --elapsed "$(( SECONDS - T0 ))")
[ -n "$TESTS_RC" ] && REPORT+=(--tests-rc "$TESTS_RC")
[ -n "$BENCH_RC" ] && REPORT+=(--bench-rc "$BENCH_RC")
[ "$DRY_RUN" = 1 ] && REPORT+=(--dry-run)
"$PY" benchmarks/device_report.py "${REPORT[@]}"
exit $?
