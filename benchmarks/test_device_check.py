"""CPU checks of the device check itself: the script parses, its dry run goes through every stage in the order
the first GPU run needs (correctness at the seed's shapes, qualification, the fc timings, the captures, the rest
of the gpu tests, the host path) with the caps of a 16-core H100 and prints the final table last, and the report
renders verdicts and tables from synthetic results (the GPU paths of the benchmarks cannot run here; what renders
them can)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPT = HERE / "device_check.sh"
sys.path.insert(0, str(HERE))
import device_report  # noqa: E402

STAGE_ORDER = ["1. build", "2. correctness", "3. qualification", "4. draft_fc timings", "5. capture timings",
               "6. the rest of the gpu tests", "7. host path", "8. speculation report timing"]
RESULT_FILES = {"env.txt", "build.log", "seed_tests.log", "seed_tests.xml", "qualify.json", "bench.log", "bench.json",
                "bench_capture.json", "gpu_tests.log", "gpu_tests.xml", "host_path.txt", "spec_report_timing.txt",
                "stages.tsv", "summary.txt"}


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def _dry_run(tmp_path, **env_extra):
    res = tmp_path / "results"
    env = dict(os.environ, DRY_RUN="1", RESULTS_DIR=str(res), DRY_RUN_BENCH="0", DRY_RUN_QUALIFY="0",
               PYTHON=sys.executable, **env_extra)
    env.pop("OUT", None)
    p = subprocess.run(["bash", str(SCRIPT)], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    return p, p.stdout + p.stderr, res


def test_dry_run_shows_every_stage_in_order_with_the_caps_of_a_16_core_h100(tmp_path):
    p, out, res = _dry_run(tmp_path)
    assert p.returncode == 0, out
    assert "arch 9.0a, 16 CPUs: MAX_JOBS=16, test workers -n 8" in out
    assert "TORCH_CUDA_ARCH_LIST=9.0a" in out and "setup.py build_ext --inplace" in out
    # the stages, in the order the first run needs them, each with its cap
    said = [ln for ln in out.splitlines() if re.match(r"\[device_check \d+s\] \d\. ", ln)]
    assert [re.sub(r"^\[device_check \d+s\] ", "", ln) for ln in said][0].startswith("1. build")
    positions = [next(i for i, ln in enumerate(said) if s in ln) for s in STAGE_ORDER]
    assert positions == sorted(positions), said
    for stage, cap in (("1. build", 150), ("2. correctness", 75), ("3. qualification", 40), ("4. draft_fc", 90),
                       ("5. capture", 45), ("6. the rest", 180), ("7. host", 30), ("8. speculation", 20)):
        assert any(stage in ln and f"cap {cap}s" in ln for ln in said), (stage, cap, said)
    assert '-m gpu and seed tests/ops/test_seed_shapes.py' in out and "-m gpu and not seed tests" in out
    assert "static_model.py --detail --device auto" in out
    assert "qualify --hidden 7168 --captures 3 --out-features 7168 --tp 8" in out
    assert "EAGLE3_BENCH_SET=seed" in out and "benchmarks/bench_draft_fc.py" in out
    # the final table comes last: the stages, then the verdict line
    lines = out.splitlines()
    assert "eagle3_ops device check: DRY RUN" in lines[-1]
    table = lines[-10:-1]
    assert table[0] == "stages:" and [ln.split(".", 1)[0].strip() for ln in table[1:]] == list("12345678")
    assert all("DRY" in ln or "SKIPPED" in ln for ln in table[1:]), table
    files = {f.name for f in res.iterdir()}
    assert files <= RESULT_FILES and {"summary.txt", "env.txt", "stages.tsv"} <= files, files


def test_quick_runs_the_first_four_stages_within_240_s(tmp_path):
    p, out, res = _dry_run(tmp_path, QUICK="1")
    assert p.returncode == 0, out
    assert "budget 240s, QUICK=1: stages 1-4" in out
    assert "5. capture" not in out and "6. the rest" not in out and "7. host" not in out and "8. spec" not in out
    stages = device_report.read_stages(str(res / "stages.tsv"))
    assert [s["n"] for s in stages] == ["1", "2", "3", "4"]


def test_script_rejects_bad_settings(tmp_path):
    for var, value, says in (("GPU_TESTS", "some", "GPU_TESTS must be"), ("BENCH_SET", "full", "BENCH_SET must be"),
                             ("QUICK", "yes", "QUICK must be")):
        env = dict(os.environ, RESULTS_DIR=str(tmp_path), **{var: value})
        p = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and says in p.stderr, (var, p.stderr)


JUNIT = ("""<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="{errors}"
failures="{failures}" skipped="0" tests="{tests}">
<testcase classname="tests.ops.test_capture" name="test_a[cuda-cuda]"/>
{failure}
<testcase classname="tests.sglang.test_x" name="tests.sglang.test_x">"""
         """<error message="collection failure">x</error></testcase>
</testsuite></testsuites>""")


def _row(bench, shape, ours, us, stock, graph=None, stock_graph=None, **kw):
    row = {"bench": bench, "shape": shape, "ours": ours, "ours_us": us, "ours_graph_us": graph, "stock_us": stock,
           "stock_graph_us": stock_graph, "speedup": round(stock / us, 2),
           "speedup_graph": round(stock_graph / graph, 2) if graph and stock_graph else None,
           "floor_us": 70.0, "%floor": round(7000 / us, 1), "smoke": False, "stock_impl": "torch eager forward_native",
           "stock_note": "neither sgl_kernel nor flashinfer imports", "backend": ours.split(":")[0]}
    row.update(kw)
    return row


STAGES = [("1", "build (9.0a)", "PASS", "31", "150", "ok"), ("2", "correctness at the seed's shapes", "PASS", "28",
          "75", "seed_tests.xml"), ("3", "qualification at the seed's shapes", "PASS", "41", "120", "qualify.json"),
          ("4", "draft_fc timings at the seed's shapes", "PASS", "52", "90", "bench.json"),
          ("5", "capture timings", "PASS", "19", "45", "bench_capture.json"),
          ("6", "the rest of the gpu tests", "PASS", "160", "180", "gpu_tests.xml"),
          ("7", "host path", "PASS", "9", "30", "host_path.txt"),
          ("8", "speculation report timing", "PASS", "5", "20", "spec_report_timing.txt")]


def _results(tmp_path, failing_test=False, qualify_rc=0, stages=STAGES):
    res = tmp_path / "res"
    res.mkdir(parents=True)
    failure = ('<testcase classname="tests.ops.test_draft_fc" name="test_b[cuda-cuda-1]"><failure message="m">f'
               '</failure></testcase>') if failing_test else ""
    (res / "gpu_tests.xml").write_text(JUNIT.format(errors=1, failures=int(failing_test), tests=2 + failing_test,
                                                    failure=failure))
    (res / "seed_tests.xml").write_text(JUNIT.format(errors=1, failures=0, tests=2, failure=""))
    (res / "env.txt").write_text("nvidia-smi: NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB, 1980 MHz, 2619 MHz\n"
                                 "torch 2.11.0+cu130 cuda 13.0 gpu visible: True\ntriton 3.6.0\nnumpy 2.5.2\n")
    (res / "stages.tsv").write_text("".join("\t".join(s) + "\n" for s in stages))
    out, err = tmp_path / "q.out", tmp_path / "q.err"
    for name in ("kimi-k2.5", "kimi-k2.5-tp8", "llama-3.1-8b"):
        out.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "choices": [
            {"op": "draft_fc", "rows": 1, "backend": "cuda", "path": "skinny", "max_rel_err": 2e-3, "median_us": 60.0,
             "stock_us": 90.0, "stock": "F.linear"},
            {"op": "draft_fc", "rows": 64, "backend": None, "path": None, "max_rel_err": None, "median_us": None,
             "stock_us": 95.0, "stock": "F.linear"},
            {"op": "fused_add_rmsnorm_capture", "rows": 2048, "backend": None, "path": None, "max_rel_err": 3e-3,
             "median_us": 50.0, "stock_us": 40.0, "stock": "torch eager"}],
            "rejected": [{"op": "draft_fc", "rows": 64, "backend": "triton", "path": "tiled",
                          "reason": "max rel err 0.5"}]}))
        err.write_text("")
        device_report.main(["qualify-merge", str(res / "qualify.json"), name, "--hidden 7168", str(qualify_rc),
                            "12.5", str(out), str(err)])
    rows = [_row("draft_fc_rows", f"M={m},H={h},K=3" + ("" if n == h else f",N={n}"), b, 60.0 + m, 90.0 + m,
                 58.0 + m, 88.0 + m, path="skinny")
            for h, n in ((7168, 7168), (7168, 896), (4096, 4096)) for m in (1, 8, 16, 32, 64)
            for b in ("cuda", "triton")]
    meta = {"device": "NVIDIA H100 80GB HBM3", "smoke": False, "read_bw_GBps": 3000.0, "copy_bw_GBps": 2900.0,
            "gemm_TFLOPs": 780.0, "l2_bytes": 50 << 20, "l2_flush": {"method": "read", "bytes": 256 << 20}}
    (res / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    cap = [_row(b, f"T={t},H={h}", "cuda", 5.0 + t / 100, 6.0 + t / 100, graph_error="ours: RuntimeError: x")
           for b in ("capture3_packer", "fused_add_rmsnorm_capture") for t in (1, 64, 2048) for h in (7168, 4096)]
    (res / "bench_capture.json").write_text(json.dumps({"meta": meta, "rows": cap}))
    (res / "host_path.txt").write_text("draft_fc_out  cuda  3.1 us\n")
    return res


def _report(res, capsys, *extra):
    rc = device_report.main(["report", str(res), "--build", "ok", "--arch", "9.0a", "--elapsed", "340",
                             "--budget", "420", *extra])
    return rc, capsys.readouterr().out, (res / "summary.txt").read_text()


def test_report_pass_ends_with_the_final_table(tmp_path, capsys):
    rc, out, summary = _report(_results(tmp_path), capsys)
    assert rc == 0, out
    lines = out.splitlines()
    assert "eagle3_ops device check: PASS" in lines[0] and lines[-1] == "eagle3_ops device check: PASS"
    assert len(lines) < 120, len(lines)  # the device tool returns the end of the output
    start = next(i for i, ln in enumerate(lines) if ln.startswith("eagle3_ops device check: the numbers"))
    table = lines[start:]
    assert "NVIDIA H100 80GB HBM3" in table[1] and "driver 580.159.04" in table[1] and "torch 2.11.0+cu130" in table[1]
    assert "read 3000.0 GB/s" in table[2]
    rows = [ln for ln in table if ln.startswith(("kimi", "llama"))]
    # 3 models x M in {1, 16, 64} x {cuda, triton}, then the captures at H = 7168, T in {1, 2048}
    assert len(rows) == 3 * 3 * 2 + 2 * 2, rows
    assert rows[0].startswith("kimi-k2.5 ") and "qualified: cuda/skinny (bucket 1, max rel err 2.0e-03, 1.50x stock)" \
        in rows[0]
    tp8 = [r for r in rows if r.startswith("kimi-k2.5-tp8")]
    assert len(tp8) == 6 and "stock (bucket 64): triton/tiled: max rel err 0.5" in tp8[-1], tp8
    assert any("fused_norm_cap" in r and "does not beat stock" in r for r in rows)
    assert any("cap3_packer" in r and "a copy into the buffer" in r for r in rows)
    stage_lines = table[table.index("stages:") + 1:-1]
    assert [ln.split(".", 1)[0].strip() for ln in stage_lines] == list("12345678")
    assert "[1 passed, 0 failed, 1 errors, 0 skipped]" in stage_lines[1]  # the seed tests' counts
    assert "tests.sglang.test_x" in summary  # unimportable module listed, not counted as a failure
    assert "T=1,H=4096" in summary  # every row in summary.txt


def test_report_fails_on_a_failing_test_a_failed_stage_or_a_cut(tmp_path, capsys):
    rc, out, _ = _report(_results(tmp_path / "a", failing_test=True), capsys)
    assert rc == 1 and "FAIL (1 failing gpu test(s))" in out.splitlines()[-1] and "test_b[cuda-cuda-1]" in out
    timeout = [s if s[0] != "6" else s[:2] + ("TIMEOUT",) + s[3:] for s in STAGES]
    rc, out, _ = _report(_results(tmp_path / "b", stages=timeout), capsys)
    assert rc == 1 and "FAIL (stage 6 TIMEOUT)" in out.splitlines()[-1]
    cut = [s if s[0] != "8" else ("8", "speculation report timing", "SKIPPED", "0", "4", "out of time budget")
           for s in STAGES]  # the last stage is the one a cut reaches
    rc, out, _ = _report(_results(tmp_path / "c", stages=cut), capsys)
    assert rc == 1 and "INCOMPLETE (stage 8 skipped: out of time)" in out.splitlines()[-1]
    assert "out of time budget" in out.splitlines()[-2]  # the stage line says why


def test_report_without_qualification_or_rows(tmp_path, capsys):
    res = tmp_path / "res"
    res.mkdir()
    device_report.main(["qualify-unavailable", str(res / "qualify.json"), "no such command"])
    (res / "stages.tsv").write_text("4\tdraft_fc timings at the seed's shapes\tTIMEOUT\t90\t90\tbench.json\n")
    rc = device_report.main(["report", str(res)])
    out = capsys.readouterr().out
    assert rc == 1 and "not available here" in out and "decisive rows: none measured" in out


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
