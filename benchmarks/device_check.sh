#!/usr/bin/env bash
# Device check of eagle3_ops on a machine with one NVIDIA GPU (an H100 or an H200) and no network, in ONE short
# run: by design it ends within TOTAL_BUDGET (420 s, build included) on a 16-core H100, leaving room for a
# second try inside a 10-minute device call; QUICK=1 runs stages 1-4 only, within 240 s. The most valuable
# numbers come first and each stage writes what it has as it goes, so a cut keeps everything before it:
#   0. environment (GPU, driver, torch, triton, nvcc)                                   -> env.txt
#   1. build the CUDA extension for THIS card's arch only (9.0a on an H100 / H200), MAX_JOBS = the CPUs
#      (cap 16); build.log ends with the static model of the skinny fc for THIS card, read off it (a
#      PREDICTION printed next to the measurements)                                     -> build.log
#   2. correctness first: every GPU kernel at the seed's shapes against the float64 reference
#      (tests/ops/test_seed_shapes.py: Kimi-K2.5 H=7168 K=3 replicated and N/8 per rank, Llama-3.1-8B;
#      pytest -m "gpu and seed")                                                        -> seed_tests.{log,xml}
#   3. qualification at those shapes (python -m eagle3_ops qualify: kimi-k2.5, kimi-k2.5-tp8, llama-3.1-8b)
#                                                                                       -> qualify.json
#   4. the draft_fc timings at the seed's shapes: ours vs cuBLAS (F.linear of the gathered rows), one run,
#      CUDA events, L2 flushed cold, % of the read floor measured in the same run
#      (EAGLE3_BENCH_SET=seed benchmarks/bench_draft_fc.py; a row is written after each) -> bench.json
#   5. the capture timings (benchmarks/bench_capture.py, quick set)                    -> bench_capture.json
#   6. the rest of the gpu tests (pytest -m "gpu and not seed" tests)                   -> gpu_tests.{log,xml}
#   7. the host path (benchmarks/bench_host_path.py: each eager face against its backend function)
#                                                                                       -> host_path.txt
#   8. the speculation report's timing code on the GPU (benchmarks/bench_spec_report.py --device cuda: its host
#      cost per cycle; a GPU wait of known length timed as it times a verify phase)  -> spec_report_timing.txt
#   9. the report: the final table LAST (device, driver, torch; the decisive rows stock vs ours with the
#      qualification's verdict; PASS/FAIL per stage) -- the device tool returns the end of the output;
#      every table in full in summary.txt
# Everything goes to ONE results folder: $OUT/results-<UTC stamp> when OUT is set, else
# benchmarks/results/<UTC stamp>-<gpu name>/ (RESULTS_DIR overrides both); stages.tsv records each stage's
# status, seconds and cap as it ends. benchmarks/NOTES.md says what the first run must record.
#
# Time: every stage runs under `timeout` with min(its cap, what is left of TOTAL_BUDGET after the least the
# stages after it are guaranteed); a stage left with < 20 s is skipped and says so. pytest stages get SIGINT
# first (junit report and bench JSON still written), then KILL. Caps (s), as on a 16-core H100:
#   build 150 | seed tests 75 | qualify 40 each | fc timings 90 | capture timings 45 | gpu tests 180 | host 30 |
#   speculation report timing 20
# Test workers: half the CPUs, 1..8 (Triton compiles are CPU-bound; one GPU).
#
# Usage (from anywhere):
#   bash benchmarks/device_check.sh
#   QUICK=1 bash benchmarks/device_check.sh          # stages 1-4 only, within 240 s
#   DRY_RUN=1 bash benchmarks/device_check.sh        # CPU: print every stage's command and cap as on a 16-core
#                                                    # H100, touch no GPU, run the CPU smoke parts and the report
# Env:
#   PYTHON            interpreter (default python3)        OUT / RESULTS_DIR  where results go (above)
#   TOTAL_BUDGET      seconds for the whole script (420; QUICK=1: 240)
#   BUILD_TIMEOUT SEED_TIMEOUT QUALIFY_TIMEOUT FC_BENCH_TIMEOUT CAPTURE_BENCH_TIMEOUT TESTS_TIMEOUT HOST_TIMEOUT
#   SPEC_TIMEOUT: caps
#   GPU_TESTS         full | quick | skip: stage 6 (full)  TEST_WORKERS  xdist workers (half the CPUs, 1..8; 0 = none)
#   BENCH_SET         seed | skip: stages 4 and 5 (seed)   SKIP_BUILD=1  reuse the extension in the tree
#   MAX_JOBS          compile jobs (the CPUs, at most 16)
#   EAGLE3_WHEELS     a folder of wheels to install pytest / pytest-benchmark from, offline, if missing
#   DRY_RUN=1         see above; DRY_RUN_BENCH=0 / DRY_RUN_QUALIFY=0 skip even the CPU smoke benchmarks /
#                     the tiny CPU qualification it runs
# Needs: python with torch (CUDA) + triton + pytest, nvcc. Not needed: sglang, network.
# Exit status: 0 when every stage that ran passed (the report's verdict), else 1; 2 for bad settings.
set -uo pipefail
case "${1:-}" in  # the header above is the usage; nothing else runs
  -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
  "") ;;
  *) echo "usage: benchmarks/device_check.sh (no arguments; QUICK=1 / OUT=DIR in the environment; --help)" >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
DRY_RUN="${DRY_RUN:-0}"
QUICK="${QUICK:-0}"
case "$QUICK" in 0|1) ;; *) echo "device_check: QUICK must be 0 or 1 (got '$QUICK')" >&2; exit 2;; esac
if [ "$QUICK" = 1 ]; then TOTAL_BUDGET="${TOTAL_BUDGET:-240}"; else TOTAL_BUDGET="${TOTAL_BUDGET:-420}"; fi
BUILD_TIMEOUT="${BUILD_TIMEOUT:-150}"
SEED_TIMEOUT="${SEED_TIMEOUT:-75}"
QUALIFY_TIMEOUT="${QUALIFY_TIMEOUT:-40}"
FC_BENCH_TIMEOUT="${FC_BENCH_TIMEOUT:-90}"
CAPTURE_BENCH_TIMEOUT="${CAPTURE_BENCH_TIMEOUT:-45}"
TESTS_TIMEOUT="${TESTS_TIMEOUT:-180}"
HOST_TIMEOUT="${HOST_TIMEOUT:-30}"
SPEC_TIMEOUT="${SPEC_TIMEOUT:-20}"
GPU_TESTS="${GPU_TESTS:-full}"
BENCH_SET="${BENCH_SET:-seed}"
# The least each later stage is guaranteed (seconds), subtracted from what an earlier stage may use. The rest
# of the gpu tests and the host path get what is left: they come after every decisive number.
RESERVE_SEED=30
RESERVE_QUALIFY=20   # per qualification run
RESERVE_FC=45
RESERVE_CAPTURE=20
RESERVE_REPORT=10
MIN_STAGE=20
QUICK_TESTS_K="not float32 and (bfloat16 or not float16) and not torch_compile"
QUAL_NAMES=(kimi-k2.5 kimi-k2.5-tp8 llama-3.1-8b)
QUAL_ARGS=("--hidden 7168 --captures 3 --out-features 7168"
           "--hidden 7168 --captures 3 --out-features 7168 --tp 8"
           "--hidden 4096 --captures 3")

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
export PYTHONUNBUFFERED=1
T0=$SECONDS
say() { echo "[device_check $(( SECONDS - T0 ))s] $*"; }
die_usage() { echo "device_check: $*" >&2; exit 2; }
case "$GPU_TESTS" in full|quick|skip) ;; *) die_usage "GPU_TESTS must be full, quick or skip (got '$GPU_TESTS')";; esac
case "$BENCH_SET" in seed|skip) ;; *) die_usage "BENCH_SET must be seed or skip (got '$BENCH_SET')";; esac
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
# stage_done N NAME STATUS START CAP NOTE: one line of stages.tsv (what the report's last lines show)
stage_done() {
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(( SECONDS - $4 ))" "$5" "$6" >> "$RES/stages.tsv"
}
# status_of RC: PASS / TIMEOUT / FAIL (DRY in a dry run)
status_of() {
  if [ "$DRY_RUN" = 1 ]; then echo DRY; elif [ "$1" = 0 ]; then echo PASS;
  elif [ "$1" = 124 ] || [ "$1" = 130 ] || [ "$1" = 137 ]; then echo TIMEOUT; else echo FAIL; fi
}

if [ "$DRY_RUN" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""   # nothing below may touch a GPU
  say "DRY RUN: every stage's command and cap as on a 16-core H100; only CPU-safe parts run (a tiny CPU" \
      "qualification, CPU smoke benchmarks, the report)"
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
: > "$RES/stages.tsv"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/eagle3_device_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
say "results folder: $RES (budget ${TOTAL_BUDGET}s$([ "$QUICK" = 1 ] && echo ', QUICK=1: stages 1-4'))"

# ---- 0. environment --------------------------------------------------------------------------------
{
  echo "date: $(date -u +%FT%TZ)   budget: ${TOTAL_BUDGET}s   QUICK=$QUICK GPU_TESTS=$GPU_TESTS BENCH_SET=$BENCH_SET DRY_RUN=$DRY_RUN"
  echo "git: $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo 'no git')$(git -C "$ROOT" status --porcelain 2>/dev/null | head -c1 | sed 's/./ (uncommitted changes)/')"
  if [ "$DRY_RUN" != 1 ]; then
    nvidia-smi -L 2>&1 || true
    echo "nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>&1 | head -1)"
  fi
  "$PY" - <<'EOF' 2>&1
import sys, torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu visible:", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device:", p.name, "cc %d.%d" % (p.major, p.minor), p.multi_processor_count, "SMs, L2",
          getattr(p, "L2_cache_size", "?"), "B")
for name in ("triton", "numpy", "pytest", "xdist", "pytest_timeout", "pytest_benchmark", "sgl_kernel", "flashinfer"):
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
NPROC="$(nproc 2>/dev/null || echo 4)"
if [ "$DRY_RUN" = 1 ]; then CAP="9.0"; NPROC=16; fi   # show what a 16-core H100 runs
case "$CAP" in
  9.0|10.0|10.3|12.0|12.1) ARCH="${CAP}a" ;;  # arch-specific targets (what the package ships: 9.0a, 12.0a)
  *) ARCH="$CAP" ;;
esac
export TORCH_CUDA_ARCH_LIST="$ARCH"
export MAX_JOBS="${MAX_JOBS:-$(( NPROC < 16 ? NPROC : 16 ))}"
HALF=$(( NPROC / 2 )); [ "$HALF" -lt 1 ] && HALF=1; [ "$HALF" -gt 8 ] && HALF=8
TEST_WORKERS="${TEST_WORKERS:-$HALF}"
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
XDIST=()
if [ "$TEST_WORKERS" != 0 ] && { [ "$DRY_RUN" = 1 ] || "$PY" -c "import xdist" 2>/dev/null; }; then
  XDIST=(-n "$TEST_WORKERS")
fi
say "arch $ARCH, $NPROC CPUs: MAX_JOBS=$MAX_JOBS, test workers ${XDIST[*]:-none}"

# What the stages after stage N are guaranteed, in order (QUICK=1: stages 1-4 only).
if [ "$QUICK" = 1 ]; then AFTER_QUALIFY=$(( RESERVE_FC + RESERVE_REPORT )); else
  AFTER_QUALIFY=$(( RESERVE_FC + RESERVE_CAPTURE + RESERVE_REPORT )); fi
AFTER_SEED=$(( ${#QUAL_NAMES[@]} * RESERVE_QUALIFY + AFTER_QUALIFY ))
AFTER_BUILD=$(( RESERVE_SEED + AFTER_SEED ))

# ---- 1. build --------------------------------------------------------------------------------------
BUILD="FAILED"
S=$SECONDS
T="$(budget "$BUILD_TIMEOUT" "$AFTER_BUILD")"
if [ "${SKIP_BUILD:-0}" = "1" ]; then
  say "1. build: SKIP_BUILD=1, using the extension already in the tree"
  BUILD="skipped"
elif [ "$T" -lt "$MIN_STAGE" ]; then
  say "1. build: SKIPPED, out of time budget (TOTAL_BUDGET=${TOTAL_BUDGET}s is too small)"
  echo "skipped: out of time budget" > "$RES/build.log"
else
  say "1. build eagle3_ops._C for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS (cap ${T}s)"
  run_timed "$T" TERM "$RES/build.log" "$PY" setup.py build_ext --inplace
  [ "$DRY_RUN" = 1 ] && echo "(dry run: no build)" > "$RES/build.log"
  [ "$RC" = 124 ] && say "build TIMED OUT after ${T}s"
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
# the static model of the skinny fc for THIS card, from the cubins just built (a prediction)
if [ "$DRY_RUN" = 1 ]; then
  echo "    DRY RUN, would run (timeout 60s): $PY benchmarks/static_model.py --detail --device auto (>> build.log)"
elif [ "$BUILD" != FAILED ]; then
  { echo; echo "---- benchmarks/static_model.py --detail --device auto (PREDICTION for this card, from these cubins) ----"
    timeout 60 "$PY" benchmarks/static_model.py --detail --device auto 2>&1; } >> "$RES/build.log" || true
fi
grep "eagle3_ops build:" "$RES/build.log" 2>/dev/null | tail -3
case "$BUILD" in
  ok|skipped) say "extension: $BUILD"; stage_done 1 "build ($ARCH)" PASS "$S" "$T" "$BUILD" ;;
  dry-run) stage_done 1 "build ($ARCH)" DRY "$S" "$T" "" ;;
  *) say "BUILD FAILED: extension not importable"; tail -30 "$RES/build.log"
     stage_done 1 "build ($ARCH)" FAIL "$S" "$T" "extension not importable (build.log)" ;;
esac

# ---- 2. correctness at the seed's shapes -----------------------------------------------------------
S=$SECONDS
T="$(budget "$SEED_TIMEOUT" "$AFTER_SEED")"
ARGS=(-m pytest -m "gpu and seed" tests/ops/test_seed_shapes.py -q -ra -p no:cacheprovider
      --junitxml="$RES/seed_tests.xml" "${XDIST[@]}")
if [ "$T" -lt "$MIN_STAGE" ]; then
  say "2. seed correctness: SKIPPED, out of time budget"
  stage_done 2 "correctness at the seed's shapes" SKIPPED "$S" "$T" "out of time budget"
else
  say "2. correctness of every GPU kernel at the seed's shapes vs float64 (cap ${T}s)"
  run_timed "$T" INT "$RES/seed_tests.log" "$PY" "${ARGS[@]}"
  [ "$DRY_RUN" = 1 ] || tail -5 "$RES/seed_tests.log"
  stage_done 2 "correctness at the seed's shapes" "$(status_of "$RC")" "$S" "$T" "seed_tests.xml"
fi

# ---- 3. qualification ------------------------------------------------------------------------------
rm -f "$RES/qualify.json"
S=$SECONDS
QUAL_STATUS=PASS
if "$PY" -m eagle3_ops qualify --help > "$WORK/qualify_help.txt" 2>&1; then
  NOCACHE=()
  grep -q -- "--no-cache" "$WORK/qualify_help.txt" && NOCACHE=(--no-cache)
  [ "$DRY_RUN" = 1 ] && say "3. qualification at the seed's shapes (cap ${QUALIFY_TIMEOUT}s each)"
  for i in "${!QUAL_NAMES[@]}"; do
    left=$(( ${#QUAL_NAMES[@]} - i - 1 ))
    T="$(budget "$QUALIFY_TIMEOUT" $(( left * RESERVE_QUALIFY + AFTER_QUALIFY )))"
    read -r -a A <<< "${QUAL_ARGS[$i]}"
    if [ "$DRY_RUN" = 1 ]; then
      echo "    DRY RUN, would run (timeout ${T}s, SIGINT): $PY -m eagle3_ops qualify ${QUAL_ARGS[$i]} --json ${NOCACHE[*]}"
      continue
    fi
    if [ "$T" -lt "$MIN_STAGE" ]; then
      say "3. qualify ${QUAL_NAMES[$i]}: SKIPPED, out of time budget"
      echo "skipped: out of time budget" > "$WORK/q.err"; : > "$WORK/q.out"
      "$PY" benchmarks/device_report.py qualify-merge "$RES/qualify.json" "${QUAL_NAMES[$i]}" "${QUAL_ARGS[$i]}" 124 0 "$WORK/q.out" "$WORK/q.err"
      QUAL_STATUS=SKIPPED
      continue
    fi
    say "3. qualify ${QUAL_NAMES[$i]}: ${QUAL_ARGS[$i]} (cap ${T}s)"
    Q0=$SECONDS
    timeout -s INT -k 10 "$T" "$PY" -m eagle3_ops qualify "${A[@]}" --json "${NOCACHE[@]}" > "$WORK/q.out" 2> "$WORK/q.err"
    QRC=$?
    "$PY" benchmarks/device_report.py qualify-merge "$RES/qualify.json" "${QUAL_NAMES[$i]}" "${QUAL_ARGS[$i]}" \
      "$QRC" "$(( SECONDS - Q0 ))" "$WORK/q.out" "$WORK/q.err"
    if [ "$QRC" != 0 ]; then say "qualify ${QUAL_NAMES[$i]}: rc=$QRC"; tail -5 "$WORK/q.err"; QUAL_STATUS="$(status_of "$QRC")"; fi
  done
  if [ "$DRY_RUN" = 1 ] && [ "${DRY_RUN_QUALIFY:-1}" != 0 ]; then
    # the real shapes would run the Triton interpreter at H=7168: run one tiny shape on the CPU instead
    say "3. (dry run) a tiny CPU qualification instead: --hidden 64 --captures 3 --rows 1,4 --reps 1"
    Q0=$SECONDS
    timeout -s INT -k 10 120 "$PY" -m eagle3_ops qualify --hidden 64 --captures 3 --rows 1,4 --reps 1 --json \
      "${NOCACHE[@]}" > "$WORK/q.out" 2> "$WORK/q.err"
    "$PY" benchmarks/device_report.py qualify-merge "$RES/qualify.json" tiny-cpu-dry-run \
      "--hidden 64 --captures 3 --rows 1,4 --reps 1" "$?" "$(( SECONDS - Q0 ))" "$WORK/q.out" "$WORK/q.err"
  fi
  [ "$DRY_RUN" = 1 ] && QUAL_STATUS=DRY
  stage_done 3 "qualification at the seed's shapes" "$QUAL_STATUS" "$S" "$(( ${#QUAL_NAMES[@]} * QUALIFY_TIMEOUT ))" "qualify.json"
else
  say "3. qualification: 'python -m eagle3_ops qualify' is not available in this tree (skipped, not counted)"
  "$PY" benchmarks/device_report.py qualify-unavailable "$RES/qualify.json" \
    "'python -m eagle3_ops qualify --help' failed: $(tail -1 "$WORK/qualify_help.txt" | cut -c1-200)"
  stage_done 3 "qualification at the seed's shapes" SKIPPED "$S" 0 "python -m eagle3_ops qualify unavailable"
fi

# ---- 4, 5. timings ---------------------------------------------------------------------------------
# bench STAGE NAME JSON CAP RESERVE FILE: one benchmark file, its rows written to JSON after each one
bench() {
  local n=$1 name=$2 json=$3 cap=$4 reserve=$5 file=$6 t s=$SECONDS
  rm -f "$RES/$json"
  if [ "$BENCH_SET" = skip ]; then
    say "$n. $name: skipped (BENCH_SET=skip)"; stage_done "$n" "$name" SKIPPED "$s" 0 "BENCH_SET=skip"; return
  fi
  t="$(budget "$cap" "$reserve")"
  if [ "$t" -lt "$MIN_STAGE" ]; then
    say "$n. $name: SKIPPED, out of time budget"; stage_done "$n" "$name" SKIPPED "$s" "$t" "out of time budget"; return
  fi
  local cmd=(env EAGLE3_BENCH_JSON="$RES/$json" EAGLE3_BENCH_SET=seed "$PY" -m pytest "$file" -q -p no:cacheprovider)
  say "$n. $name (cap ${t}s)"
  if [ "$DRY_RUN" = 1 ]; then
    echo "    DRY RUN, would run on the GPU (timeout ${t}s, SIGINT): ${cmd[*]}"
    if [ "${DRY_RUN_BENCH:-1}" = 0 ]; then
      echo "    (DRY_RUN_BENCH=0: no CPU smoke run)"; stage_done "$n" "$name" DRY "$s" "$t" ""; return
    fi
    echo "    running it now on the CPU instead (smoke rows, marked smoke):"
    timeout -s INT -k 15 "$t" "${cmd[@]}" > "$WORK/bench.log" 2>&1
    RC=$?
  else
    timeout -s INT -k 15 "$t" "${cmd[@]}" > "$WORK/bench.log" 2>&1
    RC=$?
  fi
  { echo "== $name ($file)"; cat "$WORK/bench.log"; } >> "$RES/bench.log"
  grep -E "passed|failed|error" "$WORK/bench.log" | tail -2
  [ "$RC" = 124 ] && say "$name TIMED OUT after ${t}s ($json holds the rows measured)"
  local st; st="$(status_of "$RC")"; [ "$DRY_RUN" = 1 ] && { [ "$RC" = 0 ] && st=DRY || st=FAIL; }
  stage_done "$n" "$name" "$st" "$s" "$t" "$json"
}
: > "$RES/bench.log"
if [ "$QUICK" = 1 ]; then CAPTURE_RESERVE=0; else CAPTURE_RESERVE=$RESERVE_CAPTURE; fi
bench 4 "draft_fc timings at the seed's shapes" bench.json "$FC_BENCH_TIMEOUT" $(( CAPTURE_RESERVE + RESERVE_REPORT )) \
  benchmarks/bench_draft_fc.py

if [ "$QUICK" != 1 ]; then
  bench 5 "capture timings" bench_capture.json "$CAPTURE_BENCH_TIMEOUT" "$RESERVE_REPORT" benchmarks/bench_capture.py

  # ---- 6. the rest of the gpu tests --------------------------------------------------------------
  S=$SECONDS
  if [ "$GPU_TESTS" = skip ]; then
    say "6. the rest of the gpu tests: skipped (GPU_TESTS=skip)"
    stage_done 6 "the rest of the gpu tests" SKIPPED "$S" 0 "GPU_TESTS=skip"
  else
    T="$(budget "$TESTS_TIMEOUT" "$RESERVE_REPORT")"
    ARGS=(-m pytest -m "gpu and not seed" tests -q -ra -p no:cacheprovider --continue-on-collection-errors
          --junitxml="$RES/gpu_tests.xml" "${XDIST[@]}")
    [ "$GPU_TESTS" = quick ] && ARGS+=(-k "$QUICK_TESTS_K")
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then ARGS+=(--timeout=120); fi
    if [ "$T" -lt "$MIN_STAGE" ]; then
      say "6. the rest of the gpu tests: SKIPPED, out of time budget (${T}s left)"
      stage_done 6 "the rest of the gpu tests" SKIPPED "$S" "$T" "out of time budget"
    else
      say "6. the rest of the gpu tests ($GPU_TESTS) (cap ${T}s)"
      run_timed "$T" INT "$RES/gpu_tests.log" "$PY" "${ARGS[@]}"
      [ "$DRY_RUN" = 1 ] || tail -8 "$RES/gpu_tests.log"
      [ "$RC" = 124 ] && say "gpu tests TIMED OUT after ${T}s (the junit report holds the cases that ran)"
      stage_done 6 "the rest of the gpu tests" "$(status_of "$RC")" "$S" "$T" "gpu_tests.xml"
    fi
  fi

  # ---- 7. host path --------------------------------------------------------------------------------
  # each eager face against the backend function it runs, on the backend this GPU serves (host work only;
  # ~10 s); never decisive. In a dry run it times the CPU's reference backend.
  S=$SECONDS
  T="$(budget "$HOST_TIMEOUT" "$RESERVE_REPORT")"
  if [ "$T" -lt "$MIN_STAGE" ]; then
    say "7. host path: SKIPPED, out of time budget"
    stage_done 7 "host path" SKIPPED "$S" "$T" "out of time budget"
  else
    say "7. host path (cap ${T}s)"
    EAGLE3_HOST_BENCH_ROUNDS=7 timeout -s INT -k 5 "$T" "$PY" benchmarks/bench_host_path.py > "$RES/host_path.txt" 2>&1
    RC=$?
    grep -vE "^\s*$" "$RES/host_path.txt" | tail -6
    ST="$(status_of "$RC")"; [ "$DRY_RUN" = 1 ] && { [ "$RC" = 0 ] && ST=DRY || ST=FAIL; }
    stage_done 7 "host path" "$ST" "$S" "$T" "host_path.txt"
  fi

  # ---- 8. the speculation report's timing code -----------------------------------------------------------
  # the SGLang plugin's speculation report times one decode cycle in 64 with CUDA events read once complete; here
  # that code alone (no SGLang): its host cost per cycle, and a GPU wait of known length timed as a verify phase
  # against CUDA events recorded around it (~5 s). In a dry run: the host-clock marks on the CPU.
  S=$SECONDS
  T="$(budget "$SPEC_TIMEOUT" "$RESERVE_REPORT")"
  if [ "$T" -lt "$MIN_STAGE" ]; then
    say "8. speculation report timing: SKIPPED, out of time budget"
    stage_done 8 "speculation report timing" SKIPPED "$S" "$T" "out of time budget"
  else
    say "8. speculation report timing (cap ${T}s)"
    SPEC_DEVICE=cuda; [ "$DRY_RUN" = 1 ] && SPEC_DEVICE=cpu
    EAGLE3_HOST_BENCH_ROUNDS=5 timeout -s INT -k 5 "$T" "$PY" benchmarks/bench_spec_report.py --device "$SPEC_DEVICE" \
      > "$RES/spec_report_timing.txt" 2>&1
    RC=$?
    grep -vE "^\s*$" "$RES/spec_report_timing.txt" | tail -6
    ST="$(status_of "$RC")"; [ "$DRY_RUN" = 1 ] && { [ "$RC" = 0 ] && ST=DRY || ST=FAIL; }
    stage_done 8 "speculation report timing" "$ST" "$S" "$T" "spec_report_timing.txt"
  fi
fi

# ---- 9. report (last) ------------------------------------------------------------------------------
say "done in $(( SECONDS - T0 ))s"
REPORT=(report "$RES" --build "$BUILD" --arch "$TORCH_CUDA_ARCH_LIST" --elapsed "$(( SECONDS - T0 ))"
        --budget "$TOTAL_BUDGET")
[ "$DRY_RUN" = 1 ] && REPORT+=(--dry-run)
[ "$QUICK" = 1 ] && REPORT+=(--quick)
"$PY" benchmarks/device_report.py "${REPORT[@]}"
exit $?
