"""One table of the doctor's finding codes (eagle3_ops/doctor/codes.py): every code the package emits is in it,
with the severity it is emitted at; every row is emitted somewhere; docs/doctor.md's code table is rendered from
it; a finding with a code outside it is refused."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from eagle3_ops.doctor import codes

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "eagle3_ops"
_ADD = re.compile(r"\.add\(\s*\"(error|warning|info)\",\s*\"([EWI]_[A-Z0-9_]+)\"")
_VERDICT = re.compile(r"code=\"([EWI]_[A-Z0-9_]+)\"")
_SEVERITY = {"E": "error", "W": "warning", "I": "info"}


def _sources():
    return {p: p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "codes.py"}


def test_every_emitted_code_is_in_the_table_with_its_severity():
    emitted = {}
    for path, text in _sources().items():
        for severity, code in _ADD.findall(text):
            emitted.setdefault(code, set()).add(severity)
        for code in _VERDICT.findall(text):  # the replay's verdict codes (replay._verdict)
            emitted.setdefault(code, set()).add(_SEVERITY[code[0]])
    assert len(emitted) >= 50, sorted(emitted)
    for code, severities in sorted(emitted.items()):
        assert code in codes.CODES, f"{code} is emitted but not in codes.py"
        assert severities == {codes.CODES[code].severity}, (code, severities)


def test_every_row_is_emitted_and_named_by_its_severity():
    text = "\n".join(_sources().values())
    for code, row in codes.CODES.items():
        assert f'"{code}"' in text, f"{code} is in codes.py but nothing emits it"
        assert row.severity == _SEVERITY[code[0]], code
        if row.severity != "info":
            assert row.meaning and row.why and row.fix, code


def test_the_docs_table_is_rendered_from_it():
    from tools.doctor_rule_table import CODES_BEGIN, CODES_END

    doc = (ROOT / "docs" / "doctor.md").read_text()
    block = doc.split(CODES_BEGIN, 1)[1].split(CODES_END, 1)[0].strip("\n")
    assert block == codes.markdown().strip("\n"), "rerun: python -m tools.doctor_rule_table --write"


def test_a_finding_outside_the_table_is_refused():
    with pytest.raises(ValueError, match="not in eagle3_ops/doctor/codes.py"):
        codes.check("error", "E_NOT_A_CODE")
    with pytest.raises(ValueError, match="has severity error"):
        codes.check("warning", "E_FC_WIDTH")
