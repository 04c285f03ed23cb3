"""The pinned engine tables are what the engines' code says, and the doctor says which source it used.

- The committed SGLang table equals what the installed SGLang (the pinned 0.5.23, a test dependency)
  says for every class of its registry: a new SGLang release shows up here as a failing test (rerun
  ``python -m eagle3_ops.doctor.tables.generate sglang``), not as a wrong answer.
- The table's rule for a class is what the class's own code does with ids the probes never used.
- With SGLang absent or another version, the doctor reads the table and says so.
- The README's rule table is rendered from the same data.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from eagle3_ops.doctor import rules, sglang_code, source_scan, tables, vllm_code
from eagle3_ops.doctor.configs import target_from_config

ROOT = Path(__file__).resolve().parents[2]


def _strip(t: dict) -> dict:
    return {k: v for k, v in t.items() if not k.startswith("generated_")}


def test_committed_sglang_table_is_what_the_installed_sglang_says():
    assert sglang_code.installed_version() == tables.PINNED["sglang"], "the test venv must hold the pinned SGLang"
    committed = json.loads(tables.table_path("sglang").read_text())
    live = json.loads(tables.dumps(sglang_code.table()))  # the same JSON round trip as the committed file
    assert set(live["targets"]) == set(committed["targets"]), "ModelRegistry classes changed"
    for arch, row in live["targets"].items():
        assert row == committed["targets"][arch], arch
    assert _strip(live) == _strip(committed)
    assert set(live["draft_heads"]) == {"LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"}


def _target(arch, num_layers=32, **extra):
    return target_from_config(dict({"model_type": "llama", "architectures": [arch], "num_hidden_layers": num_layers,
                                    "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128}, **extra))


@pytest.mark.parametrize("arch,L", [("LlamaForCausalLM", 32), ("DeepseekV3ForCausalLM", 61), ("GptOssForCausalLM", 36),
                                    ("Qwen3MoeForCausalLM", 48), ("Gemma4ForCausalLM", 30),
                                    ("Qwen3NextForCausalLM", 48)])
def test_table_rule_agrees_with_the_class_on_fresh_ids(arch, L):
    """Ids none of the table's probes used, fresh per class: the table's named rule gives what the class's own
    set_eagle3_layers_to_capture sets (or raises), run on the stand-in."""
    import random

    t = _target(arch, L)
    live = rules.target_rules("sglang", t, "installed")
    table = rules.target_rules("sglang", t, "table")
    assert live.supported and table.supported and table.source.startswith("pinned table")
    rng = random.Random(arch)
    for _ in range(12):
        ids = sorted(rng.sample(range(-1, L), 3))
        if rng.random() < 0.3:
            ids[0] = 1
        if rng.random() < 0.2:
            ids[-1] = L
        a, b = live.map_ids(ids, L), table.map_ids(ids, L)
        assert (a.error is None) == (b.error is None), (arch, ids, a, b)  # both raise at start-up, or neither
        if a.error is None:
            assert a.config_order == b.config_order, (arch, ids, a, b)
    assert live.map_ids(None, L).config_order == table.map_ids(None, L).config_order


def test_the_doctor_says_which_sglang_it_used(monkeypatch):
    t = _target("LlamaForCausalLM")
    assert "the installed SGLang 0.5.23" in rules.target_rules("sglang", t, "auto").source
    monkeypatch.setattr(sglang_code, "installed_version", lambda: "0.5.24")
    r = rules.target_rules("sglang", _target("LlamaForCausalLM"), "auto")
    assert r.source == "pinned table tables/sglang-0.5.23.json (the installed SGLang is 0.5.24, not the pinned 0.5.23)"
    assert r.supported and r.rule_key == "id+1"
    monkeypatch.setattr(sglang_code, "installed_version", lambda: None)
    r = rules.target_rules("sglang", _target("LlamaForCausalLM"), "auto")
    assert "SGLang is not installed" in r.source
    from eagle3_ops.doctor.configs import DoctorInputError

    with pytest.raises(DoctorInputError, match="--engine-code installed: SGLang is not installed"):
        rules.target_rules("sglang", _target("LlamaForCausalLM"), "installed")


def test_unknown_architecture_is_refused_with_the_transformers_fallback():
    for code in ("installed", "table"):
        r = rules.target_rules("sglang", _target("NoSuchModelForCausalLM"), code)
        assert r.supported is False and "Transformers" in r.refusal, (code, r)


def test_vllm_table_is_from_the_pinned_wheel():
    t = tables.load("vllm")
    assert t["version"] == "0.33.0" and "vllm-0.33.0" in t["generated_from"] and "not imported" in t["generated_from"]
    rows = t["targets"]
    # eagle3_utils.set_eagle3_aux_hidden_state_layers refuses classes without SupportsEagle3
    assert rows["LlamaForCausalLM"]["supported"] and not rows["Gemma3ForCausalLM"]["supported"]
    assert {c["boundary"] for c in rows["LlamaForCausalLM"]["capture"]} == {"start", "after"}
    assert t["ids"]["v2"]["reads"][0] == "eagle_aux_hidden_state_layer_ids"
    assert "eagle_config.eagle_aux_hidden_state_layer_ids" in t["ids"]["v1"]["reads"]
    assert "eagle_config.eagle_aux_hidden_state_layer_ids" not in t["ids"]["v2"]["reads"]
    assert t["draft_rename"]["rule"] == "prefix-Eagle3"


def test_vllm_capture_sites_are_read_from_the_decoder_loop():
    """The classifier on the two loop shapes vLLM 0.33.0 uses (llama's helper calls, deepseek's inline test)."""
    llama = '''def forward(self, h, residual, aux):
    self._maybe_add_hidden_state(aux, self.start_layer, h, residual)
    for idx, layer in enumerate(self.layers, start=self.start_layer):
        h, residual = layer(h, residual)
        self._maybe_add_hidden_state(aux, idx + 1, h, residual)
'''
    deepseek = '''def forward(self, h, residual, aux):
    for idx, layer in enumerate(self.layers):
        if idx in self.aux_hidden_state_layers:
            aux.append(hidden_states + residual)
        h, residual = layer(h, residual)
    if self.end_layer in self.aux_hidden_state_layers:
        aux.append(hidden_states + residual)
'''
    assert {c["boundary"] for c in vllm_code.capture_sites([llama])} == {"start", "after"}
    sites = {c["boundary"]: c["value"] for c in vllm_code.capture_sites([deepseek])}
    assert sites == {"entry": "hidden+residual-unguarded", "end": "hidden+residual-unguarded"}


def test_sglang_capture_sites_tell_residual_from_branch_output():
    """SGLang 0.5.23's Gemma3TextModel appends hidden_states while its loop carries the residual apart: the
    classifier must call that 'hidden-only', and a capture handed to the layer boundary 'layer-boundary'."""
    gemma3 = '''def forward(self, hidden_states, residual=None):
    for i, layer in enumerate(self.layers):
        if i in self.layers_to_capture:
            aux_hidden_states.append(hidden_states)
        hidden_states, residual = layer(hidden_states=hidden_states, residual=residual)
    if num_layers in self.layers_to_capture:
        aux_hidden_states.append(hidden_states)
    hidden_states, _ = self.norm(hidden_states, residual)
'''
    llama = '''def forward(self, hidden_states):
    for i in range(self.start_layer, self.end_layer):
        hidden_states = self.layers[i](hidden_states,
                                       capture_output=aux.capture if i in self.layers_to_capture else None)
'''
    s = {x["where"]: x["value"] for x in source_scan.capture_sites([gemma3])}
    assert s == {"entry": "hidden-only", "after-loop": "hidden-only"}
    assert [(x["where"], x["value"]) for x in source_scan.capture_sites([llama])] == [("entry", "layer-boundary")]
    # and on the installed source itself
    row = tables.load("sglang")["targets"]["Gemma3ForCausalLM"]
    assert row["capture"]["entry"] == "hidden-only" and row["capture"]["final"] == "after-loop"


def test_readme_rule_table_is_rendered_from_the_tables():
    from eagle3_ops.doctor.tables.readme import BEGIN, END, render

    text = (ROOT / "README.md").read_text()
    block = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    assert block is not None, "README has no generated rule table"
    assert block.group(1) == render().strip("\n"), "rerun: python -m eagle3_ops.doctor.tables.readme --write"
