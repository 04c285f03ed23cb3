"""The doctor's findings as data (eagle3_ops/doctor/checks.py): every finding carries a constant of the code table
(never a string), its message (what is wrong) apart from its fix (what to change), and the JSON and the CLI show
message then fix as one text; the checks are small rules run in order, and one that stops the wiring rules still
leaves the vocabulary check to run."""
from __future__ import annotations

import ast
import contextlib
import inspect
import io
import json
from pathlib import Path

import pytest

from doctor_fixtures import finding, run_doctor, write_draft, write_target
from eagle3_ops.doctor import checks, cli, codes
from eagle3_ops.doctor.configs import parse_draft, parse_target, read_weight_headers

ROOT = Path(__file__).resolve().parents[2]
DOCTOR = ROOT / "eagle3_ops" / "doctor"
L = 32


@pytest.fixture
def llama(tmp_path):
    return write_target(tmp_path / "llama", model_type="llama", num_layers=L)


def _report(draft, target, **opts):
    return checks.run_checks(parse_target(target), parse_draft(draft), read_weight_headers(draft),
                             checks.Options(engine_code="table", **opts))


def _cases(tmp_path, llama):
    """Reports with errors, warnings and infos of many rules (all from the existing tests' cases)."""
    good = write_draft(tmp_path / "good", ids=[1, 15, 28])
    yield _report(good, llama)
    yield _report(good, llama, engine="vllm", tp=4)
    yield _report(good, llama, engine="trtllm", pp=2)
    yield _report(write_draft(tmp_path / "last", ids=[1, 15, 31]), llama)
    yield _report(write_draft(tmp_path / "emb", ids=[-1, 1, 15, 28], k=3), llama)
    yield _report(write_draft(tmp_path / "two", ids=[1, 15, 28], k=2), llama)
    yield _report(write_draft(tmp_path / "odd", ids=[1, 15, 28], fc_in=40), llama)
    yield _report(write_draft(tmp_path / "zero", ids=[0, 15, 28], top_ids=[0, 15, 28]), llama, engine="vllm")
    yield _report(good, llama, tp=2, capture_point="before-allreduce")


def test_every_finding_carries_a_constant_of_the_table(tmp_path, llama):
    seen = set()
    for rep in _cases(tmp_path, llama):
        for f in rep.findings:
            assert isinstance(f.code, codes.Code) and f.code is codes.CODES[f.code.code], f
            assert f.severity == f.code.severity, f
            assert isinstance(f.message, str) and isinstance(f.fix, str) and f.message, f
            assert f.text == f.message + (" " + f.fix if f.fix else ""), f
            assert rep.find(f.code) is not None and rep.has(f.code)
            seen.add(f.code)
    assert len(seen) >= 12, sorted(seen)
    assert {codes.E_TP_PARTIAL_SUM, codes.E_LAST_LAYER_NOT_CAPTURED, codes.W_PP_UNVERIFIED} <= seen


def test_the_json_holds_the_full_text_and_the_fix_and_reads_back(tmp_path, llama):
    with_fix = 0
    for rep in _cases(tmp_path, llama):
        items = json.loads(json.dumps(rep.to_json()))["findings"]
        assert len(items) == len(rep.findings)
        for f, item in zip(rep.findings, items):
            assert item == {"severity": f.severity, "code": f.code.code, "message": f.text, "fix": f.fix}
            with_fix += bool(item["fix"])
            assert item["message"].endswith(item["fix"])
        back = checks.findings_from_json(items)
        assert back == rep.findings and all(b.code is f.code for b, f in zip(back, rep.findings))
    assert with_fix >= 5
    # a report written before the "fix" field: the message is the full text, no fix
    old = checks.findings_from_json([{"severity": "error", "code": "E_FC_WIDTH", "message": "a. b."}])
    assert old[0].code is codes.E_FC_WIDTH and old[0].message == old[0].text == "a. b." and old[0].fix == ""
    for bad in ({"severity": "error", "code": "E_NOT_A_CODE", "message": "m"},
                {"severity": "warning", "code": "E_FC_WIDTH", "message": "m"},
                {"severity": "error", "code": "E_FC_WIDTH", "message": "m", "fix": "not the end"}):
        with pytest.raises(ValueError):
            checks.findings_from_json([bad])


def test_the_fix_is_the_instruction(tmp_path, llama):
    # test_doctor_config's embedding capture: the draft was trained on 3 layer outputs, someone added -1
    bad = write_draft(tmp_path / "bad", ids=[-1, 1, 15, 28], k=3)
    f = _report(bad, llama).find(codes.E_EMBEDDING_CAPTURE)
    assert f.message.startswith("The draft config lists 4 ids [-1, 1, 15, 28]")
    assert f.message.endswith("without an embedding capture.") and "Remove" not in f.message
    assert f.fix.startswith("Remove -1 (ids [1, 15, 28]); ")
    rc, rep = run_doctor("--draft", bad, "--target", llama, "--engine-code", "table")[:2]
    assert rc == 1 and finding(rep, "E_EMBEDDING_CAPTURE")["fix"] == f.fix
    assert finding(rep, "E_EMBEDDING_CAPTURE")["message"] == f.text
    # the fc width: config and weights disagree
    f = _report(write_draft(tmp_path / "two", ids=[1, 15, 28], k=2), llama).find(codes.E_FC_WIDTH)
    assert f.fix == "Config and weights disagree; use the ids the checkpoint was trained with."
    assert f.message.endswith("(2 slots).")
    # the wiring: the ids to set, for the engine that reads them
    f = _report(write_draft(tmp_path / "zero", ids=[0, 15, 28], top_ids=[0, 15, 28]), llama,
                engine="vllm").find(codes.E_EMBEDDING_CAPTURE)
    assert f.fix.startswith("Set the top-level eagle_aux_hidden_state_layer_ids") and "[1, 16, 29]" in f.fix
    assert "[1, 16, 29]" not in f.message


def test_the_cli_prints_the_full_text(tmp_path, llama):
    bad = write_draft(tmp_path / "bad", ids=[-1, 1, 15, 28], k=3)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["--draft", str(bad), "--target", str(llama), "--engine-code", "table"]) == 1
    f = _report(bad, llama).find(codes.E_EMBEDDING_CAPTURE)
    assert f.fix and " ".join(f"ERROR   E_EMBEDDING_CAPTURE: {f.text}".split()) in " ".join(out.getvalue().split())


def test_a_stopping_rule_leaves_only_the_vocabulary_check(tmp_path, llama):
    """A draft fed the last hidden state only: no wiring rule runs after I_NO_AUX; the vocabulary check does."""
    d = write_draft(tmp_path / "noaux", ids=[1, 15, 28], vocab=256,
                    extra={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28],
                                            "use_aux_hidden_state": False}})
    rep = _report(d, llama)
    found = [f.code for f in rep.findings]
    assert found[found.index(codes.I_NO_AUX) + 1:] == [codes.E_VOCAB_MAP], found
    assert rep.wiring is None and rep.training is None and rep.slots == []
    assert checks.RULES.index(checks._no_aux) < checks.RULES.index(checks._resolve_wiring)
    assert checks.FINAL_RULES == [checks._check_vocab]


def test_every_rule_is_small_and_says_what_it_checks():
    for rule in checks.RULES + checks.FINAL_RULES:
        doc = inspect.getdoc(rule) or ""
        assert 1 <= len(doc.splitlines()) <= 3, (rule.__name__, doc)
        assert len(inspect.getsource(rule).splitlines()) <= 45, rule.__name__
        assert list(inspect.signature(rule).parameters) == ["ctx"], rule.__name__


def test_report_add_takes_a_constant_not_a_string(tmp_path, llama):
    rep = _report(write_draft(tmp_path / "good", ids=[1, 15, 28]), llama)
    with pytest.raises(TypeError, match="codes.Code constant"):
        rep.add("E_FC_WIDTH", "a message")
    with pytest.raises(TypeError, match="codes.Code constant"):
        rep.add("error", "E_FC_WIDTH", "a message")  # the old (severity, code, message) form
    f = rep.add(codes.W_SLOT_ORDER, "What is wrong.", "What to change.")
    assert rep.findings[-1] is f and f.severity == "warning" and f.text == "What is wrong. What to change."


def _add_calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add":
            yield node


def test_no_doctor_module_adds_a_finding_with_a_string_code():
    """Every ``rep.add`` / ``report.add`` in eagle3_ops/doctor passes a ``codes.X`` constant first, and no ``.add``
    call anywhere in the package passes a severity or a code as a string."""
    report_adds = 0
    for path in sorted((ROOT / "eagle3_ops").rglob("*.py")):
        for call in _add_calls(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{call.lineno}"
            first = call.args[0] if call.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                assert first.value not in codes.SEVERITIES and first.value not in codes.CODES, where
            receiver = call.func.value
            name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", None)
            if path.parent == DOCTOR and name in ("rep", "report"):
                report_adds += 1
                assert isinstance(first, ast.Attribute) and isinstance(first.value, ast.Name) and \
                    first.value.id == "codes" and first.attr in codes.CODES, where
                assert len(call.args) <= 3 and all(k.arg == "fix" for k in call.keywords), where
    assert report_adds >= 70, report_adds


def test_doctor_readers_compare_codes_with_the_constants():
    """Inside eagle3_ops/doctor no code is compared with a string literal (``f.code == "E_..."``)."""
    for path in sorted(DOCTOR.glob("*.py")):
        if path.name == "codes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                for side in [node.left, *node.comparators]:
                    assert not (isinstance(side, ast.Constant) and isinstance(side.value, str)
                                and side.value in codes.CODES), f"{path.name}:{node.lineno}"
