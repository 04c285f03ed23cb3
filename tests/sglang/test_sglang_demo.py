"""The SGLang half of ``python -m eagle3_ops demo`` (eagle3_ops/demos/sglang_demo.py) is a correctness check
on a CPU: no stock-vs-plugin time column (the plugin's ops run the reference backend there, computing in
float32, in place of SGLang's own bfloat16 modules), and it says why under its table."""
from __future__ import annotations

import re

# what a time or a speed claim looks like in a table (as tests/test_demo.py)
TIME_OR_SPEED = re.compile(r"\bms\b|milliseconds|median|speed-?up|faster|slower|\d\s*x\b", re.I)


def test_the_sglang_cpu_demo_prints_no_time_column_and_says_why(sglang_cpu, capsys):
    from eagle3_ops.demos.sglang_demo import run_sglang_demo

    rows = run_sglang_demo(hidden_size=64, prompt_len=8, batch=2, draft_tokens=2)
    out = capsys.readouterr().out
    assert [set(r) for r in rows] == [{"path", "plugin does", "outputs match", "max rel diff"}] * 4, rows
    assert all(r["outputs match"] == "yes" for r in rows), rows
    table = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert len(table) == 6, out  # header, rule, four paths
    for line in table:
        assert not TIME_OR_SPEED.search(line), line
    why = [ln for ln in out.splitlines() if ln.startswith("(a correctness check, no time column")]
    assert len(why) == 1 and "float32" in why[0] and "bfloat16" in why[0], out
