"""Tables of a ``benchmarks/device_check.sh`` run (no torch import: runs anywhere, in a second).

    python benchmarks/device_report.py report RESULTS_DIR [--build ok|FAILED|skipped|dry-run] [--arch A]
        [--elapsed S] [--budget S] [--dry-run] [--quick]
    python benchmarks/device_report.py qualify-merge QUALIFY_JSON NAME ARGS RC SECONDS STDOUT STDERR
    python benchmarks/device_report.py qualify-unavailable QUALIFY_JSON REASON

``report`` reads RESULTS_DIR/{stages.tsv, env.txt, seed_tests.xml, qualify.json, bench.json,
bench_capture.json, gpu_tests.xml, host_path.txt}, writes the complete tables to RESULTS_DIR/summary.txt and
prints the short version, ending with the final table (device, driver, torch; the decisive rows stock vs ours
with qualification's verdict; PASS/FAIL per stage) and the verdict line — the device tool returns only the
last 12,000 characters of output.
``qualify-merge`` appends one ``python -m eagle3_ops qualify --json`` run (its stdout parsed as
JSON, or kept as text when it is not JSON) to QUALIFY_JSON: ``{"available": true, "runs": [{"name",
"args", "rc", "seconds", "result", "stdout_tail", "stderr_tail"}]}``.
Exit status of ``report``: 0 when the verdict is PASS (every stage that ran passed, none cut by the budget),
else 1; a dry run: 0 when its CPU parts ran.
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
             "draft_fc_chunk_norm": {1, 64}, "draft_fc_chunk_norm_folded": {1, 64}, "capture3_llama": {1, 8192},
             "capture3_packer": {8192},
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


# ---- the final table -------------------------------------------------------------------------------
# The decisive rows: the seed user's draft fc (Kimi-K2.5 replicated and at TP = 8) and Llama-3.1-8B's, at a decode
# token, a verify batch and the largest M of the seed set; the target-side captures at Kimi-K2.5's H.
MODELS = (("kimi-k2.5", 7168, 7168), ("kimi-k2.5-tp8", 7168, 896), ("llama-3.1-8b", 4096, 4096))
DECISIVE_M = (1, 16, 64)
DECISIVE_T = (1, 2048)
STAGE_OK = ("PASS", "DRY")


def read_stages(path: str) -> List[dict]:
    """stages.tsv (device_check.sh: one line per stage as it ends): number, name, status, seconds, cap, note."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) >= 6:
                    out.append({"n": parts[0], "name": parts[1], "status": parts[2], "seconds": parts[3],
                                "cap": parts[4], "note": parts[5]})
    except OSError:
        pass
    return out


def env_facts(path: str) -> dict:
    """Device, driver and software from env.txt (nvidia-smi's line, torch's and triton's)."""
    facts = {}
    for line in _tail(path, 1 << 16).splitlines():
        if line.startswith("nvidia-smi: ") and "," in line:
            fields = [f.strip() for f in line[len("nvidia-smi: "):].split(",")]
            facts["gpu"], facts["driver"] = fields[0], fields[1] if len(fields) > 1 else "?"
        elif line.startswith("torch "):
            words = line.split()
            facts["torch"] = words[1]
            facts["torch_cuda"] = words[3] if len(words) > 3 else "?"
        elif line.startswith("device: "):
            facts["device"] = line[len("device: "):]
        elif line.split(" ", 1)[0] in ("triton", "numpy") and "not importable" not in line:
            facts[line.split(" ", 1)[0]] = line.split(" ", 1)[1].strip()
    return facts


def _qualify_run(qual, name: str) -> Optional[dict]:
    for run in (qual or {}).get("runs", []):
        if run.get("name") == name and isinstance(run.get("result"), dict):
            return run["result"]
    return None


def verdict(qual, model: str, op: str, size: int) -> str:
    """What qualification decided for ``op`` at ``size`` rows in ``model``'s run: the backend and path that serve
    (with its error and speed-up), or stock and why."""
    if op not in ("draft_fc", "fused_add_rmsnorm_capture"):
        return "served: a copy into the buffer (no stock kernel to beat)"
    if model.startswith("smoke"):
        return "- (a CPU smoke row: qualification runs at the seed's shapes on a GPU)"
    res = _qualify_run(qual, model)
    if res is None:
        return "not qualified (no qualification result for this model: see the qualification lines)"
    choices = sorted((c for c in res.get("choices", []) if c.get("op") == op), key=lambda c: c.get("rows") or 0)
    if not choices:
        return "not qualified (no choice recorded)"
    c = next((c for c in choices if size <= (c.get("rows") or 0)), choices[-1])
    med, stock = c.get("median_us"), c.get("stock_us")
    if c.get("backend") is not None:
        x = f", {stock / med:.2f}x stock" if med and stock else ""
        err = c.get("max_rel_err")
        return (f"qualified: {c['backend']}/{c.get('path') or '-'}{' folded' if c.get('folded') else ''} (bucket "
                f"{c.get('rows')}, max rel err {err:.1e}{x})" if err is not None else
                f"qualified: {c['backend']}/{c.get('path') or '-'} (bucket {c.get('rows')}{x})")
    rejected = [r for r in res.get("rejected", []) if r.get("op") == op and r.get("rows") == c.get("rows")]
    if med is not None:
        why = f"the fastest correct candidate, {med:.1f} us, does not beat stock {stock:.1f} us by the margin"
    elif rejected:
        why = "; ".join(f"{r.get('backend')}/{r.get('path') or '-'}: {str(r.get('reason'))[:60]}" for r in rejected[:2])
    else:
        why = "no candidate ran"
    return f"stock (bucket {c.get('rows')}): {why}"


def decisive_rows(benches: List[dict]) -> List[dict]:
    """The rows of the final table, in order: draft fc per model and M, then the captures at H = 7168."""
    rows = [r for b in benches for r in (b or {}).get("rows", [])]
    picked = []
    for model, H, N in MODELS:
        for M in DECISIVE_M:
            for r in rows:
                s = _shape(r.get("shape"))
                if r.get("bench") == "draft_fc_rows" and s.get("H") == H and s.get("N", H) == N and s.get("M") == M:
                    picked.append(dict(r, _model=model, _op="draft_fc", _size=M))
    for bench in ("capture3_packer", "fused_add_rmsnorm_capture"):
        for T in DECISIVE_T:
            for r in rows:
                s = _shape(r.get("shape"))
                if r.get("bench") == bench and s.get("H") == KEY_H and s.get("T") == T:
                    picked.append(dict(r, _model="kimi-k2.5", _op=OP_OF.get(bench, bench), _size=T))
    if not picked:  # a smoke run (CPU): its rows, as they are
        picked = [dict(r, _model="smoke (CPU)", _op=OP_OF.get(r.get("bench"), r.get("bench")),
                       _size=_shape(r.get("shape")).get("M", _shape(r.get("shape")).get("T"))) for r in rows[:8]]
    return picked


# bench -> the op it times
OP_OF = {"draft_fc_rows": "draft_fc", "draft_fc_chunk_norm": "draft_fc", "draft_fc_chunk_norm_folded": "draft_fc",
         "draft_fc_paths": "draft_fc", "capture3_llama": "capture", "capture3_packer": "capture",
         "fused_add_rmsnorm_capture": "fused_add_rmsnorm_capture"}


def final_table(args, stages: List[dict], qual, benches: List[dict], tests: dict) -> List[str]:
    env = env_facts(os.path.join(args.results, "env.txt"))
    meta = next((b.get("meta") for b in benches if b and b.get("meta")), {}) or {}
    dev = env.get("gpu") or env.get("device") or meta.get("device") or "?"
    lines = ["=" * 100, f"eagle3_ops device check: the numbers of this run ({args.results}; every table in full: "
                         f"summary.txt)",
             f"device: {dev}   driver {env.get('driver', '?')}   torch {env.get('torch', '?')} (CUDA "
             f"{env.get('torch_cuda', '?')})   triton {env.get('triton', '?')}   numpy {env.get('numpy', '?')}"]
    if meta:
        lines.append(f"measured here: read {meta.get('read_bw_GBps')} GB/s, copy {meta.get('copy_bw_GBps')} GB/s, "
                     f"gemm {meta.get('gemm_TFLOPs')} TFLOP/s (the floors of %floor); L2 flushed before every call")
        if meta.get("smoke"):
            lines.append("SMOKE RUN ON THE CPU: these rows say nothing about GPU kernels")
    rows = decisive_rows(benches)
    if rows:
        lines.append("decisive rows: bf16, K = 3; CUDA events, median; stock = gather + cuBLAS F.linear (fc), torch "
                     "eager (captures); x = stock / ours; %floor = floor / ours")
        table = [[r["_model"], _short(r.get("bench"), False), r["_size"], r.get("stock_us"), r.get("ours_us"),
                  r.get("speedup"), r.get("%floor"), _ours(r), verdict(qual, r["_model"], r["_op"], r["_size"] or 0)]
                 for r in rows]
        lines += _table(["model", "op", "M/T", "stock us", "ours us", "x", "%floor", "ours", "verdict"], table)
    else:
        lines.append("decisive rows: none measured (bench.json / bench_capture.json missing or empty)")
    lines.append("stages:")
    for st in stages:
        extra = ""
        if st["name"].startswith("correctness") and tests.get("seed"):
            extra = f" [{tests['seed']['text']}]"
        elif st["name"].startswith("the rest") and tests.get("gpu"):
            extra = f" [{tests['gpu']['text']}]"
        cap = f" (cap {st['cap']} s)" if st["cap"] not in ("", "0") else ""
        lines.append(f"  {st['n']}. {st['name']:<40s} {st['status']:<8s} {st['seconds']:>4s} s{cap}"
                     f"{'  ' + st['note'] if st['note'] and st['status'] not in STAGE_OK else ''}{extra}")
    return lines


def _verdict(args, stages: List[dict], tests: dict) -> str:
    if args.dry_run:
        return "DRY RUN (nothing ran on a GPU)"
    bad = [s for s in stages if s["status"] not in ("PASS", "SKIPPED")]
    short = [s for s in stages if s["status"] == "SKIPPED" and "budget" in s["note"]]
    if args.build not in ("ok", "skipped"):
        return "FAIL (build)"
    for kind in ("seed", "gpu"):
        if tests.get(kind) and not tests[kind]["ok"] and tests[kind].get("failed"):
            return f"FAIL ({len(tests[kind]['failed'])} failing {'seed' if kind == 'seed' else 'gpu'} test(s))"
    if bad:
        return "FAIL (" + ", ".join(f"stage {s['n']} {s['status']}" for s in bad) + ")"
    if short:
        return "INCOMPLETE (" + ", ".join(f"stage {s['n']} skipped: out of time" for s in short) + ")"
    return "PASS"


def report(args) -> int:
    res = args.results
    stages = read_stages(os.path.join(res, "stages.tsv"))
    tests = {}
    for kind, name in (("seed", "seed_tests.xml"), ("gpu", "gpu_tests.xml")):
        if os.path.exists(os.path.join(res, name)):
            tests[kind] = junit_summary(os.path.join(res, name))
    qual = _load_json(os.path.join(res, "qualify.json"))
    benches = [b for b in (_load_json(os.path.join(res, n)) for n in ("bench.json", "bench_capture.json")) if b]
    verdict_text = _verdict(args, stages, tests)
    head = [f"eagle3_ops device check: {verdict_text}   {args.elapsed}s of {args.budget}s"
            f"{'   QUICK=1 (stages 1-4)' if args.quick else ''}   results: {res}",
            f"  build ({args.arch}): {args.build}"]
    failing_full, failing_short = [], []
    for kind, t in tests.items():
        if t.get("failed"):
            failing_full += [f"failing {kind} tests:"] + ["  " + n for n in t["failed"]]
            failing_short += [f"failing {kind} tests ({len(t['failed'])}; all in summary.txt):"] + \
                             ["  " + n for n in t["failed"][:8]]
        if t.get("unimportable"):
            failing_full.append(f"{kind} test modules not importable here (not counted): "
                                + ", ".join(t["unimportable"]))
    bench_full = [ln for b, n in zip(benches, ("draft_fc", "capture"))
                  for ln in [f"-- {n} timings"] + bench_lines(b, True)]
    bench_short = [ln for b in benches for ln in bench_summary_lines(b.get("rows", []), False)]
    host = _tail(os.path.join(res, "host_path.txt"), 1500).strip().splitlines()
    spec = _tail(os.path.join(res, "spec_report_timing.txt"), 1500).strip().splitlines()
    table = final_table(args, stages, qual, benches, tests)
    full = head + failing_full + [""] + qualify_lines(qual, True) + [""] + bench_full + [""] + \
        (["host path:"] + host if host else []) + (["speculation report timing:"] + spec if spec else []) + [""] + \
        table + [f"eagle3_ops device check: {verdict_text}"]
    short = head + failing_short + [""] + qualify_lines(qual, False) + [""] + \
        (["timings (median and range per bench):"] + bench_short if bench_short else []) + \
        table + [f"eagle3_ops device check: {verdict_text}"]
    with open(os.path.join(res, "summary.txt"), "w") as f:
        f.write("\n".join(full) + "\n")
    print("\n".join(short))
    if args.dry_run:  # what a dry run could run (CPU smoke benchmarks, a tiny qualification) succeeded
        return 0 if all(s["status"] in ("DRY", "SKIPPED") for s in stages) and qualify_ok(qual) is not False else 1
    return 0 if verdict_text == "PASS" else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report")
    r.add_argument("results")
    r.add_argument("--build", default="ok")
    r.add_argument("--arch", default="?")
    r.add_argument("--elapsed", default="?")
    r.add_argument("--budget", default="?")
    r.add_argument("--dry-run", action="store_true")
    r.add_argument("--quick", action="store_true")
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
