"""Among id lists that make SGLang feed the same boundaries, the fix is written in the config's own form.

SGLang 0.5.23's deepseek rule (Kimi-K2.5's language model) reads ids as boundaries unless the first id is 1, then
adds 1 to each: ``[1, 29, 57]`` and ``[2, 30, 58]`` feed the same boundaries. The user's config decides which
one the doctor writes: the one with the same id -> boundary offset as the config's ids, then the fewest changed
ids. Checked on SpecForge's real Kimi-K2.5 configs (tests/doctor/real/kimi-k25_specforge), through SGLang's own
rule (the installed, pinned SGLang runs it on a stand-in)."""
import dataclasses
from pathlib import Path

import pytest

from eagle3_ops.doctor import checks, configs
from machine import needs_sglang

pytestmark = needs_sglang  # SGLang's own id rule, run on a stand-in
REAL = Path(__file__).resolve().parent / "real" / "kimi-k25_specforge"


def _report(ids):
    target = configs.parse_target(REAL / "target", use_sglang=True)
    draft = dataclasses.replace(configs.parse_draft(REAL / "draft", use_sglang=True), nested_ids=list(ids))
    fc = configs.TensorInfo("fc.weight", "fc.weight", (7168, 3 * 7168), "BF16", "")
    return checks.run_checks(target, draft, {"fc.weight": fc}, checks.Options(engine="sglang", engine_code="installed"))


@pytest.mark.parametrize("config_ids,want", [
    ([2, 29, 57], [2, 30, 58]),   # ids written as boundaries: the fix too
    ([1, 28, 56], [1, 29, 57]),   # the "+1" form (first id 1): the fix too
    ([3, 31, 59], [2, 30, 58]),   # every id one too high, boundary form
    ([-1, 2, 30], [2, 30, 58]),   # the seed's edit: its form (ids as boundaries) where it is SGLang's
])
def test_the_fix_keeps_the_configs_form(config_ids, want):
    rep = _report(config_ids)
    assert checks.verified_fix(rep, [2, 30, 58], check_readings=False) == want
    assert rep.wiring.rules.map_ids(want, 61).config_order == [2, 30, 58]  # SGLang's own rule, run again


def test_evidence_finds_ids_the_readings_would_refuse():
    """Boundaries [3, 31, 59] (trained on "the outputs of layers 2, 30, 58"): ids [3, 31, 59] feed them, but their
    own readings disagree (reading B of [3, 31, 59] is [4, 32, 60]), so config-only advice withholds them; the
    replay's evidence does not need the readings to agree."""
    rep = _report([2, 30, 58])
    assert checks.verified_fix(rep, [3, 31, 59], check_readings=True) is None
    assert checks.verified_fix(rep, [3, 31, 59], check_readings=False) == [3, 31, 59]
    assert "never captures" in checks.why_no_fix(rep, [3, 31, 61])
