"""docs/sglang_families.md and README's family list are what tests/sglang/families.py generates, and its
registry names real tests of real SGLang EAGLE-3 classes."""
import importlib
import sys
from pathlib import Path

import families


def test_the_families_document_and_readme_list_are_up_to_date():
    assert families.DOC.read_text() == families.document(), "run: python tests/sglang/families.py --write"
    text = families.README.read_text()
    a, b = text.index(families.BEGIN), text.index(families.END) + len(families.END)
    assert text[a:b] == families.readme_block(), "run: python tests/sglang/families.py --write"


def _param_ids(fn):
    ids = set()
    for mark in getattr(fn, "pytestmark", []):
        if mark.name == "parametrize":
            ids.update(str(v) for v in mark.args[1])
            ids.update(str(i) for i in mark.kwargs.get("ids", []) or [])
    return ids


def test_every_registered_test_exists_and_runs_that_class():
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    table = families.table()
    cpu_tests, not_covered, _ = families._registry()
    for cls, node in {**cpu_tests, **families.DRAFT_TESTS}.items():
        path, _, name = node.partition("::")
        func, _, param = name.partition("[")
        module = importlib.import_module(Path(path).stem)
        fn = getattr(module, func, None)
        assert callable(fn), f"{cls}: {node} names no test"
        if param:
            assert param.rstrip("]") in _param_ids(fn), f"{cls}: {func} is not parametrized with {param}"
        known = table["draft_heads"] if cls in families.DRAFT_TESTS else table["targets"]
        assert cls in known and (cls in families.DRAFT_TESTS or known[cls].get("supported")), cls
    for cls in not_covered:
        assert cls in table["targets"] and cls not in cpu_tests, cls


def test_every_family_the_harness_builds_is_registered():
    from eagle3_ops.demos.sglang_cpu_harness import FAMILIES

    assert {f.sglang_class for f in FAMILIES.values()} <= set(families._registry()[0])
