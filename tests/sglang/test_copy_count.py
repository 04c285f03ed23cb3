"""The aux-state bytes written per prefill and per decode step, stock SGLang vs the plugin
(benchmarks/count_draft_input_copies.py, whose numbers benchmarks/NOTES.md quotes), in units of one
[T, K*H] tensor: the plugin writes each capture once and nothing else copies it."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))


@pytest.mark.parametrize("family,stock_units", [("llama", {"prefill": 4, "decode": 3}),
                                                ("deepseek_v2", {"prefill": 3, "decode": 2})])
def test_bytes_written_on_the_draft_input_path(sglang_cpu, family, stock_units):
    import count_draft_input_copies as c

    stock = c.count(plugin=False, family=family)
    ours = c.count(plugin=True, family=family)
    for step in ("prefill", "decode"):
        assert stock[step]["units"] == stock_units[step], (step, stock[step]["rows"])
        assert ours[step]["units"] == 1, (step, ours[step]["rows"])
        assert all(what.startswith("eagle3.") for what, _ in ours[step]["rows"])
