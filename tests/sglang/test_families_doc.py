"""docs/sglang_families.md and the family list in docs/sglang.md are what tests/sglang/families.py generates
(README.md holds no generated block), and its registry names real tests of real SGLang EAGLE-3 classes."""
import importlib
import sys
from pathlib import Path

import families


def test_the_families_document_and_the_sglang_doc_list_are_up_to_date():
    assert families.DOC.read_text() == families.document(), "run: python tests/sglang/families.py --write"
    text = families.SGLANG_DOC.read_text()
    assert text.count(families.BEGIN) == 1 and text.count(families.END) == 1, families.SGLANG_DOC
    a, b = text.index(families.BEGIN), text.index(families.END) + len(families.END)
    assert text[a:b] == families.family_block(), "run: python tests/sglang/families.py --write"
    readme = families.README.read_text()  # generated text goes into docs/, never into README.md
    assert families.BEGIN not in readme and "<!-- families:" not in readme


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


def test_sglang_configures_eagle3_capture_on_the_target_worker_only(monkeypatch):
    """The reason the draft classes (families.draft_classes) need nothing from the plugin, asked of
    SGLang's own resolver: for an EAGLE-3 draft worker it turns no aux hidden-state capture on (for the
    target worker it does, with the draft config's layer ids), so configure_aux_hidden_state_capture,
    which the plugin hooks, never configures a draft."""
    import types

    import sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state as spec_aux
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    eagle3 = SpeculativeAlgorithm.from_string("EAGLE3")
    # the target worker reads the draft checkpoint's config; a stand-in for it (no checkpoint here)
    draft_cfg = types.SimpleNamespace(num_nextn_predict_layers=None, num_hidden_layers=1, num_attention_layers=1,
                                      is_hybrid_swa=False, is_deepseek_v4_arch=False,
                                      hf_config=types.SimpleNamespace(eagle_config={
                                          "eagle_aux_hidden_state_layer_ids": [1, 5, 9]}))
    monkeypatch.setattr(spec_aux.ModelConfig, "from_server_args", staticmethod(lambda *a, **k: draft_cfg))
    monkeypatch.setattr(spec_aux, "get_spec", lambda: types.SimpleNamespace(
        speculative_draft_model_path="/draft", speculative_draft_model_revision=None))
    monkeypatch.setattr(spec_aux, "get_exec", lambda: types.SimpleNamespace(
        features=types.SimpleNamespace(aux_hidden_state_capture=None)))
    resolved = {worker: spec_aux.resolve_spec_aux_hidden_state_config(
        server_args=None, model_config=None, spec_algorithm=eagle3, is_draft_worker=worker == "draft")
        for worker in ("target", "draft")}
    assert resolved["target"].eagle_use_aux_hidden_state is True
    assert resolved["target"].eagle_aux_hidden_state_layer_ids == [1, 5, 9]
    assert resolved["draft"].eagle_use_aux_hidden_state is False
    assert resolved["draft"].eagle_aux_hidden_state_layer_ids is None


def test_draft_classes_are_drafts_and_no_tested_target_is_one():
    drafts = families.draft_classes()
    cpu_tests = families._registry()[0]
    assert "LlamaForCausalLMEagle" in drafts and "DeepseekV3ForCausalLMNextN" in drafts
    assert not set(drafts) & set(cpu_tests), sorted(set(drafts) & set(cpu_tests))
