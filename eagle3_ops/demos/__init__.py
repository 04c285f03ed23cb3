"""``python -m eagle3_ops demo`` and the CPU harness it shares with the tests (tests/sglang) and
benchmarks/count_draft_input_copies.py. Not part of the ops or the SGLang plugin: nothing here is
imported by them."""
