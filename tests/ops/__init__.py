# A package, so that tests/ops/test_draft_fc.py and tests/sglang/test_draft_fc.py can both be collected
# (pytest's default import mode needs unique basenames outside packages).
