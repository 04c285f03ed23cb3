"""One table of the doctor's finding codes (eagle3_ops/doctor/codes.py): every code the package emits is one of its
constants (``codes.E_FC_WIDTH``: emitters pass the constant, whose severity is the table's); every row is emitted
somewhere; docs/doctor.md's code table is rendered from it; a finding with a code outside it is refused."""
from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path

import pytest

from eagle3_ops.doctor import codes

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "eagle3_ops"
_CODE = re.compile(r"[EWI]_[A-Z0-9_]+$")
_SEVERITY = {"E": "error", "W": "warning", "I": "info"}


def _sources():
    return {p: p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "codes.py"}


def _constants_used():
    """Every ``codes.X`` (X a code's name) in the package's sources, by file."""
    used = {}
    for path, text in _sources().items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "codes" \
                    and _CODE.match(node.attr):
                used.setdefault(node.attr, set()).add(path.relative_to(ROOT).as_posix())
    return used


def test_every_emitted_code_is_a_constant_of_the_table():
    used = _constants_used()
    assert len(used) >= 50, sorted(used)
    for code, where in sorted(used.items()):
        assert code in codes.CODES, f"codes.{code} ({sorted(where)}) is not in codes.py"
        assert getattr(codes, code) is codes.CODES[code]


def test_every_row_is_emitted_and_named_by_its_severity():
    used = _constants_used()
    for code, row in codes.CODES.items():
        assert code in used, f"{code} is in codes.py but nothing emits it"
        assert row.severity == _SEVERITY[code[0]], code
        if row.severity != "info":
            assert row.meaning and row.why and row.fix, code


def test_a_code_is_its_string_and_knows_its_row():
    c = codes.E_FC_WIDTH
    assert isinstance(c, codes.Code) and c == "E_FC_WIDTH" and c.code == "E_FC_WIDTH"
    assert type(c.code) is str and type(str(c)) is str and f"{c}" == "E_FC_WIDTH"
    assert c.severity == "error" and c.meaning and c.why and c.fix
    assert codes.get("E_FC_WIDTH") is c and codes.get(c) is c
    assert pickle.loads(pickle.dumps(c)) is c  # one object per code, also across processes
    with pytest.raises(AttributeError):
        c.severity = "warning"
    assert list(codes.CODES.values())[0] is codes.E_TARGET_UNSUPPORTED  # the table keeps the order written


def test_the_docs_table_is_rendered_from_it():
    from tools.doctor_rule_table import CODES_BEGIN, CODES_END

    doc = (ROOT / "docs" / "doctor.md").read_text()
    block = doc.split(CODES_BEGIN, 1)[1].split(CODES_END, 1)[0].strip("\n")
    assert block == codes.markdown().strip("\n"), "rerun: python -m tools.doctor_rule_table --write"


def test_a_finding_outside_the_table_is_refused():
    from eagle3_ops.doctor.checks import Finding

    with pytest.raises(ValueError, match="not in eagle3_ops/doctor/codes.py"):
        codes.check("error", "E_NOT_A_CODE")
    with pytest.raises(ValueError, match="not in eagle3_ops/doctor/codes.py"):
        codes.get("E_NOT_A_CODE")
    with pytest.raises(ValueError, match="has severity error"):
        codes.check("warning", "E_FC_WIDTH")
    with pytest.raises(ValueError, match="has severity error"):
        Finding(codes.E_FC_WIDTH, "warning", "a message")
