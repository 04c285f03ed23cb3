"""The pinned engine tables are what the engines' code says, and the doctor says which source it used.

- The committed SGLang table equals what the installed SGLang (the pinned 0.5.23, a test dependency)
  says for every class of its registry: a new SGLang release shows up here as a failing test (rerun
  ``python -m tools.engine_tables sglang``), not as a wrong answer.
- The table's rule for a class is what the class's own code does with ids the probes never used.
- With SGLang absent or another version, the doctor reads the table and says so.
- The rule table in docs/doctor.md is rendered from the same data (tools/doctor_rule_table.py; README.md holds
  no generated block).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from eagle3_ops.doctor import rules, sglang_code, source_reader, source_scan, tables
from tools import vllm_tables
from tools.engine_tables import sglang_table
from eagle3_ops.doctor.configs import target_from_config
from machine import needs_sglang

ROOT = Path(__file__).resolve().parents[2]


def _strip(t: dict) -> dict:
    return {k: v for k, v in t.items() if not k.startswith("generated_")}


@needs_sglang
def test_committed_sglang_table_is_what_the_installed_sglang_says():
    assert sglang_code.installed_version() == tables.PINNED["sglang"], "the test venv must hold the pinned SGLang"
    committed = json.loads(tables.table_path("sglang").read_text())
    live = json.loads(tables.dumps(sglang_table()))  # the same JSON round trip as the committed file
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
@needs_sglang
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


@needs_sglang
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


@needs_sglang
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
    assert {c["boundary"] for c in vllm_tables.capture_sites([llama])} == {"start", "after"}
    sites = {c["boundary"]: c["value"] for c in vllm_tables.capture_sites([deepseek])}
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


def test_the_docs_rule_table_is_rendered_from_the_tables():
    """The rule table lives in docs/doctor.md (generated text goes into docs/, never into README.md)."""
    from tools.doctor_rule_table import BEGIN, DOC, END, render

    assert DOC == ROOT / "docs" / "doctor.md"
    text = DOC.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, DOC
    block = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    assert block is not None, "docs/doctor.md has no generated rule table"
    assert block.group(1) == render().strip("\n"), "rerun: python -m tools.doctor_rule_table --write"
    readme = (ROOT / "README.md").read_text()
    assert "<!-- doctor-rules:" not in readme and "| id -> boundary |" not in readme


# ------------------------------------------------------------------------------------- vLLM's whole registry
def test_vllm_table_covers_every_registry_architecture():
    """The table records the registry dicts registry.py merges into _VLLM_MODELS, as read from the wheel; every
    architecture of every one of them has a target row, from the dict whose entry wins the merge (a later dict
    wins), and nothing in a dict went unread. The Transformers-backend mappings are among them."""
    t = tables.load("vllm")
    reg, rows = t["registry"], t["targets"]
    assert reg["merged_into"] == "_VLLM_MODELS" and reg["unread"] == {}, reg["unread"]
    assert set(reg["order"]) == set(reg["dicts"]) and len(reg["dicts"]) > 2
    winner = {}
    for name in reg["order"]:
        assert reg["dicts"][name], name
        for arch in reg["dicts"][name]:
            winner[arch] = name
    missing = sorted(a for a in winner if a not in rows)
    assert not missing, missing
    assert set(rows) == set(winner)
    assert all(rows[a]["registry"] == d for a, d in winner.items())
    # the branch the table used to miss: architectures served by the Transformers backend package
    backend = {a for a, r in rows.items() if r["class"].startswith("transformers.")}
    assert backend and any(all(a in backend for a in reg["dicts"][d]) for d in reg["order"])


def test_vllm_transformers_backend_rows_come_from_its_code():
    """Olmo2ForCausalLM is registered to vLLM's Transformers backend (transformers.TransformersForCausalLM): the
    row says what that backend's own code does. Base implements SupportsEagle3, its default is
    (2, L//2, L-3), and set_aux_hidden_state_layers records the output of self._layer_names[layer - 1] (the
    boundary the id names), a dict of the decoder layers' indices, so an id outside 1..L has no key."""
    rows = tables.load("vllm")["targets"]
    row = rows["Olmo2ForCausalLM"]
    assert row["class"] == "transformers.TransformersForCausalLM" and row["supported"] is True
    assert row["default"] == "(2, num_layers // 2, num_layers - 3)" and row["default_from"] == "Base"
    assert row["capture"] == [{"boundary": "after", "index": "layer - 1", "value": "layer-output"}]
    assert row["id_lookup"]["offset"] == 1 and "int(child_name)" in row["id_lookup"]["keys_from"]
    r = rules.target_rules("vllm", _target("Olmo2ForCausalLM", 16))
    assert r.supported and r.class_name == "transformers.TransformersForCausalLM" and r.arch == "Olmo2ForCausalLM"
    assert r.map_ids(None, 16).config_order == [2, 8, 13] and r.map_ids([1, 8, 16], 16).error is None
    assert "KeyError" in r.map_ids([0, 8, 15], 16).error and "KeyError" in r.map_ids([1, 8, 17], 16).error
    assert "id 0" in r.raises_at_zero


SYNTHETIC_REGISTRY = '''
_TEXT_GENERATION_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "FooForCausalLM": ("foo", "FooForCausalLM"),
}
_EMBEDDING_MODELS = {
    "LlamaModel": ("llama", "LlamaForCausalLM"),
    **{k: (mod, arch) for k, (mod, arch) in _TEXT_GENERATION_MODELS.items() if arch == "LlamaForCausalLM"},
}
_TRANSFORMERS_SUPPORTED_MODELS = {
    "FooForCausalLM": ("transformers", "TransformersForCausalLM"),
    "BarForCausalLM": ("transformers", "TransformersForCausalLM"),
}
_ODD_MODELS = {
    "Odd": make_entry(),
}
_VLLM_MODELS = {
    **_TEXT_GENERATION_MODELS,
    **_EMBEDDING_MODELS,
    **_TRANSFORMERS_SUPPORTED_MODELS,
    **_ODD_MODELS,
}
_NOT_MERGED = {"X": ("x", "X")}
'''


def test_vllm_registry_reader_on_a_synthetic_registry():
    """The generator's registry reading, without the wheel: every dict _VLLM_MODELS merges, in merge order, with
    comprehension spreads evaluated, entries it cannot read recorded (never dropped silently), dicts not merged
    left out."""
    order, dicts, unread = vllm_tables.registry_dicts(SYNTHETIC_REGISTRY)
    assert order == ["_TEXT_GENERATION_MODELS", "_EMBEDDING_MODELS", "_TRANSFORMERS_SUPPORTED_MODELS", "_ODD_MODELS"]
    assert list(dicts["_EMBEDDING_MODELS"]) == ["LlamaModel", "LlamaForCausalLM", "MistralForCausalLM"]
    assert dicts["_TRANSFORMERS_SUPPORTED_MODELS"]["FooForCausalLM"] == ("transformers", "TransformersForCausalLM")
    assert unread == {"_ODD_MODELS": ["'Odd'"]} and dicts["_ODD_MODELS"] == {}
    assert "_NOT_MERGED" not in dicts


def _tree(tmp_path, files: dict):
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


M = "vllm/model_executor/models/"
SYNTHETIC_MODELS = {
    "vllm/_version.py": "__version__ = version = '9.9.9'\n",
    M + "registry.py": SYNTHETIC_REGISTRY + '''
_SPECULATIVE_DECODING_MODELS = {"Eagle3LlamaForCausalLM": ("llama_eagle3", "Eagle3LlamaForCausalLM")}
_VLLM_MODELS = {**_TEXT_GENERATION_MODELS, **_TRANSFORMERS_SUPPORTED_MODELS, **_SPECULATIVE_DECODING_MODELS}
''',
    M + "interfaces.py": '''
class SupportsEagle3:
    def get_eagle3_default_aux_hidden_state_layers(self):
        return (2, num_layers // 2, num_layers - 3)
''',
    M + "llama.py": '''
from torch import nn
from .interfaces import SupportsEagle3
from vllm.model_executor.layers.linear import ColumnLinear


class LlamaMLP(nn.Module):
    def __init__(self, hidden, inter, bias=False):
        super().__init__()
        self.gate_up_proj = ColumnLinear(hidden, 2 * inter, bias=bias)
        self.down_proj = ColumnLinear(inter, hidden, bias=bias)


class LlamaModel(nn.Module):
    def forward(self, h, residual, aux):
        self._maybe_add_hidden_state(aux, self.start_layer, h, residual)
        for idx, layer in enumerate(self.layers, start=self.start_layer):
            h, residual = layer(h, residual)
            self._maybe_add_hidden_state(aux, idx + 1, h, residual)


class LlamaForCausalLM(nn.Module, SupportsEagle3):
    def __init__(self, config):
        self.model = LlamaModel(config)
''',
    M + "foo.py": '''
class FooForCausalLM:
    pass
''',
    "vllm/model_executor/layers/linear.py": '''
from torch import nn


class UnquantizedLinearMethod:
    def create_weights(self, layer, *args):
        layer.register_parameter("weight", make())


class LinearBase(nn.Module):
    def __init__(self, quant_config=None):
        super().__init__()
        if quant_config is None:
            self.quant_method = UnquantizedLinearMethod()


class ColumnLinear(LinearBase):
    def __init__(self, i, o, bias=True, quant_config=None):
        super().__init__(quant_config)
        self.quant_method.create_weights(layer=self)
        if bias:
            self.bias = nn.Parameter(make())
        else:
            self.register_parameter("bias", None)
''',
    M + "transformers/__init__.py": '''
from vllm.model_executor.models.transformers.base import Base


class TransformersForCausalLM(Base): ...
''',
    M + "transformers/base.py": '''
from torch import nn
from vllm.model_executor.models.interfaces import SupportsEagle3


class Base(nn.Module, SupportsEagle3):
    def recursive_replace(self):
        for child_name, child in module.named_children():
            self._layer_names[int(child_name)] = child_name

    def set_aux_hidden_state_layers(self, layers):
        for layer in layers:
            layer_name = self._layer_names[layer - 1]
            recorder = OutputRecorder(self._target_class, layer_name=layer_name)

    def get_eagle3_default_aux_hidden_state_layers(self):
        return (2, num_layers // 2, num_layers - 3)
''',
    M + "llama_eagle3.py": '''
from typing import TYPE_CHECKING
from torch import nn
from vllm.model_executor.models.llama import LlamaMLP, LlamaForCausalLM
from vllm.model_executor.layers.linear import ColumnLinear

if TYPE_CHECKING:
    class _Base(nn.Module):
        pass
else:
    _Base = LlamaForCausalLM


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.qkv_proj = ColumnLinear(2, 3, bias=False)
        self.mlp = LlamaMLP(2, 4)
        self.extra = ColumnLinear(2, 3, bias=False) if config.extra else None


class Eagle3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(config, layer_idx=i) for i in range(config.num_hidden_layers)])

    def load_weights(self, weights):
        stacked_params_mapping = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k")]
        for name, w in weights:
            name = name.replace("midlayer.", "layers.0.")


class Eagle3LlamaForCausalLM(_Base):
    def __init__(self, *, config):
        nn.Module.__init__(self)
        self.model = Eagle3Model(config)

    def load_weights(self, weights):
        for name, w in weights:
            name = "model." + name
''',
}


def test_vllm_generator_on_synthetic_sources(tmp_path):
    """vllm_tables.table on a small source tree (no wheel): the merged registry's every architecture gets a row, a
    registry entry naming the Transformers backend package resolves to its class there (transformers/__init__.py)
    and its captures are read from Base.set_aux_hidden_state_layers; a draft head's layer tensors come from its
    __init__ chain (ModuleList element 0, a linear layer's create_weights, a base named through the runtime side
    of TYPE_CHECKING) and its load_weights' name mapping."""
    t = vllm_tables.table(_tree(tmp_path, SYNTHETIC_MODELS))
    assert t["version"] == "9.9.9" and t["registry"]["unread"] == {}
    assert set(t["targets"]) == {"LlamaForCausalLM", "MistralForCausalLM", "FooForCausalLM", "BarForCausalLM",
                                 "Eagle3LlamaForCausalLM"}
    foo = t["targets"]["FooForCausalLM"]  # the later dict wins the merge: the backend, not foo.FooForCausalLM
    assert foo["registry"] == "_TRANSFORMERS_SUPPORTED_MODELS"
    assert foo["class"] == "transformers.TransformersForCausalLM"
    assert foo["supported"] and foo["capture"][0]["boundary"] == "after" and foo["id_lookup"]["offset"] == 1
    assert "OutputRecorder" in foo["captured_by"]
    # its loop walks the ids as written (one recorder each); vLLM's own decoders sort them
    assert foo["capture_order"] == "written" and "capture_order" not in t["targets"]["LlamaForCausalLM"]
    assert t["targets"]["LlamaForCausalLM"]["capture"][0]["boundary"] in ("start", "after")
    assert t["targets"]["Eagle3LlamaForCausalLM"]["supported"] is False  # a draft registration, not a target
    params = t["draft_heads"]["Eagle3LlamaForCausalLM"]["layer"]["params"]
    assert params["model.layers.0.qkv_proj.weight"] == {"from": ["k_proj.weight", "q_proj.weight", "qkv_proj.weight"],
                                                        "conditional": False}
    assert params["model.layers.0.mlp.gate_up_proj.weight"]["conditional"] is False
    assert params["model.layers.0.extra.weight"]["conditional"] is True  # built only `if config.extra`
    assert not any(p.endswith(".bias") for p in params)  # bias=False: register_parameter("bias", None)
    layer = t["draft_heads"]["Eagle3LlamaForCausalLM"]["layer"]
    fit = source_reader.layer_fit(layer, ["q_proj.weight", "k_proj.weight", "mlp.gate_up_proj.weight",
                                      "mlp.down_proj.weight"])
    assert fit["fits"], fit
    fit = source_reader.layer_fit(layer, ["q_proj.weight", "k_proj.weight", "mlp.router.weight",
                                          "mlp.down_proj.weight"])
    assert not fit["fits"] and fit["unloaded"] == ["mlp.router.weight"]
    assert fit["missing"] == ["model.layers.0.mlp.gate_up_proj.weight"]


def test_draft_head_layers_are_read_from_each_engines_code():
    """Each engine table records, per EAGLE-3 head, the checkpoint tensors its load_weights loads into its decoder
    layer: SGLang's llama head takes q/k/v through its stacked mapping into qkv_proj, its MLA head takes q_a_proj
    and kv_a_proj_with_mqa into fused_qkv_a_proj_with_mqa (its load_weights' replace calls), and neither loads a
    MoE MLP; vLLM's heads likewise (the Qwen3 head also needs q_norm / k_norm)."""
    sg = tables.load("sglang")["draft_heads"]
    llama = sg["LlamaForCausalLMEagle3"]["layer"]["params"]
    assert set(llama["model.layers.0.self_attn.qkv_proj.weight"]["from"]) >= {"self_attn.q_proj.weight",
                                                                             "self_attn.k_proj.weight",
                                                                             "self_attn.v_proj.weight"}
    mla = sg["Eagle3DeepseekV2ForCausalLM"]["layer"]["params"]
    fused = mla["model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight"]
    assert {"self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"} <= set(fused["from"])
    assert not fused["conditional"] and not mla["model.midlayer.self_attn.kv_b_proj.weight"]["conditional"]
    vl = tables.load("vllm")["draft_heads"]
    qwen3 = vl["Eagle3Qwen3ForCausalLM"]["layer"]["params"]
    assert not qwen3["model.layers.0.self_attn.q_norm.weight"]["conditional"]
    for t in (sg, vl):
        for name, head in t.items():
            accepted = {n for p in head["layer"]["params"].values() for n in p["from"]}
            assert accepted and not any("experts" in n or "router" in n for n in accepted), name
