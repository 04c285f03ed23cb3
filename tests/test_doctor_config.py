"""Wiring doctor, config + weight-header checks: every fault class gives an error, and a paired
correct config passes. Hand-written configs; target: 32 layers (Llama-3.1-8B-like numbering)."""
from __future__ import annotations

import json

import pytest
import torch

from doctor_fixtures import codes, finding, run_doctor, write_draft, write_target
from eagle3_ops.doctor import engines
from eagle3_ops.doctor.configs import parse_draft, parse_target
from machine import needs_sglang

L = 32
# what a speculators-format draft converted for SGLang names as its class (SGLang 0.5.23 cannot load the speculators
# format: "Eagle3Speculator" is not one of its model classes, see test_speculators_format_is_not_an_sglang_draft)
SGL_HEAD = {"architectures": ["LlamaForCausalLMEagle3"]}


@pytest.fixture
def llama(tmp_path):
    return write_target(tmp_path / "llama", model_type="llama", num_layers=L)


def doctor(draft, target, *extra):
    return run_doctor("--draft", draft, "--target", target, *extra)


def assert_clean(rc, rep):
    assert rc == 0, codes(rep)
    assert rep["ok"] is True
    assert codes(rep, "error") == []
    assert all(s["match"] for s in rep["slots"])


# ----------------------------------------------------------------------------- the engine rules
def _table_rules(arch, num_layers=32):
    """SGLang's rules for a target of class ``arch`` as the pinned table states them (no SGLang import)."""
    from eagle3_ops.doctor.configs import target_from_config
    from eagle3_ops.doctor.rules import target_rules

    t = target_from_config({"model_type": "llama", "architectures": [arch], "num_hidden_layers": num_layers,
                            "hidden_size": 16, "num_attention_heads": 2, "vocab_size": 128})
    return target_rules("sglang", t, "table")


def test_pipeline_stage_ranges():
    assert engines.pp_stage_ranges(32, 2) == [(0, 16), (16, 32)]
    assert engines.pp_stage_ranges(10, 3) == [(0, 3), (3, 6), (6, 10)]  # extra layers go to the last stages


@needs_sglang
def test_table_rules_match_the_installed_sglang_classes():
    """The pinned table's rule for each class gives what that class's own set_eagle3_layers_to_capture sets, run
    here on a plain SimpleNamespace (not the doctor's stand-in): the table is not a copy that can drift unseen."""
    import types

    from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM
    from sglang.srt.models.gpt_oss import GptOssForCausalLM
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM

    def run(cls, ids, n):
        holder = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True),
                                       capture_aux_hidden_states=False,
                                       config=types.SimpleNamespace(num_hidden_layers=n),
                                       model=types.SimpleNamespace(layers_to_capture=[]))
        cls.set_eagle3_layers_to_capture(holder, ids)
        return list(holder.model.layers_to_capture)

    cases = [(LlamaForCausalLM, 32, ([1, 15, 28], [0, 5, 9], [-1, 3, 31], None)),
             (Qwen3ForCausalLM, 32, ([1, 15, 28], [3, 10, 20], None)),
             (DeepseekV3ForCausalLM, 61, ([1, 29, 57], [2, 30, 58], [-1, 2, 30], None)),
             (GptOssForCausalLM, 36, ([1, 17, 36], [1, 17, 33], [24, 30, 36], None))]
    for cls, n, idss in cases:
        rules = _table_rules(cls.__name__, n)
        for ids in idss:
            assert rules.map_ids(ids, n).config_order == run(cls, ids, n), (cls.__name__, ids)


# ----------------------------------------------------------------------------- correct configs
@pytest.mark.parametrize("engine", ["sglang", "vllm", "trtllm"])
def test_correct_configs_pass_on_every_engine(tmp_path, llama, engine):
    # SpecForge ids for SGLang/TRT-LLM ("output of layer k"); the same draft carries the vLLM spelling at top level.
    d = write_draft(tmp_path / "d", ids=[1, 15, 28], top_ids=[2, 16, 29])
    rc, rep = doctor(d, llama, "--engine", engine)[:2]
    assert_clean(rc, rep)
    assert [s["capture_index"] for s in rep["slots"]] == [2, 16, 29]


def test_eagle_original_uses_defaults(tmp_path, llama):
    d = write_draft(tmp_path / "d", dialect="eagle-original")
    for engine in ("sglang", "vllm", "trtllm"):
        rc, rep = doctor(d, llama, "--engine", engine)[:2]
        assert_clean(rc, rep)
        assert [s["capture_index"] for s in rep["slots"]] == [2, 16, 29]
        assert "I_ENGINE_DEFAULT" in codes(rep)


def test_speculators_dialect_parsed(tmp_path, llama):
    d = write_draft(tmp_path / "d", dialect="speculators", ids=[2, 16, 29],
                    extra={"norm_before_fc": True, "fc_norm": False})
    info = parse_draft(d)
    assert info.dialect == "speculators" and info.top_ids == [2, 16, 29] and info.norm_before_fc
    assert info.hidden_size == 16 and info.vocab_size == 128  # from transformer_layer_config
    rc, rep = doctor(d, llama, "--engine", "vllm")[:2]
    assert_clean(rc, rep)


def test_speculators_format_is_not_an_sglang_draft(tmp_path, llama):
    """SGLang 0.5.23 resolves a draft's class like any model's (ModelRegistry); "Eagle3Speculator" is not one of its
    classes, so it falls back to the Transformers backend, which is no EAGLE-3 head: an error, not a wiring verdict
    on a draft SGLang cannot load. vLLM (which reads the speculators format) is fine with the same draft."""
    d = write_draft(tmp_path / "d", dialect="speculators", ids=[2, 16, 29], top_ids=[1, 15, 28])
    rc, rep = doctor(d, llama, "--engine", "sglang")[:2]
    assert rc == 1
    msg = finding(rep, "E_DRAFT_CLASS")["message"]
    assert "Eagle3Speculator" in msg and "LlamaForCausalLMEagle3" in msg


def test_draft_class_advice_names_the_head_that_loads_the_layer(tmp_path, llama):
    """A llama-layout draft (q/k/v/o_proj, a dense gate/up/down MLP) under a name that is no head: SGLang's advice
    is LlamaForCausalLMEagle3, the head whose load_weights (as the table records it) loads that layer, and vLLM's
    Eagle3LlamaForCausalLM; the MLA head is named as the one that does not fit, never advised."""
    d = write_draft(tmp_path / "d", ids=[1, 15, 28], extra={"architectures": ["MyDraftForCausalLM"]})
    for engine, head in (("sglang", "LlamaForCausalLMEagle3"), ("vllm", "Eagle3LlamaForCausalLM")):
        rc, rep = doctor(d, llama, "--engine", engine)[:2]
        msg = finding(rep, "E_DRAFT_CLASS")["message"]
        assert rc == 1 and f"Set \"architectures\" in the draft's config.json to {head}:" in msg, msg
        assert "Eagle3DeepseekV2ForCausalLM does not load self_attn.k_proj.weight" in msg and "e.g." not in msg


def test_draft_class_names_no_head_without_layer_tensors(tmp_path, llama):
    """A checkpoint without decoder-layer tensors gives nothing to match: the heads are listed, none is picked."""
    from eagle3_ops.doctor.checks import Options, run_checks
    from eagle3_ops.doctor.codes import E_DRAFT_CLASS
    from eagle3_ops.doctor.configs import read_weight_headers

    d = write_draft(tmp_path / "d", ids=[1, 15, 28], extra={"architectures": ["MyDraftForCausalLM"]})
    weights = {n: w for n, w in read_weight_headers(d).items() if not n.startswith("layers.")}
    rep = run_checks(parse_target(llama), parse_draft(d), weights, Options(engine="sglang"))
    msg = rep.find(E_DRAFT_CLASS).text
    assert "the doctor cannot name it: the checkpoint holds no decoder-layer tensors" in msg, msg
    assert "(Eagle3DeepseekV2ForCausalLM, LlamaForCausalLMEagle3)" in msg and "e.g." not in msg


def test_nested_text_config_target(tmp_path):
    """Kimi-K2.5 style target: language model under text_config; SGLang serves it with
    KimiK25ForConditionalGeneration, which hands the ids to its DeepseekV3ForCausalLM language model."""
    from eagle3_ops.doctor.rules import target_rules

    t = write_target(tmp_path / "kimi", model_type="deepseek_v3", num_layers=61, nested_outer="kimi_k25")
    info = parse_target(t)
    assert info.nested_key == "text_config" and info.num_layers == 61 and info.hidden_size == 16
    rules = target_rules("sglang", info, "table")
    assert rules.arch == "KimiK25ForConditionalGeneration" and rules.rule_key == "id+1-if-first-is-1"
    assert rules.evidence["holder"] == "self.language_model.model"
    rc, rep = doctor(write_draft(tmp_path / "d", ids=[1, 29, 57]), t)[:2]
    assert_clean(rc, rep)
    assert [s["capture_index"] for s in rep["slots"]] == [2, 30, 58]


# ----------------------------------------------------------------------- fault: embedding capture
def test_embedding_capture_added_to_layer_output_draft(tmp_path, llama):
    # The draft was trained on 3 layer outputs (fc = 3 x H); someone added -1 (embeddings) to the ids.
    bad = write_draft(tmp_path / "bad", ids=[-1, 1, 15, 28], k=3)
    rc, rep = doctor(bad, llama)[:2]
    assert rc == 1 and not rep["ok"]
    msg = finding(rep, "E_EMBEDDING_CAPTURE")["message"]
    assert "Remove -1" in msg and "[1, 15, 28]" in msg
    rc, rep = doctor(write_draft(tmp_path / "good", ids=[1, 15, 28]), llama)[:2]
    assert_clean(rc, rep)


def test_embedding_capture_from_vllm_reading_layer_output_id_zero(tmp_path, llama):
    # SpecForge id 0 = output of layer 0; copied unchanged to the top level, vLLM reads 0 = embeddings.
    bad = write_draft(tmp_path / "bad", ids=[0, 15, 28], top_ids=[0, 15, 28])
    rc, rep = doctor(bad, llama, "--engine", "vllm")[:2]
    assert rc == 1
    f = finding(rep, "E_EMBEDDING_CAPTURE")
    assert "token embeddings" in f["message"] and "[1, 16, 29]" in f["message"]  # the fix for vLLM
    assert rep["slots"][0]["engine_reads"].startswith("token embeddings")
    rc, rep = doctor(write_draft(tmp_path / "good", ids=[0, 15, 28], top_ids=[1, 16, 29]), llama,
                     "--engine", "vllm")[:2]
    assert_clean(rc, rep)


# --------------------------------------------------------------- fault: convention mismatch (both ways)
def test_layer_output_ids_read_as_layer_input_by_vllm(tmp_path, llama):
    bad = write_draft(tmp_path / "bad", ids=[1, 15, 28], top_ids=[1, 15, 28])
    rc, rep = doctor(bad, llama, "--engine", "vllm")[:2]
    assert rc == 1
    msg = finding(rep, "E_CONVENTION_MISMATCH")["message"]
    assert "one layer earlier" in msg and "every reading" in msg and "[2, 16, 29]" in msg
    assert [s["capture_index"] for s in rep["slots"]] == [1, 15, 28]
    assert [s["trained_index"] for s in rep["slots"]] == [2, 16, 29]


def test_layer_input_ids_read_as_layer_output_by_sglang(tmp_path, llama):
    # speculators draft (vLLM convention, ids = boundaries) converted for SGLang (its architectures set to SGLang's
    # head: SGLang 0.5.23 has no speculators support) with its ids copied unchanged into eagle_config.
    bad = write_draft(tmp_path / "bad", dialect="speculators", ids=[2, 16, 29], top_ids=[2, 16, 29], extra=SGL_HEAD)
    rc, rep = doctor(bad, llama, "--engine", "sglang")[:2]
    assert rc == 1
    msg = finding(rep, "E_CONVENTION_MISMATCH")["message"]
    assert "one layer later" in msg and "[1, 15, 28]" in msg
    good = write_draft(tmp_path / "good", dialect="speculators", ids=[2, 16, 29], top_ids=[1, 15, 28], extra=SGL_HEAD)
    assert_clean(*doctor(good, llama, "--engine", "sglang")[:2])


def test_layer_input_ids_on_trtllm(tmp_path, llama):
    # TensorRT-LLM never reads the draft config's ids: it captures what eagle3_layers_to_capture says, or its
    # default (1, L//2-1, L-4) = boundaries [2, 16, 29] (Eagle3OneModelSpecMetadata.__post_init__).
    d = write_draft(tmp_path / "d", dialect="speculators", ids=[2, 16, 29])
    assert_clean(*doctor(d, llama, "--engine", "trtllm")[:2])
    rc, rep = doctor(d, llama, "--engine", "trtllm", "--trtllm-layers", "2,16,29")[:2]
    assert rc == 1
    assert "[1, 15, 28]" in finding(rep, "E_CONVENTION_MISMATCH")["message"]
    assert_clean(*doctor(d, llama, "--engine", "trtllm", "--trtllm-layers", "1,15,28")[:2])
    assert_clean(*doctor(d, llama, "--engine", "vllm")[:2])


def test_deepseek_first_id_rule(tmp_path):
    t = write_target(tmp_path / "ds", model_type="deepseek_v3", num_layers=61)
    # SpecForge ids whose first id is not 1: SGLang's deepseek rule reads them as boundaries (no +1). A draft
    # trained through that same function is right as configured; one trained on "outputs of layers 2, 30, 58"
    # needs [3, 31, 59]. The config cannot tell: a warning with both readings, never an error.
    rc, rep = doctor(write_draft(tmp_path / "amb", ids=[2, 30, 58]), t)[:2]
    assert rc == 0
    msg = finding(rep, "W_TRAINING_AMBIGUOUS")["message"]
    assert "[3, 31, 59]" in msg and "keep the ids" in msg and "--replay" in msg
    assert_clean(*doctor(write_draft(tmp_path / "good", ids=[1, 29, 57]), t)[:2])
    assert_clean(*doctor(write_draft(tmp_path / "good2", ids=[2, 30, 58]), t, "--trained-convention",
                         "layer-input")[:2])


def test_sglang_ignores_top_level_ids(tmp_path, llama):
    # Only top-level ids: SGLang reads eagle_config only and falls back to its default [2, 16, 29].
    d = write_draft(tmp_path / "d", dialect="speculators", ids=[3, 10, 20], extra=SGL_HEAD)
    rc, rep = doctor(d, llama, "--engine", "sglang")[:2]
    assert rc == 1
    assert "does not read top-level eagle_aux_hidden_state_layer_ids" in finding(rep, "E_WIRING_MISMATCH")["message"]
    same = write_draft(tmp_path / "same", dialect="speculators", ids=[2, 16, 29], extra=SGL_HEAD)
    rc, rep = doctor(same, llama, "--engine", "sglang")[:2]
    assert rc == 0 and "W_IDS_IGNORED" in codes(rep, "warning")


# ------------------------------------------------------------------- fault: last layer never captured
def test_last_layer_id_never_captured_by_sglang(tmp_path, llama):
    bad = write_draft(tmp_path / "bad", ids=[1, 15, L - 1])
    rc, rep = doctor(bad, llama)[:2]
    assert rc == 1
    msg = finding(rep, "E_LAST_LAYER_NOT_CAPTURED")["message"]
    assert f"boundary {L}" in msg and "never captured" in msg
    assert rep["slots"][2]["captured"] is False
    assert "E_FC_WIDTH" not in codes(rep)  # one root cause, one error... plus the slot count it implies
    assert_clean(*doctor(write_draft(tmp_path / "good", ids=[1, 15, L - 2]), llama)[:2])
    # TensorRT-LLM captures after the named layer, so the same ids are fine there.
    assert_clean(*doctor(bad, llama, "--engine", "trtllm", "--trtllm-layers", f"1,15,{L - 1}")[:2])


def test_gpt_oss_captures_the_final_boundary(tmp_path):
    t = write_target(tmp_path / "oss", model_type="gpt_oss", num_layers=36)
    assert_clean(*doctor(write_draft(tmp_path / "d", ids=[1, 17, 35]), t)[:2])


# ---------------------------------------------------------------------- fault: PP ranks without captures
def test_pipeline_parallel_stage_without_captures(tmp_path, llama):
    d = write_draft(tmp_path / "d", ids=[1, 15, 28])
    rc, rep = doctor(d, llama, "--pp", "2")[:2]
    assert rc == 1
    msg = finding(rep, "E_PP_NOT_CAPTURED")["message"]
    assert "boundary 2" in msg and "layers 16..31" in msg
    assert [s["captured"] for s in rep["slots"]] == [False, True, True]
    assert_clean(*doctor(d, llama, "--pp", "1")[:2])
    # All captured boundaries on the last stage: fine with pp=2 (even split and explicit partition).
    assert_clean(*doctor(write_draft(tmp_path / "late", ids=[15, 20, 28]), llama, "--pp", "2")[:2])
    assert_clean(*doctor(d, llama, "--pp", "2", "--pp-partition", "2,30")[:2])
    # vLLM 0.33.0: the V2 runner relays earlier stages' captures for llama; the V1 runner relays none
    rc, rep = doctor(d, llama, "--pp", "2", "--engine", "vllm", "--trained-convention", "layer-output")[:2]
    assert "E_PP_NOT_CAPTURED" not in codes(rep)
    rc, rep = doctor(d, llama, "--pp", "2", "--engine", "vllm", "--vllm-runner", "v1")[:2]
    assert "E_PP_NOT_CAPTURED" in codes(rep, "error")


# -------------------------------------------------------------------- fault: partial sums before all-reduce
def test_tp_partial_sums(tmp_path, llama):
    d = write_draft(tmp_path / "d", ids=[1, 15, 28])
    rc, rep = doctor(d, llama, "--tp", "4", "--capture-point", "before-allreduce")[:2]
    assert rc == 1
    assert "partial sum" in finding(rep, "E_TP_PARTIAL_SUM")["message"]
    rc, rep = doctor(d, llama, "--tp", "4")[:2]  # stock SGLang llama path: verified post-all-reduce
    assert_clean(rc, rep)
    assert "stream.complete" in finding(rep, "I_TP_CAPTURE_OK")["message"]
    # TensorRT-LLM: the capture stores hidden + residual (eagle3.py), but which layers call it, and where relative to
    # their all-reduce, is per model file, and no per-class TensorRT-LLM table exists here: not verified, said so.
    rc, rep = doctor(d, llama, "--tp", "4", "--engine", "trtllm")[:2]
    assert rc == 0 and "maybe_capture_hidden_states" in finding(rep, "W_TP_CAPTURE_UNVERIFIED")["message"]
    # vLLM 0.33.0's llama decoder captures hidden_states + residual between layers (its table): after the all-reduce
    rc, rep = doctor(d, llama, "--tp", "4", "--engine", "vllm", "--trained-convention", "layer-output")[:2]
    assert "LlamaModel" in finding(rep, "I_TP_CAPTURE_OK")["message"]


# ------------------------------------------------------------------------------- fault: fc width
def test_fc_width_not_k_times_hidden(tmp_path, llama):
    rc, rep = doctor(write_draft(tmp_path / "two", ids=[1, 15, 28], k=2), llama)[:2]
    assert rc == 1 and "E_FC_WIDTH" in codes(rep, "error")
    rc, rep = doctor(write_draft(tmp_path / "odd", ids=[1, 15, 28], fc_in=40), llama)[:2]
    assert rc == 1 and "not a multiple" in finding(rep, "E_FC_WIDTH")["message"]
    rc, rep = doctor(write_draft(tmp_path / "other", ids=[1, 15, 28], target_hidden=32), llama)[:2]
    assert rc == 1 and {"E_TARGET_HIDDEN", "E_FC_WIDTH"} <= set(codes(rep, "error"))
    assert_clean(*doctor(write_draft(tmp_path / "good", ids=[1, 15, 28]), llama)[:2])


def test_duplicate_ids(tmp_path, llama):
    rc, rep = doctor(write_draft(tmp_path / "d", ids=[1, 1, 28]), llama)[:2]
    assert rc == 1 and "E_DUPLICATE_CAPTURE" in codes(rep, "error")


def test_unsorted_ids_warn_about_slot_order(tmp_path, llama):
    rc, rep = doctor(write_draft(tmp_path / "d", ids=[28, 1, 15]), llama)[:2]
    assert "W_SLOT_ORDER" in codes(rep, "warning")
    assert rc == 1  # engines concatenate in layer order: slot 0 gets boundary 2, trained on 29


# ------------------------------------------------------------------------------- fault: vocab maps
def test_vocab_maps(tmp_path, llama):
    good = write_draft(tmp_path / "good", ids=[1, 15, 28])
    assert_clean(*doctor(good, llama)[:2])
    t2d_short = write_draft(tmp_path / "t2d", ids=[1, 15, 28], tensors={"t2d": torch.ones(100, dtype=torch.bool)})
    rc, rep = doctor(t2d_short, llama)[:2]
    assert rc == 1 and "t2d has shape [100]" in finding(rep, "E_VOCAB_MAP")["message"]
    big = write_target(tmp_path / "small_vocab", num_layers=L, vocab=100)  # d2t points up to id 126
    rc, rep = doctor(good, big)[:2]
    assert rc == 1 and "outside 0..99" in finding(rep, "E_VOCAB_MAP")["message"]
    no_map = write_draft(tmp_path / "nomap", ids=[1, 15, 28], drop=("d2t", "t2d"))
    rc, rep = doctor(no_map, llama)[:2]
    assert rc == 1 and "no d2t map" in finding(rep, "E_VOCAB_MAP")["message"]
    full_vocab = write_draft(tmp_path / "full", ids=[1, 15, 28], draft_vocab=128, drop=("d2t", "t2d"))
    assert_clean(*doctor(full_vocab, llama)[:2])  # draft vocab == target vocab needs no map
    mism = write_draft(tmp_path / "mism", ids=[1, 15, 28],
                       tensors={"t2d": torch.roll(torch.arange(128) % 2 == 0, 1)})
    rc, rep = doctor(mism, llama)[:2]
    assert rc == 1 and "disagree" in finding(rep, "E_VOCAB_MAP")["message"]


def test_norm_before_residual_warns_on_sglang(tmp_path, llama):
    d = write_draft(tmp_path / "d", dialect="speculators", ids=[2, 16, 29], top_ids=[1, 15, 28],
                    extra={"norm_before_residual": True, **SGL_HEAD})
    rc, rep = doctor(d, llama, "--engine", "sglang")[:2]
    assert rc == 0 and "W_NORM_BEFORE_RESIDUAL" in codes(rep, "warning")


def test_trained_ids_override(tmp_path, llama):
    # Config edited after training: --trained-ids tells the doctor what the draft really saw.
    d = write_draft(tmp_path / "d", ids=[-1, 15, 28])
    rc, rep = doctor(d, llama, "--trained-ids", "1,15,28")[:2]
    assert rc == 1 and "E_EMBEDDING_CAPTURE" in codes(rep, "error")
    assert_clean(*doctor(d, llama)[:2])  # without the override the config is self-consistent


def test_sharded_safetensors_headers(tmp_path, llama):
    d = write_draft(tmp_path / "d", ids=[1, 15, 28])
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({("model." + k if k.startswith("fc") else k): tensors[k] for k in keys}, str(d / fname))
        weight_map.update({("model." + k if k.startswith("fc") else k): fname for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_clean(*doctor(d, llama)[:2])


@needs_sglang
def test_doctor_agrees_with_sglang_execution(tmp_path):
    """Run SGLang 0.5.23's own llama on CPU with ids [-1, 1, L-1]: slot 0 is the embeddings, slot 1 is
    boundary 2 (= HF output_hidden_states[2]), and id L-1 (boundary L) is never captured. The doctor
    predicts exactly this."""
    import torch._dynamo
    import transformers

    from eagle3_ops.demos import sglang_cpu_harness as h

    h.init_distributed()
    cfg = h.FAMILIES["llama"].make_config()
    n = cfg.num_hidden_layers
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    model = h.sglang_model("llama", cfg, torch.float32, weights=hf.state_dict().items())
    ids = [-1, 1, n - 1]
    model.set_eagle3_layers_to_capture(ids)
    prompt = [5, 17, 3, 99, 42]
    with torch._dynamo.config.patch(disable=True):
        kv = h.KVCache(cfg, torch.float32)
        out = h.run(model, h.extend_batch(kv, [h.Req(kv.new_req())], [prompt]), kv)
    aux = out.hidden_states
    H = cfg.hidden_size

    t = write_target(tmp_path / "t", num_layers=n, hidden=H, vocab=cfg.vocab_size)
    d = write_draft(tmp_path / "d", ids=ids, hidden=H, target_hidden=H, vocab=cfg.vocab_size)
    wiring = engines.resolve_wiring("sglang", parse_target(t), parse_draft(d))
    captured = wiring.captured_boundaries
    assert captured == [0, 2] and aux.shape == (len(prompt), len(captured) * H)
    with torch.no_grad():
        hs = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    for k, b in enumerate(captured):
        torch.testing.assert_close(aux[:, k * H:(k + 1) * H], hs[b][0], rtol=1e-4, atol=1e-4)
    rc, rep, _ = doctor(d, t)
    assert rc == 1 and "E_LAST_LAYER_NOT_CAPTURED" in codes(rep, "error")


def test_run_checks_from_in_memory_configs(tmp_path):
    """The API the live check uses in-process (issue 19): configs as dicts or as the server's config objects, no
    config.json on disk; the same findings as the CLI on the same files."""
    import transformers

    from eagle3_ops.doctor.checks import Options, run_checks
    from eagle3_ops.doctor.configs import draft_from_config, read_weight_headers, target_from_config

    t = write_target(tmp_path / "t", num_layers=L)
    d = write_draft(tmp_path / "d", ids=[1, 15, 31])  # id 31 names boundary 32, never captured by SGLang's llama
    t_cfg, d_cfg = json.loads((t / "config.json").read_text()), json.loads((d / "config.json").read_text())
    weights = read_weight_headers(d)
    by_cli = doctor(d, t)[1]
    for target in (target_from_config(t_cfg), target_from_config(transformers.LlamaConfig.from_dict(t_cfg))):
        rep = run_checks(target, draft_from_config(d_cfg), weights, Options(engine="sglang"))
        assert not rep.ok and [f.code for f in rep.findings if f.severity == "error"] == codes(by_cli, "error")
        assert [s["capture_index"] for s in rep.slots] == [s["capture_index"] for s in by_cli["slots"]]


def test_the_record_states_advice_runs_as_printed(tmp_path):
    """The capture-states command the doctor prints (replay_command) for a stock Llama target has no
    --trust-remote-code (transformers knows llama), and offers --device-map auto only where accelerate, which
    capture-states needs for it, is installed; a target whose config maps to remote code of a model_type
    transformers does not know gets --trust-remote-code."""
    import importlib.util
    import types

    from eagle3_ops.doctor.checks import replay_command

    def advice(cfg):
        rep = types.SimpleNamespace(options=types.SimpleNamespace(engine="sglang"),
                                    target=types.SimpleNamespace(path=tmp_path / "t", config=cfg),
                                    draft=types.SimpleNamespace(path=tmp_path / "d"))
        return replay_command(rep)

    stock = advice({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    assert "--trust-remote-code" not in stock, stock
    has_accelerate = importlib.util.find_spec("accelerate") is not None
    assert ("--device-map auto`" in stock) == has_accelerate, stock
    if not has_accelerate:
        assert "pip install accelerate and add --device-map auto" in stock, stock
    remote = advice({"model_type": "my_own_model", "auto_map": {"AutoConfig": "configuration_mine.MyConfig"}})
    assert "--trust-remote-code" in remote, remote
