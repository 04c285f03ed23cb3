"""The doctor with --engine vllm on targets vLLM 0.33.0 serves through its Transformers backend, and on targets
its registry does not name: a slot verdict from the backend's own capture code, and never an empty class name.

Olmo2ForCausalLM is one of the architectures vLLM 0.33.0's registry maps to the Transformers backend
(``_TRANSFORMERS_SUPPORTED_MODELS``: ``("transformers", "TransformersForCausalLM")``); its rules come from
``transformers/base.py`` (``Base.set_aux_hidden_state_layers`` records the output of ``self._layer_names[layer - 1]``,
``get_eagle3_default_aux_hidden_state_layers`` returns ``(2, L//2, L-3)``), as the pinned table records them.
"""
from __future__ import annotations

import re

from doctor_fixtures import codes, finding, run_doctor, write_draft, write_target
from eagle3_ops.doctor import tables

L = 16


def doctor(draft, target, *extra):
    rc, rep, err = run_doctor("--draft", draft, "--target", target, "--engine", "vllm", *extra)
    assert rep is not None, err
    return rc, rep


def no_empty_names(rep):
    """No message names an empty class or architecture (``for  are``, ``to  (``, ``[]`` left as a name)."""
    for f in rep["findings"]:
        assert not re.search(r"\s{2}|\(\s*\)|\bfor\s+are\b", f["message"]), (f["code"], f["message"])


def test_a_transformers_backend_target_gets_a_slot_verdict(tmp_path):
    assert tables.load("vllm")["targets"]["Olmo2ForCausalLM"]["registry"] == "_TRANSFORMERS_SUPPORTED_MODELS"
    t = write_target(tmp_path / "olmo2", model_type="olmo2", num_layers=L, architectures=["Olmo2ForCausalLM"])
    # trained on the outputs of layers 2, 8, 13 (eagle_config, SpecForge); vLLM's V2 runner reads the top-level
    # ids as boundaries: [3, 9, 14] are the same states, each the output of layer id - 1 (self._layer_names)
    d = write_draft(tmp_path / "d", ids=[2, 8, 13], top_ids=[3, 9, 14])
    rc, rep = doctor(d, t)
    assert rc == 0, codes(rep)
    assert rep["engine"]["class"] == "transformers.TransformersForCausalLM"
    assert [s["capture_index"] for s in rep["slots"]] == [3, 9, 14] and all(s["match"] for s in rep["slots"])
    # the same ids one layer early: a slot verdict, not "unknown"
    d2 = write_draft(tmp_path / "d2", ids=[2, 8, 13], top_ids=[2, 8, 13])
    rc, rep2 = doctor(d2, t)
    assert rc == 1 and "E_CONVENTION_MISMATCH" in codes(rep2, "error") and "[3, 9, 14]" in \
        finding(rep2, "E_CONVENTION_MISMATCH")["message"]
    assert "Olmo2ForCausalLM" in finding(rep, "I_ENGINE_CODE")["message"]
    assert "not in vLLM" not in " ".join(f["message"] for f in rep["findings"])
    no_empty_names(rep)


def test_transformers_backend_raises_for_ids_it_has_no_layer_for(tmp_path):
    """Base.set_aux_hidden_state_layers looks id k up as self._layer_names[k - 1]: id 0 (layer -1) and id L + 1
    have no key (KeyError at start-up), where vLLM's own models skip them."""
    t = write_target(tmp_path / "olmo2", model_type="olmo2", num_layers=L, architectures=["Olmo2ForCausalLM"])
    for ids in ([0, 8, 13], [2, 8, L + 1]):
        d = write_draft(tmp_path / f"d{ids[0]}", ids=ids, top_ids=ids)
        rc, rep = doctor(d, t)
        msg = finding(rep, "E_ENGINE_RAISES")["message"]
        assert rc == 1 and "KeyError" in msg and "self._layer_names[layer - 1]" in msg, msg
        no_empty_names(rep)


def test_transformers_backend_feeds_the_ids_in_the_order_written(tmp_path):
    """Base.set_aux_hidden_state_layers adds one recorder per id, in the order the ids are written (vLLM's own
    decoders sort them): ids [14, 3, 9] feed slot 0 the output of layer 13, so a draft trained on [3, 9, 14]
    in that order is miswired (an error with the ids that fix it), where a native vLLM class only reorders."""
    trained = dict(ids=[2, 8, 13])  # eagle_config: the outputs of layers 2, 8, 13 = boundaries 3, 9, 14
    t = write_target(tmp_path / "olmo2", model_type="olmo2", num_layers=L, architectures=["Olmo2ForCausalLM"])
    rc, rep = doctor(write_draft(tmp_path / "d", top_ids=[14, 3, 9], **trained), t)
    assert [s["capture_index"] for s in rep["slots"]] == [14, 3, 9] and not any(s["match"] for s in rep["slots"])
    msg = finding(rep, "E_WIRING_MISMATCH")["message"]
    assert rc == 1 and "W_SLOT_ORDER" not in codes(rep) and "to [3, 9, 14]" in msg, msg
    # a repeated id is one recorder (one key), kept at its first place
    rc, rep = doctor(write_draft(tmp_path / "d2", top_ids=[9, 3, 9], **trained), t)
    assert [s["capture_index"] for s in rep["slots"]] == [9, 3, None] and "E_DUPLICATE_CAPTURE" in codes(rep)
    # the same ids on a class vLLM serves with its own decoder: captured in layer order, the right states
    lt = write_target(tmp_path / "llama", model_type="llama", num_layers=L, architectures=["LlamaForCausalLM"])
    rc, rep = doctor(write_draft(tmp_path / "d3", top_ids=[14, 3, 9], **trained), lt)
    assert [s["capture_index"] for s in rep["slots"]] == [3, 9, 14] and "W_SLOT_ORDER" in codes(rep)


def test_the_written_order_is_what_transformers_returns():
    """The fact behind ``capture_order: written``, checked on the installed transformers: recorders added the way
    vLLM 0.33.0's Base.set_aux_hidden_state_layers adds them (an OutputRecorder on the output of layer id - 1,
    keyed by the id, for layer in layers) come back in the order the ids were written, a repeated id once."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaModel
    from transformers.utils.output_capturing import OutputRecorder, maybe_install_capturing_hooks

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=100)
    class Recorded(LlamaModel):  # vLLM adds to the class's dict (transformers registers it per class): a copy
        _can_record_outputs = dict(LlamaModel._can_record_outputs or {})

    torch.manual_seed(0)
    model = Recorded(cfg).eval()
    ids = torch.arange(5)[None]
    reference = copy.deepcopy(model)(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    flags = {}
    for layer in (4, 1, 3, 4):
        key = f"aux_hidden_state_{layer}"
        model._can_record_outputs[key] = OutputRecorder(type(model.layers[0]), layer_name=f"layers.{layer - 1}")
        flags[f"output_{key}"] = True
    maybe_install_capturing_hooks(model)
    out = model(input_ids=ids, use_cache=False, return_dict=False, **flags)
    got = [x[0][0] for x in out[1:]]  # vLLM: aux_hidden_states = [x[0][0, ...] for x in outputs[1:]]
    boundaries = [[b for b in range(len(reference)) if torch.equal(g, reference[b][0])] for g in got]
    assert boundaries == [[4], [1], [3]], boundaries


def test_an_unregistered_architecture_falls_back_to_the_transformers_backend(tmp_path):
    """An architecture vLLM's registry does not name: vLLM tries its Transformers backend (named by
    ModelConfig._get_transformers_backend_cls); whether transformers has a compatible class the doctor cannot
    check, so support is unverified, but the slot verdict follows the backend's code and every name is there."""
    t = write_target(tmp_path / "x", model_type="llama", num_layers=L, architectures=["NoSuchModelForCausalLM"])
    d = write_draft(tmp_path / "d", ids=[2, 8, 13], top_ids=[3, 9, 14])
    rc, rep = doctor(d, t)
    msg = finding(rep, "W_TARGET_SUPPORT_UNVERIFIED")["message"]
    assert "NoSuchModelForCausalLM" in msg and "TransformersForCausalLM" in msg
    assert "_get_transformers_backend_cls" in msg
    assert rep["engine"]["class"] == "transformers.TransformersForCausalLM"
    assert [s["capture_index"] for s in rep["slots"]] == [3, 9, 14] and rc == 0, codes(rep)
    no_empty_names(rep)


def test_no_empty_class_name_without_architectures(tmp_path):
    """A target config without architectures: the doctor says so instead of printing an empty class name
    (it used to say "default ids for  are not in its table")."""
    from eagle3_ops.doctor import rules
    from eagle3_ops.doctor.configs import target_from_config

    t = target_from_config({"model_type": "llama", "architectures": [], "num_hidden_layers": L, "hidden_size": 64,
                            "num_attention_heads": 4, "vocab_size": 128})
    r = rules.target_rules("vllm", t)
    assert r.arch and r.class_name and "no architectures" in r.refusal
    assert "for the target (its config.json lists no architectures)" in r.map_ids(None, L).unknown
    # a draft without architectures: both engines say so (no "resolves [] to  (")
    dt = write_target(tmp_path / "llama", model_type="llama", num_layers=L)
    d = write_draft(tmp_path / "d", ids=[2, 8, 13], top_ids=[2, 8, 13], extra={"architectures": []})
    for engine in ("sglang", "vllm"):
        rc, rep, err = run_doctor("--draft", d, "--target", dt, "--engine", engine)
        assert rep is not None, err
        assert "lists no architectures" in finding(rep, "E_DRAFT_CLASS")["message"], engine
        no_empty_names(rep)


def _wrapper(path, arch):
    """A multimodal target whose language model vLLM builds from text_config.architectures (Olmo2: the
    Transformers backend)."""
    import json

    text = {"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], "num_hidden_layers": L, "hidden_size": 16,
            "vocab_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 32}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llava", "architectures": [arch],
                                                  "text_config": text}))
    return path


def test_a_wrapper_over_a_transformers_backend_language_model(tmp_path):
    """Pixtral hands the ids to its language model's own setter: the Transformers backend's written order and
    its KeyError for id 0 hold through the wrapper. Llava keeps SupportsEagle3's setter, which asserts that
    language_model.model is one of vLLM's decoders (EagleModelMixin): vLLM stops at start-up."""
    trained = dict(ids=[2, 8, 13])
    rows = tables.load("vllm")["targets"]
    assert rows["PixtralForConditionalGeneration"]["set_aux_hidden_state_layers"] == "PixtralForConditionalGeneration"
    assert rows["LlavaForConditionalGeneration"]["set_aux_hidden_state_layers"] == "SupportsEagle3"
    pixtral = _wrapper(tmp_path / "pixtral", "PixtralForConditionalGeneration")
    rc, rep = doctor(write_draft(tmp_path / "d", top_ids=[14, 3, 9], **trained), pixtral)
    assert [s["capture_index"] for s in rep["slots"]] == [14, 3, 9] and "E_WIRING_MISMATCH" in codes(rep), codes(rep)
    rc, rep = doctor(write_draft(tmp_path / "d0", top_ids=[0, 8, 13], **trained), pixtral)
    assert "KeyError" in finding(rep, "E_ENGINE_RAISES")["message"]
    rc, rep = doctor(write_draft(tmp_path / "d1", top_ids=[3, 9, 14], **trained), _wrapper(tmp_path / "llava",
                                                                                          "LlavaForConditionalGeneration"))
    text = " ".join(f["message"] for f in rep["findings"] if f["severity"] == "error")
    assert rc == 1 and "EagleModelMixin" in text and "AssertionError" in text, codes(rep)
    no_empty_names(rep)
