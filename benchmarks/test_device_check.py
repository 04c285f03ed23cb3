"""CPU checks of the device check itself: the script parses, its dry run goes through every stage
without a GPU, and the report renders verdicts and tables from synthetic results (the GPU paths of
the benchmarks cannot run here; what renders them can)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPT = HERE / "device_check.sh"
sys.path.insert(0, str(HERE))
import device_report  # noqa: E402


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_dry_run_touches_no_gpu_and_writes_one_results_folder(tmp_path):
    res = tmp_path / "results"
    env = dict(os.environ, DRY_RUN="1", RESULTS_DIR=str(res), GPU_TESTS="skip", BENCH_SET="skip",
               DRY_RUN_QUALIFY="0", PYTHON=sys.executable)
    env.pop("OUT", None)
    p = subprocess.run(["bash", str(SCRIPT)], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "DRY RUN, would run" in out and "setup.py build_ext --inplace" in out
    assert "qualify --hidden 7168 --captures 3 --out-features 7168 --tp 8" in out or "not available in this tree" in out
    assert "eagle3_ops device check: DRY RUN" in out.splitlines()[-1]
    files = sorted(f.name for f in res.iterdir())
    assert set(files) <= {"env.txt", "build.log", "gpu_tests.log", "gpu_tests.xml", "qualify.json", "bench.log",
                          "bench.json", "summary.txt"}, files
    assert "summary.txt" in files and "env.txt" in files


def test_script_rejects_bad_settings(tmp_path):
    env = dict(os.environ, GPU_TESTS="some", RESULTS_DIR=str(tmp_path))
    p = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "GPU_TESTS must be" in p.stderr


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="{errors}"
failures="{failures}" skipped="0" tests="{tests}">
<testcase classname="tests.ops.test_capture" name="test_a[cuda-cuda]"/>
{failure}
<testcase classname="tests.sglang.test_x" name="tests.sglang.test_x"><error message="collection failure">x</error></testcase>
</testsuite></testsuites>"""


def _row(bench, shape, ours, us, stock, graph=None, stock_graph=None, **kw):
    row = {"bench": bench, "shape": shape, "ours": ours, "ours_us": us, "ours_graph_us": graph, "stock_us": stock,
           "stock_graph_us": stock_graph, "speedup": round(stock / us, 2),
           "speedup_graph": round(stock_graph / graph, 2) if graph and stock_graph else None,
           "floor_us": 70.0, "%floor": round(7000 / us, 1), "smoke": False, "stock_impl": "torch eager forward_native",
           "stock_note": "neither sgl_kernel nor flashinfer imports", "backend": ours.split(":")[0]}
    row.update(kw)
    return row


def _results(tmp_path, failing_test=False, qualify_rc=0):
    res = tmp_path / "res"
    res.mkdir(parents=True)
    failure = ('<testcase classname="tests.ops.test_draft_fc" name="test_b[cuda-cuda-1]"><failure message="m">f'
               '</failure></testcase>') if failing_test else ""
    (res / "gpu_tests.xml").write_text(JUNIT.format(errors=1, failures=int(failing_test), tests=2 + failing_test,
                                                    failure=failure))
    out, err = tmp_path / "q.out", tmp_path / "q.err"
    out.write_text(json.dumps({"device": "NVIDIA H200", "choices": [
        {"op": "draft_fc", "rows": 1, "backend": "cuda", "path": "skinny", "max_rel_err": 2e-3, "median_us": 75.0,
         "stock_us": 110.0, "stock": "F.linear"},
        {"op": "fused_add_rmsnorm_capture", "rows": 2048, "backend": None, "path": None, "max_rel_err": None,
         "median_us": None, "stock_us": 40.0, "stock": "torch eager"}],
        "rejected": [{"op": "draft_fc", "rows": 64, "backend": "triton", "path": "tiled", "reason": "max rel err 0.5"}]}))
    err.write_text("")
    device_report.main(["qualify-merge", str(res / "qualify.json"), "kimi-k2.5", "--hidden 7168", str(qualify_rc),
                        "12.5", str(out), str(err)])
    rows = [_row("draft_fc_rows", f"M={m},H=7168,K=3", b, 80.0 + m, 110.0 + m, 78.0 + m, 105.0 + m, path="skinny")
            for m in (1, 2, 16, 64) for b in ("cuda", "triton")]
    rows += [_row("capture3_packer", f"T={t},H=4096", "cuda", 5.0 + t, 6.0 + t, graph_error="ours: RuntimeError: x")
             for t in (1, 64)]
    meta = {"device": "NVIDIA H200", "smoke": False, "read_bw_GBps": 4500.0, "copy_bw_GBps": 4300.0,
            "gemm_TFLOPs": 780.0, "l2_bytes": 60 << 20, "l2_flush": {"method": "read", "bytes": 256 << 20}}
    (res / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    return res


def _report(res, capsys, *extra):
    rc = device_report.main(["report", str(res), "--build", "ok", "--arch", "9.0a", "--tests-rc", "0",
                             "--bench-rc", "0", "--elapsed", "300", *extra])
    return rc, capsys.readouterr().out, (res / "summary.txt").read_text()


def test_report_pass(tmp_path, capsys):
    rc, out, summary = _report(_results(tmp_path), capsys)
    assert rc == 0, out
    lines = out.splitlines()
    assert "eagle3_ops device check: PASS" in lines[1] and "PASS" in lines[-1]
    assert "tests.sglang.test_x" in out  # unimportable module listed, not counted as a failure
    assert "qualification [kimi-k2.5]" in out and "cuda/skinny" in out and "rejected: 1" in out
    assert "M=64,H=7168 " in out and "T=1,H=4096" not in out  # key rows on stdout (short shapes) ...
    assert "T=1,H=4096" in summary                                 # ... every row in summary.txt
    assert "graph capture errors" in out and "neither sgl_kernel nor flashinfer" in out


def test_report_fails_on_a_failing_test_a_timeout_or_a_failed_qualification(tmp_path, capsys):
    rc, out, summary = _report(_results(tmp_path / "a", failing_test=True), capsys)
    assert rc == 1 and "FAIL" in out.splitlines()[1] and "test_b[cuda-cuda-1]" in out
    rc, out, _ = _report(_results(tmp_path / "b"), capsys, "--tests-rc", "124")
    assert rc == 1 and "TIMED OUT" in out
    rc, out, _ = _report(_results(tmp_path / "c", qualify_rc=1), capsys)
    assert rc == 1 and "qualification: FAILED" in out


def test_report_without_qualification_or_rows(tmp_path, capsys):
    res = tmp_path / "res"
    res.mkdir()
    device_report.main(["qualify-unavailable", str(res / "qualify.json"), "no such command"])
    rc = device_report.main(["report", str(res), "--tests-mode", "skip", "--bench-rc", "124"])
    out = capsys.readouterr().out
    assert rc == 1 and "not available here" in out and "bench.json missing" in out


@pytest.mark.parametrize("tail", ["", "not json at all"])
def test_qualify_merge_keeps_text_that_is_not_json(tmp_path, tail):
    out, err = tmp_path / "o", tmp_path / "e"
    out.write_text(tail)
    err.write_text("Traceback: boom")
    path = tmp_path / "q.json"
    device_report.main(["qualify-merge", str(path), "n", "--hidden 1", "1", "0.5", str(out), str(err)])
    run = json.loads(path.read_text())["runs"][0]
    assert run["result"] is None and run["rc"] == 1 and "boom" in run["stderr_tail"]
    assert any("boom" in ln for ln in device_report.qualify_lines(json.loads(path.read_text()), False))
