"""``python -m eagle3_ops demo`` tells the truth about speed (eagle3_ops/demos/ops_demo.py): no time column
where stock and eagle3_ops would not compute the same thing on the same device (a CPU, or a GPU where the
reference backend serves), and on a GPU served by our kernels both paths timed in one run with CUDA events,
the column naming the GPU. The SGLang half: tests/sglang/test_sglang_demo.py."""
from __future__ import annotations

import re

import pytest
import torch

from eagle3_ops.demos import ops_demo

# what a time or a speed claim looks like in a table or a sentence
TIME_OR_SPEED = re.compile(r"\bms\b|milliseconds|median|speed-?up|faster|slower|\d\s*x\b", re.I)


def test_the_cpu_demo_prints_no_time_column_and_says_why(capsys):
    rows = ops_demo.kernel_demo(torch.device("cpu"))
    out = capsys.readouterr().out
    assert [r["path"] for r in rows] == ["stock (add+clone+cat+F.linear)", "eagle3_ops (capture+draft_fc)"]
    assert all(set(r) == {"path", "max rel err vs fp64"} for r in rows), rows
    assert all(float(r["max rel err vs fp64"]) < 1e-2 for r in rows), rows
    lines = out.splitlines()
    table = [ln for ln in lines if ln.startswith("|")]
    assert len(table) == 4, out  # header, rule, two rows
    for line in table + lines[:3]:  # the table, and the header lines above it
        assert not TIME_OR_SPEED.search(line), line
    assert lines[0].startswith("eagle3_ops demo on CPU: "), lines[0]
    why = [ln for ln in lines if ln.startswith("(no time column on a CPU")]
    assert len(why) == 1 and "float32" in why[0] and "bfloat16" in why[0], out
    assert "perf_counter" not in out  # nothing is timed on a CPU


def test_times_only_where_our_kernels_serve_a_gpu(monkeypatch):
    reference = {op: "reference" for op in ("capture", "fused_add_rmsnorm_capture", "draft_fc")}
    assert "no time column on a CPU" in ops_demo.why_untimed(torch.device("cpu"), reference)
    kernels = {"capture": "cuda", "fused_add_rmsnorm_capture": "cuda", "draft_fc": "triton"}
    assert ops_demo.why_untimed(torch.device("cuda"), kernels) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    why = ops_demo.why_untimed(torch.device("cuda"), dict(kernels, draft_fc="reference"))
    assert why.startswith("no time column: draft_fc served by the reference backend on Some GPU"), why


@pytest.mark.gpu
def test_the_gpu_demo_times_both_paths_with_cuda_events_on_the_named_gpu(capsys):
    device = torch.device("cuda")
    rows = ops_demo.kernel_demo(device)
    out = capsys.readouterr().out
    if ops_demo.why_untimed(device, ops_demo.dispatch.backends(device)) is not None:
        pytest.skip("a reference backend serves this GPU: the demo rightly shows no times")
    column = f"median ms on {torch.cuda.get_device_name(device)} (CUDA events)"
    assert all(set(r) == {"path", "max rel err vs fp64", column} and float(r[column]) > 0 for r in rows), rows
    assert "no time column" not in out
