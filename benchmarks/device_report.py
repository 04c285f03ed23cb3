"""Tables of a ``benchmarks/device_check.sh`` run (no torch import: runs anywhere, in a second).

    python benchmarks/device_report.py report RESULTS_DIR [--build ok|FAILED|skipped] [--arch A]
        [--tests-rc N] [--tests-mode full|quick|skip] [--bench-rc N] [--bench-set S] [--elapsed S]
        [--dry-run]
    python benchmarks/device_report.py qualify-merge QUALIFY_JSON NAME ARGS RC SECONDS STDOUT STDERR
    python benchmarks/device_report.py qualify-unavailable QUALIFY_JSON REASON

``report`` reads RESULTS_DIR/{gpu_tests.xml, qualify.json, bench.json}, writes the complete tables
to RESULTS_DIR/summary.txt and prints the short version (verdict, qualification tables, a short
benchmark table) — the device tool returns only the last 12,000 characters of output.
``qualify-merge`` appends one ``python -m eagle3_ops qualify --json`` run (its stdout parsed as
JSON, or kept as text when it is not JSON) to QUALIFY_JSON: ``{"available": true, "runs": [{"name",
"args", "rc", "seconds", "result", "stdout_tail", "stderr_tail"}]}``.
Exit status of ``report``: 0 when the verdict is PASS, else 1.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import xml.etree.ElementTree as ET
from typing import List, Optional

SHORT_BENCH_ROWS = 40  # key rows printed on stdout (all rows are in summary.txt)
KEY_H = 7168           # the Kimi-K2.5 / DeepSeek-V3 hidden size: key rows are at this H
# bench -> the sizes (M or T) of its key rows at H = KEY_H; draft_fc_rows_tp = N != H (sharded fc)
KEY_SIZES = {"draft_fc_rows": {1, 16, 64, 256, 4096}, "draft_fc_rows_tp": {1, 64},
             "draft_fc_chunk_norm": {1, 64}, "draft_fc_chunk_norm_folded": {1, 64}, "capture3_llama": {1, 8192}, "capture3_packer": {8192},
             "fused_add_rmsnorm_capture": {1, 8192}}


# Short names on stdout (summary.txt keeps the full ones).
ABBREV = {"draft_fc_rows": "fc_rows", "draft_fc_chunk_norm": "fc_chunk_norm",
          "draft_fc_chunk_norm_folded": "fc_norm_folded", "draft_fc_paths": "fc_paths",
          "capture3_llama": "cap3_llama", "capture3_packer": "cap3_packer",
          "fused_add_rmsnorm_capture": "fused_norm_cap"}


def _short(name, full: bool):
    return name if full else ABBREV.get(name, name)


def _short_shape(shape, full: bool):
    return shape if full or not shape else shape.replace(",K=3", "")


# ---- small helpers ---------------------------------------------------------------------------------
def _load_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:.0f}"
        return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def _table(headers: List[str], rows: List[list]) -> List[str]:
    cells = [[_fmt(v) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) if i < 3 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
    for r in cells:
        out.append("  ".join(v.ljust(w) if i < 3 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
    return out


def _shape(s: str) -> dict:
    out = {}
    for part in (s or "").split(","):
        if "=" in part:
            k, v = part.split("=", 1)
            try:
                out[k.strip()] = int(v)
            except ValueError:
                out[k.strip()] = v
    return out


# ---- gpu tests -------------------------------------------------------------------------------------
def junit_summary(path: str) -> dict:
    """Counts of a junit report (pytest --junitxml), failing test names, and modules that could not
    be imported on this machine (collection errors: e.g. needing sglang)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        return {"ok": False, "text": f"no junit report ({type(e).__name__})"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed, unimportable = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        err = case.find("error")
        if err is not None and err.get("message") == "collection failure":
            unimportable.append(name)
        elif case.find("failure") is not None or err is not None:
            failed.append(name)
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    text = f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped"
    ok = counts["failures"] == 0 and counts["errors"] == len(unimportable) and passed > 0
    return {"ok": ok, "text": text, "passed": passed, "failed": failed, "unimportable": unimportable, **counts}


# ---- qualification ---------------------------------------------------------------------------------
def qualify_merge(path: str, name: str, args: str, rc: int, seconds: float, stdout_path: str,
                  stderr_path: str) -> None:
    data = _load_json(path) or {"available": True, "runs": []}
    out = _tail(stdout_path, 1 << 20)
    try:
        result = json.loads(out) if out.strip() else None
    except ValueError:
        result = None
    data["runs"].append({"name": name, "args": args, "rc": rc, "seconds": round(seconds, 1), "result": result,
                         "stdout_tail": None if result is not None else out[-3000:],
                         "stderr_tail": _tail(stderr_path, 3000)})
    _write_json(path, data)


def qualify_unavailable(path: str, reason: str) -> None:
    _write_json(path, {"available": False, "reason": reason, "runs": []})


def _write_json(path: str, data) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _rc_text(rc) -> str:
    if rc is None:
        return "not run"
    rc = int(rc)
    return "ok" if rc == 0 else ("TIMED OUT" if rc in (124, 130, 137) else f"FAILED (rc={rc})")


def qualify_lines(data, full: bool) -> List[str]:
    if data is None:
        return ["qualification: not run (no qualify.json)"]
    if not data.get("available", True):
        return [f"qualification: not available here ({data.get('reason', 'unknown')})"]
    lines = []
    for run in data.get("runs", []):
        res = run.get("result")
        head = f"qualification [{run['name']}] {run['args']}: {_rc_text(run['rc'])}, {run['seconds']} s"
        if not isinstance(res, dict):
            lines.append(head + " — no JSON result; stderr tail:")
            err = (run.get("stderr_tail") or run.get("stdout_tail") or "").strip().splitlines()
            lines += ["    " + ln[:200] for ln in err[-(20 if full else 4):]]
            continue
        lines.append(head + f" — device {res.get('device')}")
        rows, stocks = [], {}
        for c in res.get("choices", []):
            serves = "stock" if c.get("backend") is None else f"{c.get('backend')}/{c.get('path') or '-'}"
            med, stock = c.get("median_us"), c.get("stock_us")
            x = stock / med if (med and stock) else None
            err = c.get("max_rel_err")
            row = [_short(c.get("op"), full), c.get("rows"), serves, "-" if err is None else f"{err:.1e}", med, stock,
                   None if x is None else round(x, 2)]
            if full:
                row.append(c.get("stock") or "")
            else:
                stocks.setdefault(_short(c.get("op"), full), c.get("stock") or "?")
            rows.append(row)
        headers = ["op", "rows", "serves", "max_rel_err", "us", "stock_us", "x"] + (["stock ran"] if full else [])
        lines += ["  " + ln for ln in _table(headers, rows)]
        if stocks:
            lines.append(("  stock ran: " + "; ".join(f"{op}: {st}" for op, st in stocks.items()))[:160])
        rej = res.get("rejected", [])
        if rej:
            lines.append(f"  rejected: {len(rej)} candidate(s)" + ("" if full else " (first 2; all in summary.txt)"))
            for r in rej if full else rej[:2]:
                lines.append(f"    {_short(r.get('op'), full)} rows={r.get('rows')} {r.get('backend')}/"
                             f"{r.get('path') or '-'}: {str(r.get('reason'))[:(300 if full else 90)]}")
    return lines or ["qualification: no runs recorded"]


def qualify_ok(data) -> Optional[bool]:
    """None when qualification is unavailable here (not counted), else whether every run succeeded."""
    if data is None or not data.get("available", True):
        return None
    runs = data.get("runs", [])
    return bool(runs) and all(int(r["rc"]) == 0 and isinstance(r.get("result"), dict) for r in runs)


# ---- benchmarks ------------------------------------------------------------------------------------
def _ours(r: dict) -> str:
    path = r.get("path")
    label = r.get("ours") or "?"
    if path and path not in label and not str(path).startswith("reference"):
        label += f"/{path}"
    return label


def bench_meta_lines(meta: dict) -> List[str]:
    flush = meta.get("l2_flush")
    flush_text = f"{flush.get('bytes', 0) >> 20} MiB read" if isinstance(flush, dict) else str(flush)
    gpu = (f" (cc {meta.get('capability')}, {meta.get('sm_count')} SMs, L2 {(meta.get('l2_bytes') or 0) >> 20} MiB)"
           if meta.get("capability") else "")
    lines = [f"device: {meta.get('device')}{gpu}   torch {meta.get('torch')} (CUDA {meta.get('torch_cuda')}), "
             f"triton {meta.get('triton')}",
             f"measured here: read {meta.get('read_bw_GBps')} GB/s ({meta.get('read_method')}), copy "
             f"{meta.get('copy_bw_GBps')} GB/s (read+write), gemm {meta.get('gemm_TFLOPs')} TFLOP/s; "
             f"L2 flush: {flush_text}",
             f"default backends: {meta.get('backends')}   stock kernel packages: {meta.get('stock_kernels')}"]
    if meta.get("smoke"):
        lines.insert(0, "SMOKE RUN ON THE CPU: these numbers say nothing about GPU kernels")
    return lines


def bench_summary_lines(rows: List[dict], full: bool) -> List[str]:
    """One line per (bench, ours): median and range of %floor and of the speedups over stock."""
    groups = {}
    for r in rows:
        groups.setdefault((r.get("bench"), r.get("ours")), []).append(r)

    def stat(vals):
        vals = [v for v in vals if v is not None]
        if not vals:
            return "-"
        return f"{statistics.median(vals):.3g} ({min(vals):.3g}-{max(vals):.3g})"

    table = []
    for (bench, ours), rs in groups.items():
        table.append([_short(bench, full), ours, len(rs), stat([r.get("%floor") for r in rs]),
                      stat([r.get("speedup") for r in rs]), stat([r.get("speedup_graph") for r in rs]),
                      sum(1 for r in rs if r.get("graph_error"))])
    return _table(["bench", "ours", "rows", "%floor med (min-max)", "x eager", "x graph", "graph err"], table)


BENCH_COLS = ["bench", "shape", "ours", "us", "graph", "stock", "stock_g", "x", "x_g", "floor", "%floor"]


def _bench_row(r: dict, full: bool) -> list:
    return [_short(r.get("bench"), full), _short_shape(r.get("shape"), full), _ours(r), r.get("ours_us"),
            r.get("ours_graph_us"), r.get("stock_us"), r.get("stock_graph_us"), r.get("speedup"),
            r.get("speedup_graph"), r.get("floor_us"), r.get("%floor")]


def key_rows(rows: List[dict]) -> List[dict]:
    """The rows printed on stdout: H = 7168 (Kimi-K2.5) at a few sizes; every row of a smoke run."""
    picked = []
    for r in rows:
        if r.get("smoke"):
            picked.append(r)
            continue
        s = _shape(r.get("shape"))
        if s.get("H") != KEY_H:
            continue  # draft_fc_paths is not in KEY_SIZES: it sets the crossover, summary.txt has it
        bench = r.get("bench", "")
        if bench == "draft_fc_rows" and s.get("N", KEY_H) != KEY_H:
            bench = "draft_fc_rows_tp"
        if s.get("M", s.get("T")) in KEY_SIZES.get(bench, ()):
            picked.append(r)
    return picked[:SHORT_BENCH_ROWS]


def stock_lines(rows: List[dict], full: bool) -> List[str]:
    seen = {}
    for r in rows:
        key = (r.get("bench"), r.get("stock_impl"))
        if key not in seen:
            seen[key] = r.get("stock_note")
    out = []
    for (bench, impl), note in seen.items():
        text = f"  {_short(bench, full)}: {impl}" + (f" — {note}" if note else "")
        out.append(text if full else text[:150])
    return out


def bench_lines(data, full: bool) -> List[str]:
    if data is None:
        return ["benchmarks: no rows (bench.json missing)"]
    meta, rows = data.get("meta", {}), data.get("rows", [])
    lines = bench_meta_lines(meta)
    lines.append(f"{len(rows)} rows. µs: eager device time (us), CUDA-graph replay (graph), stock eager (stock) and "
                 "replay (stock_g); x = stock/ours; floor = bytes / measured read (fc) or copy (capture) bandwidth, "
                 "or FLOPs / gemm rate; %floor = floor/us.")
    lines += bench_summary_lines(rows, full)
    errors = sorted({r["graph_error"] for r in rows if r.get("graph_error")})
    if errors:
        lines.append("graph capture errors: " + " | ".join(e[:160] for e in (errors if full else errors[:3])))
    lines.append("what the stock side ran:")
    lines += stock_lines(rows, full)
    chosen = rows if full else key_rows(rows)
    lines.append("all rows:" if full else f"key rows (H={KEY_H}; every row is in summary.txt and bench.json):")
    table_rows = [_bench_row(r, full) for r in chosen]
    if full:
        cols = BENCH_COLS + ["host", "stock_h", "GB/s", "%bw", "bw", "backend", "path_table", "splits"]
        table_rows = [b + [r.get("ours_host_us"), r.get("stock_host_us"), r.get("GB/s"), r.get("%bw"), r.get("bw"),
                           r.get("backend"), r.get("path_table"), r.get("splits_per_chunk")]
                      for b, r in zip(table_rows, chosen)]
        lines += _table(cols, table_rows)
    else:
        lines += _table(BENCH_COLS, table_rows)
    return lines


# ---- report ----------------------------------------------------------------------------------------
def report(args) -> int:
    res = args.results
    tests = None if args.tests_mode == "skip" or args.dry_run else junit_summary(os.path.join(res, "gpu_tests.xml"))
    qual = _load_json(os.path.join(res, "qualify.json"))
    bench = _load_json(os.path.join(res, "bench.json"))
    q_ok = qualify_ok(qual)
    build_ok = args.build in ("ok", "skipped")
    tests_ok = tests is None or (tests["ok"] and args.tests_rc in (0, 1))
    bench_ok = args.bench_rc == 0 and bench is not None and bool(bench.get("rows"))
    verdict = build_ok and tests_ok and q_ok is not False and bench_ok and not args.dry_run
    status = [
        "=" * 100,
        f"eagle3_ops device check: {'DRY RUN (nothing ran on a GPU)' if args.dry_run else ('PASS' if verdict else 'FAIL')}"
        f"   {args.elapsed}s   results: {res}",
        f"  build ({args.arch}): {args.build}",
        f"  gpu tests: {'not run (dry run)' if args.dry_run else 'skipped'}" if tests is None else
        f"  gpu tests ({args.tests_mode}): {'ok' if tests_ok else _rc_text(args.tests_rc) if args.tests_rc not in (0, 1) else 'FAILED'}"
        f" [{tests['text']}]",
        f"  qualification: {'not available here' if q_ok is None else ('ok' if q_ok else 'FAILED or incomplete')}",
        f"  benchmarks ({args.bench_set}): {_rc_text(args.bench_rc) if args.bench_rc is not None else 'not run'}"
        f" [{len(bench.get('rows', [])) if bench else 0} rows]",
    ]
    if tests and tests.get("unimportable"):
        status.append("  test modules not importable here (not counted as failures): "
                      + ", ".join(tests["unimportable"]))
    failed_full, failed_short = [], []
    if tests and tests.get("failed"):
        failed_full = ["failing gpu tests:"] + ["  " + n for n in tests["failed"]]
        failed_short = [f"failing gpu tests ({len(tests['failed'])}; all in summary.txt):"] + \
                       ["  " + n for n in tests["failed"][:10]]
    full = status + failed_full + [""] + qualify_lines(qual, True) + [""] + bench_lines(bench, True)
    short = status + failed_short + [""] + qualify_lines(qual, False) + [""] + bench_lines(bench, False) + [status[1]]
    with open(os.path.join(res, "summary.txt"), "w") as f:
        f.write("\n".join(full) + "\n")
    print("\n".join(short))
    if args.dry_run:  # what a dry run could run (CPU smoke benchmarks, a tiny qualification) succeeded
        return 0 if q_ok is not False and (args.bench_rc in (None, 0)) else 1
    return 0 if verdict else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report")
    r.add_argument("results")
    r.add_argument("--build", default="ok")
    r.add_argument("--arch", default="?")
    r.add_argument("--tests-rc", type=int, default=None)
    r.add_argument("--tests-mode", default="full")
    r.add_argument("--bench-rc", type=int, default=None)
    r.add_argument("--bench-set", default="full")
    r.add_argument("--elapsed", default="?")
    r.add_argument("--dry-run", action="store_true")
    m = sub.add_parser("qualify-merge")
    for name in ("path", "name", "args"):
        m.add_argument(name)
    m.add_argument("rc", type=int)
    m.add_argument("seconds", type=float)
    m.add_argument("stdout")
    m.add_argument("stderr")
    u = sub.add_parser("qualify-unavailable")
    u.add_argument("path")
    u.add_argument("reason")
    args = ap.parse_args(argv)
    if args.cmd == "report":
        return report(args)
    if args.cmd == "qualify-merge":
        qualify_merge(args.path, args.name, args.args, args.rc, args.seconds, args.stdout, args.stderr)
        return 0
    qualify_unavailable(args.path, args.reason)
    return 0


if __name__ == "__main__":
    sys.exit(main())
