"""The doctor on real published configs (README.md here names each file's source).

Each draft checkpoint is built around the real config.json with the tensor names and shapes a
SpecForge/SGLang ``llama_eagle3`` checkpoint has at that size: safetensors headers over a sparse
data region (only ``d2t``/``t2d`` hold data, as the doctor reads their values), sharded with a
``model.safetensors.index.json`` where asked, or the original EAGLE-3 ``pytorch_model.bin`` as a
``torch.save`` of zero-stride tensors. Each expected verdict names the engine code it follows.
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from doctor_fixtures import codes, finding, run_doctor
from eagle3_ops.doctor import codes as doctor_codes
from eagle3_ops.doctor import tables
from eagle3_ops.doctor.configs import parse_target, read_weight_headers
from machine import needs_sglang

HERE = Path(__file__).resolve().parent

_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64", torch.bool: "BOOL"}


def layer_shapes(cfg: dict, dt) -> dict:
    """The draft layer's tensors (``midlayer.``) of the class the config's trainer builds from it: llama attention,
    or MLA where the config sets kv_lora_rank (TorchSpec's MLA draft, DeepSeek-V2 projection names); a dense llama
    MLP, or the MoE MLP of SpecForge's GptOssForCausalLMEagle3 (``self.midlayer.mlp = GptOssMLP(config)``, its
    tensors read from transformers' GptOssMLP built on the meta device) and Qwen3MoEForCausalLMEagle3
    (SpecForgeQwen3MoeSparseMoeBlock: the router ``gate`` and the fused expert weights gate_weight / up_weight /
    down_weight; q_norm / k_norm on the attention; hidden_norm on the model, outside the layer)."""
    h = cfg["hidden_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    out = {"midlayer.input_layernorm.weight": ((h,), dt), "midlayer.hidden_norm.weight": ((h,), dt),
           "midlayer.post_attention_layernorm.weight": ((h,), dt)}
    if "kv_lora_rank" in cfg:
        ql, kl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
        nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        out.update({"midlayer.self_attn.q_a_proj.weight": ((ql, 2 * h), dt),
                    "midlayer.self_attn.q_a_layernorm.weight": ((ql,), dt),
                    "midlayer.self_attn.q_b_proj.weight": ((heads * (nope + rope), ql), dt),
                    "midlayer.self_attn.kv_a_proj_with_mqa.weight": ((kl + rope, 2 * h), dt),
                    "midlayer.self_attn.kv_a_layernorm.weight": ((kl,), dt),
                    "midlayer.self_attn.kv_b_proj.weight": ((heads * (nope + v), kl), dt),
                    "midlayer.self_attn.o_proj.weight": ((h, heads * v), dt)})
    else:
        out.update({"midlayer.self_attn.q_proj.weight": ((heads * hd, 2 * h), dt),
                    "midlayer.self_attn.k_proj.weight": ((kv * hd, 2 * h), dt),
                    "midlayer.self_attn.v_proj.weight": ((kv * hd, 2 * h), dt),
                    "midlayer.self_attn.o_proj.weight": ((h, heads * hd), dt)})
    if cfg.get("model_type") == "gpt_oss" and cfg.get("num_local_experts"):
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

        with torch.device("meta"):
            mlp = GptOssMLP(GptOssConfig(hidden_size=h, intermediate_size=inter, head_dim=hd,
                                         num_attention_heads=heads, num_key_value_heads=kv,
                                         num_local_experts=cfg["num_local_experts"],
                                         num_experts_per_tok=cfg.get("experts_per_token", 4)))
        out.update({f"midlayer.mlp.{n}": (tuple(p.shape), dt) for n, p in mlp.state_dict().items()})
    elif cfg.get("model_type") == "qwen3_moe" and cfg.get("num_experts"):
        e, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
        out.update({"midlayer.mlp.gate.weight": ((e, h), dt), "midlayer.mlp.gate_weight": ((e, mi, h), dt),
                    "midlayer.mlp.up_weight": ((e, mi, h), dt), "midlayer.mlp.down_weight": ((e, h, mi), dt),
                    "midlayer.self_attn.q_norm.weight": ((hd,), dt), "midlayer.self_attn.k_norm.weight": ((hd,), dt),
                    "hidden_norm.weight": out.pop("midlayer.hidden_norm.weight")})
    else:
        out.update({"midlayer.mlp.gate_proj.weight": ((inter, h), dt), "midlayer.mlp.up_proj.weight": ((inter, h), dt),
                    "midlayer.mlp.down_proj.weight": ((h, inter), dt)})
    return out


def draft_shapes(cfg: dict, target_hidden: int, k: int = 3) -> dict:
    """name -> (shape, dtype) of an EAGLE-3 draft in SpecForge/SGLang naming (its layer: :func:`layer_shapes`)."""
    h = cfg["hidden_size"]
    vocab = cfg["vocab_size"]
    dv = cfg.get("draft_vocab_size") or vocab
    dt = torch.bfloat16
    return {
        "fc.weight": ((h, k * target_hidden), dt),
        **layer_shapes(cfg, dt),
        "norm.weight": ((h,), dt),
        "lm_head.weight": ((dv, h), dt),
        "d2t": ((dv,), torch.int64),
        "t2d": ((vocab,), torch.bool),
    }


def vocab_maps(dv: int, vocab: int):
    hot = torch.arange(dv) * (vocab // dv)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    return {"d2t": hot - torch.arange(dv), "t2d": t2d}


def write_sparse_safetensors(path: Path, shapes: dict, data: dict) -> None:
    """A valid safetensors file whose large tensors are a sparse (unwritten) region."""
    header, offset, order = {}, 0, sorted(shapes, key=lambda n: n not in data)  # data first
    for name in order:
        shape, dt = shapes[name]
        n = torch.empty((), dtype=dt).element_size()
        for s in shape:
            n *= s
        header[name] = {"dtype": _DTYPES[dt], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        start = f.tell()
        for name in order:
            if name in data:
                f.seek(start + header[name]["data_offsets"][0])
                f.write(data[name].contiguous().numpy().tobytes())
        f.truncate(start + offset)


def make_pair(tmp_path, case: str, *, ids=None, shards: int = 1, bin_format: bool = False, edit=None,
              drop=()):
    """(draft_dir, target_dir) for a case folder. A derived case (the edit is here, the file stays as is): ``ids``
    replaces eagle_config's ids, ``edit`` updates top-level keys of the draft config, ``drop`` leaves tensors out."""
    src = HERE / case
    target = tmp_path / "target"
    shutil.copytree(src / "target", target)
    draft = tmp_path / "draft"
    draft.mkdir()
    raw = (src / "draft" / "config.json").read_text()
    cfg = json.loads(raw)
    if ids is not None:
        cfg.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = ids
    if edit:
        cfg.update(edit)
    if ids is not None or edit:
        raw = json.dumps(cfg, indent=2)
    (draft / "config.json").write_text(raw)
    t_hidden = parse_target(target).hidden_size  # as transformers reads it (llava-hf's text_config omits it)
    shapes = draft_shapes(cfg, t_hidden)
    for name in drop:
        shapes.pop(name)
    data = vocab_maps(shapes["d2t"][0][0], shapes["t2d"][0][0])
    if bin_format:  # the original EAGLE-3 format: torch.save of a state dict (zero-stride: no data)
        sd = {n: (data[n] if n in data else torch.zeros((), dtype=dt).expand(*shape)) for n, (shape, dt) in
              shapes.items()}
        torch.save(sd, draft / "pytorch_model.bin")
    elif shards == 1:
        write_sparse_safetensors(draft / "model.safetensors", shapes, data)
    else:
        names = sorted(shapes)
        weight_map = {}
        for i in range(shards):
            part = {n: shapes[n] for n in names[i::shards]}
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            write_sparse_safetensors(draft / fname, part, {n: v for n, v in data.items() if n in part})
            weight_map.update({n: fname for n in part})
        (draft / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return draft, target


def doctor(draft, target, *args):
    rc, rep, err = run_doctor("--draft", draft, "--target", target, *args)
    assert rep is not None, err
    return rc, rep


def slots(rep):
    return [s["capture_index"] for s in rep["slots"]]


# ------------------------------------------------------------------------------------------ Kimi-K2.5
def test_kimi_k25_specforge_config_is_a_warning_with_both_readings(tmp_path):
    """SpecForge's Kimi-K2.5 config, ids [2, 30, 58], target deepseek (kimi_k2 language model under text_config),
    TP=8. SGLang 0.5.23 deepseek_v2.set_eagle3_layers_to_capture: first id is not 1 -> ids as given -> boundaries
    [2, 30, 58]. A draft trained through that same function (SpecForge 0.2.0's only backend) is right; one trained
    on "outputs of layers 2, 30, 58" needs [3, 31, 59]. The config cannot tell: a warning, exit 0."""
    d, t = make_pair(tmp_path, "kimi-k25_specforge")
    rc, rep = doctor(d, t, "--tp", "8")
    assert rc == 0, codes(rep)
    assert slots(rep) == [2, 30, 58]
    assert rep["target"]["num_layers"] == 61 and rep["target"]["hidden_size"] == 7168
    msg = finding(rep, "W_TRAINING_AMBIGUOUS")["message"]
    assert "[3, 31, 59]" in msg and "keep the ids" in msg and "--replay" in msg
    assert "E_CONVENTION_MISMATCH" not in codes(rep)
    readings = rep["training"]["readings"]
    assert [r["boundaries"] for r in readings] == [[2, 30, 58], [3, 31, 59]]
    assert "stream.complete" in finding(rep, "I_TP_CAPTURE_OK")["message"]  # TP=8: captured after the all-reduce
    assert rep["draft"]["fc_slots"] == 3


def test_kimi_k25_on_vllm_and_trtllm(tmp_path):
    d, t = make_pair(tmp_path, "kimi-k25_specforge")
    # vLLM 0.33.0 V2 runner (eagle3_utils.get_eagle3_aux_layers_from_config): top-level ids only -> the default
    # (2, L//2, L-3) = [2, 30, 58]; V1 (gpu_model_runner._get_eagle3_aux_layers_from_config): eagle_config's ids as
    # given = [2, 30, 58] too. Same two readings -> the same warning.
    for runner in ("v2", "v1"):
        rc, rep = doctor(d, t, "--engine", "vllm", "--vllm-runner", runner)
        assert rc == 0 and slots(rep) == [2, 30, 58] and "W_TRAINING_AMBIGUOUS" in codes(rep, "warning")
    # TensorRT-LLM (Eagle3OneModelSpecMetadata.__post_init__): default (1, L//2-1, L-4) captured after each layer
    rc, rep = doctor(d, t, "--engine", "trtllm")
    assert rc == 0 and slots(rep) == [2, 30, 58]


def test_kimi_k25_classic_mistake_is_an_error_without_a_guessed_fix(tmp_path):
    """The same draft with its ids edited to [-1, 2, 30]. SGLang's deepseek rule (first id not 1: as given) makes
    -1 name no layer: only 2 of 3 slots fill. The doctor must not print [0, 3, 31] (which keeps the embedding
    capture the edit introduced) as the fix: the readings disagree, only replay or the published ids can say."""
    d, t = make_pair(tmp_path, "kimi-k25_specforge", ids=[-1, 2, 30])
    rc, rep = doctor(d, t)
    assert rc == 1
    err = finding(rep, "E_ID_OUT_OF_RANGE")["message"]
    assert "DeepseekV2ForCausalLM.set_eagle3_layers_to_capture" in err and "boundary -1 does not exist" in err
    assert [s["captured"] for s in rep["slots"]] == [False, True, True]
    errors = " ".join(f["message"] for f in rep["findings"] if f["severity"] == "error")
    assert "[0, 3, 31]" not in errors
    readings = rep["training"]["readings"]
    assert readings[0]["plausible"] is False  # SGLang never captures -1 on deepseek_v2: not how it was trained
    assert "--replay" in finding(rep, "I_TRAINING_READINGS")["message"]


# ----------------------------------------------------------------------------------------- DeepSeek-V3
def test_deepseek_v3_ids_first_one_and_mtp_layer(tmp_path):
    """SpecForge's DeepSeek-V3 config, ids [1, 29, 57]; the target has one MTP layer (num_nextn_predict_layers 1)
    outside the 61-layer stack. SGLang deepseek_v2 rule: first id is 1 -> +1 -> [2, 30, 58]; every reading agrees."""
    d, t = make_pair(tmp_path, "deepseek-v3_specforge")
    assert json.loads((t / "config.json").read_text())["num_nextn_predict_layers"] == 1
    rc, rep = doctor(d, t, "--tp", "8")
    assert rc == 0 and slots(rep) == [2, 30, 58]
    assert not [c for c in codes(rep, "warning") if c != "W_SLOT_ORDER"], codes(rep)
    assert rep["target"]["num_layers"] == 61
    # vLLM V2: no top-level ids -> default (2, 30, 58): right by luck -> W_IDS_IGNORED
    rc, rep = doctor(d, t, "--engine", "vllm")
    assert rc == 0 and "W_IDS_IGNORED" in codes(rep, "warning")
    # vLLM V1: eagle_config ids as given -> [1, 29, 57]: one layer early under every reading; the fix is checked
    rc, rep = doctor(d, t, "--engine", "vllm", "--vllm-runner", "v1")
    assert rc == 1
    assert "[2, 30, 58]" in finding(rep, "E_CONVENTION_MISMATCH")["message"]


# -------------------------------------------------------------------------------------------- gpt-oss
def test_gpt_oss_specforge_and_boundary_numbered_ids(tmp_path):
    """SpecForge's gpt-oss-120b config [1, 17, 33]: SGLang gpt_oss rule (max id != L) -> +1 -> [2, 18, 34].
    Boundary-numbered [24, 30, 36] (max id == L = 36): SGLang 0.5.23 gpt_oss.set_eagle3_layers_to_capture takes
    them as given and captures boundary 36 at the final norm; the other reading names boundary 37, which does not
    exist, so it is ruled out: a clean pass."""
    d, t = make_pair(tmp_path / "a", "gpt-oss-120b_specforge")
    rc, rep = doctor(d, t)
    assert rc == 0 and slots(rep) == [2, 18, 34]
    d, t = make_pair(tmp_path / "b", "gpt-oss-120b_specforge", ids=[24, 30, 36])
    rc, rep = doctor(d, t)
    assert rc == 0 and slots(rep) == [24, 30, 36], codes(rep)
    assert "W_TRAINING_AMBIGUOUS" not in codes(rep)
    assert "does not exist" not in json.dumps([f for f in rep["findings"] if f["severity"] != "info"])
    # TensorRT-LLM with the ids its gpt-oss scripts pass, 23, 29, 35 (captured after each layer)
    rc, rep = doctor(d, t, "--engine", "trtllm", "--trtllm-layers", "23,29,35")
    assert rc == 0 and slots(rep) == [24, 30, 36]


# ---------------------------------------------------------------------- original EAGLE-3 .bin, sharded
def test_original_eagle3_bin_draft_without_ids(tmp_path):
    """The EAGLE authors' EAGLE-3 training config (LlamaForCausalLM architecture, no ids) as pytorch_model.bin on
    Llama-3.1-8B: every engine's default [2, 16, 29]; no ids is a warning (the doctor assumes the default).
    SGLang resolves a draft's class from its architectures like any model's: LlamaForCausalLM is its plain Llama,
    not an EAGLE-3 head, so SGLang cannot serve this config as written (E_DRAFT_CLASS); vLLM renames it
    Eagle3LlamaForCausalLM (EAGLEConfig), its EAGLE-3 head."""
    d, t = make_pair(tmp_path, "llama-3.1-8b_eagle-official-train", bin_format=True)
    assert (d / "pytorch_model.bin").stat().st_size < 2_000_000
    for engine in ("sglang", "vllm", "trtllm"):
        rc, rep = doctor(d, t, "--engine", engine)
        assert slots(rep) == [2, 16, 29], (engine, codes(rep))
        assert "--replay" in finding(rep, "W_NO_TRAINING_IDS")["message"]
        assert codes(rep, "error") == (["E_DRAFT_CLASS"] if engine == "sglang" else []), (engine, codes(rep))
    rc, rep = doctor(d, t)
    msg = finding(rep, "E_DRAFT_CLASS")["message"]
    assert rc == 1 and "LlamaForCausalLM" in msg
    assert "Set \"architectures\" in the draft's config.json to LlamaForCausalLMEagle3:" in msg  # its llama layer


def test_sharded_llama_70b_draft_without_ids(tmp_path):
    d, t = make_pair(tmp_path, "llama-3.3-70b_specforge", shards=3)
    assert (d / "model.safetensors.index.json").is_file()
    rc, rep = doctor(d, t, "--tp", "8")
    assert rc == 0 and slots(rep) == [2, 40, 77] and rep["draft"]["fc_slots"] == 3
    assert "W_NO_TRAINING_IDS" in codes(rep, "warning")


def test_qwen3_235b_and_kimi_k2_specforge(tmp_path):
    d, t = make_pair(tmp_path / "q", "qwen3-235b-a22b_specforge")
    rc, rep = doctor(d, t)  # qwen3_moe: +1 (both readings) -> [2, 47, 91]
    assert rc == 0 and slots(rep) == [2, 47, 91] and "W_TRAINING_AMBIGUOUS" not in codes(rep)
    d, t = make_pair(tmp_path / "k", "kimi-k2_specforge-pr108")
    rc, rep = doctor(d, t)  # kimi_k2: the deepseek rule, like Kimi-K2.5
    assert rc == 0 and slots(rep) == [2, 30, 58] and "W_TRAINING_AMBIGUOUS" in codes(rep, "warning")


@pytest.mark.parametrize("case", ["kimi-k25_specforge", "deepseek-v3_specforge", "gpt-oss-120b_specforge",
                                  "qwen3-235b-a22b_specforge"])
def test_every_printed_fix_passes_the_doctor(tmp_path, case):
    """Any ids the doctor prints as a fix (an E_* finding's 'Set ... to [...]'), applied, give no error."""
    import re

    checked = []
    for engine, extra in (("sglang", ()), ("vllm", ("--vllm-runner", "v1")), ("vllm", ())):
        d, t = make_pair(tmp_path / f"{engine}{len(extra)}", case)
        rc, rep = doctor(d, t, "--engine", engine, *extra)
        for f in rep["findings"]:
            m = re.search(r"Set (eagle_config\.eagle_aux_hidden_state_layer_ids|the top-level "
                          r"eagle_aux_hidden_state_layer_ids) in the draft's config.json to (\[[-0-9, ]+\])",
                          f["message"])
            if f["severity"] != "error" or m is None:
                continue
            cfg = json.loads((d / "config.json").read_text())
            fixed = json.loads(m.group(2))
            if m.group(1).startswith("eagle_config"):
                cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = fixed
            else:
                cfg["eagle_aux_hidden_state_layer_ids"] = fixed
            (d / "config.json").write_text(json.dumps(cfg))
            rc2, rep2 = doctor(d, t, "--engine", engine, *extra)
            assert rc2 == 0, (case, engine, f["message"], codes(rep2))
            checked.append((case, engine))
    if case == "deepseek-v3_specforge":  # vLLM V1 reads [1, 29, 57] as given: an error with a printed fix
        assert ("deepseek-v3_specforge", "vllm") in checked

# ------------------------------------------------------------------- every family SGLang 0.5.23 serves
def test_qwen3_8b_dense(tmp_path):
    """SpecForge's Qwen3-8B config (no ids) on Qwen3-8B (Qwen3ForCausalLM: id + 1; default [2, 18, 33])."""
    d, t = make_pair(tmp_path, "qwen3-8b_specforge")
    for engine in ("sglang", "vllm", "trtllm"):
        rc, rep = doctor(d, t, "--engine", engine)
        assert rc == 0 and slots(rep) == [2, 18, 33] and "W_NO_TRAINING_IDS" in codes(rep, "warning"), engine
    assert "W_TARGET_SUPPORT_UNVERIFIED" in codes(rep)  # no per-class TensorRT-LLM table: said, not assumed
    # an id naming boundary L: Qwen3Model captures at each layer's entry only
    d, t = make_pair(tmp_path / "last", "qwen3-8b_specforge", ids=[1, 17, 35])
    rc, rep = doctor(d, t)
    assert rc == 1 and "E_LAST_LAYER_NOT_CAPTURED" in codes(rep, "error")


def test_tied_draft_with_a_smaller_vocabulary(tmp_path):
    """AngelSlim's Qwen3-1.7B EAGLE-3 config: tie_word_embeddings true, draft_vocab_size 32000 < 151936.
    As published it names vLLM's head (Eagle3LlamaForCausalLM), which SGLang cannot load (E_DRAFT_CLASS, no
    tied verdict on a class SGLang does not run). vLLM's Eagle3LlamaForCausalLM ignores the flag and loads
    lm_head.weight; without that tensor vLLM shares the target's lm_head (load_eagle_model): an error.
    Exported for SGLang (architectures LlamaForCausalLMEagle3), llama_eagle3.py ties lm_head to embed_tokens,
    which set_embed replaces with the target's: the trained head is dropped, an error; untied, it is fine."""
    d, t = make_pair(tmp_path / "a", "qwen3-1.7b_angelslim-tied")
    rc, rep = doctor(d, t)
    assert rc == 1 and codes(rep, "error") == ["E_DRAFT_CLASS"], codes(rep)
    rc, rep = doctor(d, t, "--engine", "vllm")
    assert rc == 0 and "ignores it" in finding(rep, "I_TIED_DRAFT")["message"]
    d2, t2 = make_pair(tmp_path / "b", "qwen3-1.7b_angelslim-tied", drop=("lm_head.weight",))
    rc, rep = doctor(d2, t2, "--engine", "vllm")
    assert rc == 1 and "shares the target's lm_head" in finding(rep, "E_TIED_DRAFT_VOCAB")["message"]
    d3, t3 = make_pair(tmp_path / "c", "qwen3-1.7b_angelslim-tied", edit={"architectures": ["LlamaForCausalLMEagle3"]})
    rc, rep = doctor(d3, t3)
    msg = finding(rep, "E_TIED_DRAFT_VOCAB")["message"]
    assert rc == 1 and "self.lm_head = self.model.embed_tokens" in msg and "Set tie_word_embeddings to false" in msg
    assert slots(rep) == [2, 14, 25]  # the wiring itself is fine: the error is the head
    d4, t4 = make_pair(tmp_path / "d", "qwen3-1.7b_angelslim-tied",
                       edit={"architectures": ["LlamaForCausalLMEagle3"], "tie_word_embeddings": False})
    rc, rep = doctor(d4, t4)
    assert rc == 0, codes(rep)


def test_qwen3_vl_dense_and_moe(tmp_path):
    """SpecForge's Qwen3-VL configs (PR 431) on Qwen3-VL-8B / 30B-A3B. SGLang: Qwen3VLForConditionalGeneration's
    own set_eagle3_layers_to_capture adds 1 ([3, 17, 32] -> [4, 18, 33]); every reading agrees. vLLM's V2 runner
    reads only top-level ids (get_eagle3_aux_layers_from_config), so it feeds its default: an error with the fix."""
    d, t = make_pair(tmp_path / "8b", "qwen3-vl-8b_specforge")
    rc, rep = doctor(d, t)
    assert rc == 0 and slots(rep) == [4, 18, 33] and codes(rep, "warning") == [], codes(rep)
    rc, rep = doctor(d, t, "--engine", "vllm")
    assert rc == 1 and slots(rep) == [2, 18, 33]
    assert "top-level eagle_aux_hidden_state_layer_ids in the draft's config.json to [4, 18, 33]" in \
        finding(rep, "E_WIRING_MISMATCH")["message"]
    d, t = make_pair(tmp_path / "30b", "qwen3-vl-30b-a3b_specforge")
    rc, rep = doctor(d, t)  # Qwen3VLMoe: its Qwen2MoeModel flags self.layers[b]
    assert rc == 0 and slots(rep) == [4, 24, 46]
    assert rep["engine"]["class"].endswith("Qwen3VLMoeForConditionalGeneration")


def test_qwen3_5_moe_reads_the_text_config(tmp_path):
    """SpecForge's Qwen3.5-35B-A3B config (no ids) on Qwen3.5-35B-A3B. SGLang's Qwen3VLForConditionalGeneration
    sets self.config = config.text_config for this language model class (its __init__), so the default reads the
    text config's 40 layers: [2, 20, 37]. An id naming boundary 40: its model flags self.layers[40], an IndexError
    when SGLang starts (E_ENGINE_RAISES, not a layer verdict)."""
    d, t = make_pair(tmp_path / "a", "qwen3.5-35b-a3b_specforge")
    rc, rep = doctor(d, t)
    assert rc == 0 and slots(rep) == [2, 20, 37] and rep["target"]["num_layers"] == 40
    d, t = make_pair(tmp_path / "b", "qwen3.5-35b-a3b_specforge", ids=[1, 19, 39])
    rc, rep = doctor(d, t)
    msg = finding(rep, "E_ENGINE_RAISES")["message"]
    assert rc == 1 and "IndexError" in msg and rep["slots"] == []
    assert not [c for c in codes(rep, "error") if c != "E_ENGINE_RAISES"]


def test_moe_draft_class_is_no_eagle3_head(tmp_path):
    """SpecForge's MoE draft (branch exp/add-moe-draft-head) declares Qwen3MoEForCausalLMEagle3: not an SGLang
    class (Transformers fallback, no fc over the captures), and not a vLLM head (Eagle3-suffixed names are looked
    up as they are). Its layer (a router gate and fused expert weights) is one no head of either engine loads
    (each head's load_weights, as the tables record it): no head is advised."""
    d, t = make_pair(tmp_path, "qwen3-30b-a3b_specforge-moe-draft")
    for engine, other in (("sglang", "vLLM 0.33.0"), ("vllm", "SGLang 0.5.23")):
        rc, rep = doctor(d, t, "--engine", engine)
        msg = finding(rep, "E_DRAFT_CLASS")["message"]
        assert rc == 1 and "Qwen3MoEForCausalLMEagle3" in msg, engine
        assert "serves no EAGLE-3 head with this draft's decoder layer" in msg and "mlp.gate_weight" in msg, msg
        assert f"{other} has no EAGLE-3 head for it either" in msg and "Set \"architectures\"" not in msg, msg


def test_gpt_oss_moe_draft_gets_no_guessed_head(tmp_path):
    """SpecForge's gpt-oss-20B config (GptOssForCausalLMEagle3: LlamaForCausalLMEagle3 with its midlayer.mlp
    replaced by transformers' GptOssMLP, a router and fused experts) on gpt-oss. SGLang 0.5.23 has no head for that
    layer: neither LlamaForCausalLMEagle3 nor Eagle3DeepseekV2ForCausalLM loads mlp.router.* / mlp.experts.* (their
    load_weights, read from SGLang's source, map only a dense gate/up/down MLP). The error must say so, name the
    tensors, say what vLLM's table says about its heads, and never advise the first head alphabetically (an MLA
    head for a gpt-oss draft, the old "e.g. Eagle3DeepseekV2ForCausalLM")."""
    d, t = make_pair(tmp_path, "gpt-oss-20b_specforge-moe")
    assert json.loads((d / "config.json").read_text())["architectures"] == ["GptOssForCausalLMEagle3"]
    for engine, other in (("sglang", "vLLM 0.33.0"), ("vllm", "SGLang 0.5.23")):
        rc, rep = doctor(d, t, "--engine", engine)
        msg = finding(rep, "E_DRAFT_CLASS")["message"]
        assert rc == 1 and "GptOssForCausalLMEagle3" in msg, engine
        assert "serves no EAGLE-3 head with this draft's decoder layer" in msg, msg
        assert "mlp.router.weight" in msg and "mlp.experts.gate_up_proj" in msg and "mixture-of-experts" in msg, msg
        assert f"{other} has no EAGLE-3 head for it either" in msg, msg
        assert "e.g." not in msg and "Set \"architectures\" in the draft's config.json to" not in msg, msg
        assert "Renaming \"architectures\" cannot" in msg


def test_draft_class_advice_follows_the_layer_tensors(tmp_path):
    """A draft under a name that is no head: the head advised is the one whose load_weights loads the checkpoint's
    layer. TorchSpec's MLA draft (q_a_proj / kv_a_proj_with_mqa / kv_b_proj ...) -> Eagle3DeepseekV2ForCausalLM on
    both engines; the llama-layout gpt-oss-120b draft -> LlamaForCausalLMEagle3 (SGLang) / Eagle3LlamaForCausalLM
    (vLLM, EAGLEConfig keeps an Eagle3-suffixed name as it is)."""
    wrong = {"architectures": ["KimiK25MLADraftEagle3"]}
    d, t = make_pair(tmp_path / "mla", "kimi-k25_torchspec-mla", edit=wrong)
    assert "layers.0.self_attn.kv_b_proj.weight" in read_weight_headers(d)
    for engine in ("sglang", "vllm"):
        rc, rep = doctor(d, t, "--engine", engine)
        msg = finding(rep, "E_DRAFT_CLASS")["message"]
        assert rc == 1 and "to Eagle3DeepseekV2ForCausalLM:" in msg and "self_attn.kv_b_proj.weight" in msg, msg
        assert "to LlamaForCausalLMEagle3" not in msg and "to Eagle3LlamaForCausalLM" not in msg
    d, t = make_pair(tmp_path / "llama", "gpt-oss-120b_specforge", edit={"architectures": ["GptOssDenseEagle3"]})
    for engine, head in (("sglang", "LlamaForCausalLMEagle3"), ("vllm", "Eagle3LlamaForCausalLM")):
        rc, rep = doctor(d, t, "--engine", engine)
        msg = finding(rep, "E_DRAFT_CLASS")["message"]
        assert rc == 1 and f"to {head}:" in msg and "self_attn.k_proj.weight" in msg, msg
        assert "to Eagle3DeepseekV2ForCausalLM" not in msg and "Eagle3DeepseekV2ForCausalLM does not load" in msg
    msg = finding(rep, "E_DRAFT_CLASS")["message"]  # vLLM: its Qwen3 head also loads these, but needs q_norm/k_norm
    assert "Eagle3Qwen3ForCausalLM builds model.layers.0.self_attn.k_norm.weight" in msg, msg


def test_gemma4_captures_boundary_L_and_scales_embeddings(tmp_path):
    """SpecForge's Gemma-4-26B-A4B config ids [5, 17, 29] on the 30-layer target: id 29 names boundary 30 = L,
    which Gemma4TextModel captures after its last layer (`if num_layers in self.layers_to_capture`), so SGLang feeds
    all three. Its embeddings are scaled (embed_scale = hidden_size**0.5) and the draft head applies no scale:
    W_EMBED_SCALE. vLLM 0.33.0's V2 runner reads no nested ids: an error."""
    d, t = make_pair(tmp_path, "gemma-4-26b-a4b_specforge")
    rc, rep = doctor(d, t)
    assert rc == 0 and slots(rep) == [6, 18, 30] and all(s["captured"] for s in rep["slots"])
    assert "embed_scale" in finding(rep, "W_EMBED_SCALE")["message"]
    rc, rep = doctor(d, t, "--engine", "vllm")
    assert rc == 1 and "E_WIRING_MISMATCH" in codes(rep, "error")


def test_llama4_scout_wrapper(tmp_path):
    """SpecForge's Llama-4-Scout config on Llama-4-Scout: SGLang's Llama4ForConditionalGeneration hands the ids
    to its language model (Llama4ForCausalLM, LlamaForCausalLM's rule: id + 1)."""
    d, t = make_pair(tmp_path, "llama-4-scout_specforge")
    rc, rep = doctor(d, t)
    assert rc == 0 and slots(rep) == [2, 24, 45] and rep["engine"]["class"].endswith("Llama4ForConditionalGeneration")
    rc, rep = doctor(d, t, "--engine", "vllm")
    assert rc == 0 and slots(rep) == [2, 24, 45]


def test_minimax_m2_5_and_kimi_mla_head(tmp_path):
    """TorchSpec's MiniMax-M2.5 draft on MiniMax-M2.5 (MiniMaxM2ForCausalLM, id + 1), and TorchSpec's MLA draft
    for Kimi-K2.5 (Eagle3DeepseekV2ForCausalLM, SGLang's second EAGLE-3 head; ids [1, 29, 57], first id 1: +1)."""
    d, t = make_pair(tmp_path / "m", "minimax-m2.5_torchspec")
    rc, rep = doctor(d, t)
    # TorchSpec's template is untied and has no draft_vocab_size: SGLang's own ModelConfig gives the head a
    # LlamaConfig without it and LlamaForCausalLMEagle3.__init__ reads config.draft_vocab_size (AttributeError at
    # start-up; tests/sglang/test_untied_lm_head.py builds the class to show it)
    assert rc == 1 and codes(rep, "error") == ["E_DRAFT_VOCAB_SIZE_MISSING"] and slots(rep) == [2, 31, 59]
    assert 'Set "draft_vocab_size": 200064' in finding(rep, "E_DRAFT_VOCAB_SIZE_MISSING")["message"]
    d, t = make_pair(tmp_path / "k", "kimi-k25_torchspec-mla")
    rc, rep = doctor(d, t)
    assert rc == 0 and slots(rep) == [2, 30, 58] and "E_DRAFT_CLASS" not in codes(rep)


def test_llava_is_refused_by_sglang_and_served_by_vllm(tmp_path):
    """llava-hf's LLaVA-1.5-7B config (text_config without num_hidden_layers: LlamaConfig's default 32 applies)
    with SpecForge's LLaVA draft config. SGLang's LlavaForConditionalGeneration has no set_eagle3_layers_to_capture
    (attention_backend_setup raises at start-up): E_TARGET_UNSUPPORTED and no layer verdict at all. vLLM's
    LlavaForConditionalGeneration implements SupportsEagle3: served."""
    d, t = make_pair(tmp_path, "llava-1.5-7b_specforge")
    rc, rep = doctor(d, t)
    assert rc == 1 and codes(rep, "error") == ["E_TARGET_UNSUPPORTED"] and rep["slots"] == []
    assert rep["target"]["num_layers"] == 32 and rep["engine"]["supported"] is False
    assert "vLLM 0.33.0 serves it" in finding(rep, "E_TARGET_UNSUPPORTED")["message"]
    rc, rep = doctor(d, t, "--engine", "vllm")
    assert rc == 0 and slots(rep) == [2, 16, 29]


def test_phi4(tmp_path):
    """SpecForge's Phi-4 config (its draft layer typed phi3) on phi-4 (Phi3ForCausalLM: SGLang's llama code)."""
    d, t = make_pair(tmp_path, "phi-4_specforge")
    rc, rep = doctor(d, t)
    assert rc == 0 and slots(rep) == [2, 20, 37] and rep["engine"]["class"].endswith("Phi3ForCausalLM")


@needs_sglang
def test_every_sglang_eagle3_family_has_a_case_or_is_named_missing():
    """Each SGLang 0.5.23 model file with set_eagle3_layers_to_capture has a case here (its class or the model
    that captures for it), or README.md names it among the families no real config was found for."""
    import re

    import sglang

    from eagle3_ops.doctor import tables

    models = Path(sglang.__file__).parent / "srt" / "models"
    files = {p.stem for p in models.glob("*.py") if "def set_eagle3_layers_to_capture" in p.read_text()}
    rows = tables.load("sglang")["targets"]
    covered = set()
    for case in sorted(p.name for p in HERE.iterdir() if (p / "target" / "config.json").is_file()):
        cfg = json.loads((HERE / case / "target" / "config.json").read_text())
        arch = next((a for a in cfg.get("architectures", []) if a in rows), None)
        if arch is None:
            continue
        for key in ("class", "holder_class"):  # the class, the model that captures for it, and the code that ran
            if rows[arch].get(key):
                covered.add(rows[arch][key].split(".")[3])
        covered.update(m.split(".")[3] for m in rows[arch].get("ran_modules", []))
    named = set(re.findall(r"`(\w+)\.py`", (HERE / "README.md").read_text().split("## No real config found")[1]))
    assert files - covered == named, (sorted(files - covered), sorted(named))


@pytest.mark.parametrize("ids", [[-1, 2, 30], [1, 15, 28]])
def test_an_edited_config_that_agrees_with_itself_is_not_called_right(tmp_path, ids):
    """The EAGLE authors' Llama-3.1-8B draft config with SGLang's head class and ids added by hand (an embedding
    capture, or any three layers): every reading of the ids is what SGLang feeds, so no finding fires. The
    conclusion says only that (the configs agree with each other) and gives the commands that verify it; before, it
    said "the wiring looks right"."""
    draft, target = make_pair(tmp_path, "llama-3.1-8b_eagle-official-train", ids=ids,  # the target's context too
                              edit={"architectures": ["LlamaForCausalLMEagle3"], "max_position_embeddings": 131072})
    rc, rep = doctor(draft, target, "--engine-code", "table")
    assert not codes(rep, "error") and not codes(rep, "warning"), rep["findings"]
    said = rep["conclusion"]
    assert said.startswith("the configs agree with each other") and "edited since training" in said, said
    assert f"capture-states --model {target} --out states.safetensors" in said, said
    assert f"doctor --draft {draft} --target {target} --replay states.safetensors" in said, said


def _hf_cache(cache: Path, repo_id: str, folder: Path, only=None) -> Path:
    """``folder`` as huggingface_hub keeps a download of ``repo_id`` in ``cache`` (refs/main -> snapshots/COMMIT);
    ``only``: the file names downloaded (``hf download ID --include '*.json'``), default all."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        if only is None or f.name in only:
            shutil.copy(f, snap / f.name)
    return snap


def test_hugging_face_ids_are_read_from_the_cache_and_configs_alone_are_checked(tmp_path, monkeypatch, capsys):
    """``--draft lmsys/...`` with the draft in the Hugging Face cache is read from there (as the live check and
    SGLang resolve it); with only its configs downloaded every check they allow runs and the ones that need the
    weights are named (W_NO_WEIGHTS), and --replay says it needs them; an id that is not cached is one line saying
    how to download it. Before: "does not exist" (exit 2), and "no weights in draft" (exit 2)."""
    import huggingface_hub.constants

    from eagle3_ops.doctor import cli

    draft, target = make_pair(tmp_path, "llama-3.1-8b_eagle-official-train", ids=[1, 15, 28],
                              edit={"architectures": ["LlamaForCausalLMEagle3"]})
    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    draft_id, target_id = "lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B", "meta-llama/Llama-3.1-8B-Instruct"
    t_snap = _hf_cache(cache, target_id, target)
    d_snap = _hf_cache(cache, draft_id, draft)
    monkeypatch.chdir(tmp_path)
    rc, rep = doctor(draft_id, target_id, "--engine-code", "table")
    assert rc == 0 and rep["draft"]["path"] == str(d_snap) and rep["target"]["path"] == str(t_snap), rep
    assert "W_NO_WEIGHTS" not in codes(rep, "warning")

    shutil.rmtree(cache / ("models--" + draft_id.replace("/", "--")))
    _hf_cache(cache, draft_id, draft, only={"config.json"})
    rc, rep = doctor(draft_id, target_id, "--engine-code", "table")
    assert rc == 0 and codes(rep, "warning") == ["W_NO_WEIGHTS", "W_DRAFT_CONTEXT_SHORT"], rep["findings"]
    said = finding(rep, "W_NO_WEIGHTS")["message"]
    assert "E_FC_WIDTH" in said and "E_DRAFT_CLASS" in said and "--replay" in said, said
    assert [s["capture_index"] for s in rep["slots"]] == [2, 16, 29]
    capsys.readouterr()
    assert cli.main(["--draft", draft_id, "--target", target_id, "--engine-code", "table", "--replay", "s.st"]) == 2
    err = capsys.readouterr().err
    assert "--replay runs the draft" in err and "holds no weights" in err, err

    rc = cli.main(["--draft", "lmsys/not-downloaded", "--target", target_id, "--engine-code", "table"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "not in the Hugging Face cache" in err and "`hf download lmsys/not-downloaded`" in err, err


def test_configs_alone_still_find_what_configs_show(tmp_path):
    """Without weights the config-level errors still fire: the EAGLE authors' training config names a plain
    LlamaForCausalLM (E_DRAFT_CLASS: which head, says why it cannot tell without the layer tensors), and ids of the
    last layer SGLang does not capture."""
    draft, target = make_pair(tmp_path, "llama-3.1-8b_eagle-official-train", ids=[1, 15, 31])
    for f in draft.glob("*.safetensors"):
        f.unlink()
    rc, rep = doctor(draft, target, "--engine-code", "table")
    assert rc == 1 and set(codes(rep, "error")) == {"E_DRAFT_CLASS", "E_LAST_LAYER_NOT_CAPTURED"}, rep["findings"]
    assert "decoder-layer tensors are in the weights" in finding(rep, "E_DRAFT_CLASS")["message"]
    assert codes(rep, "warning") == ["W_NO_WEIGHTS", "W_DRAFT_CONTEXT_SHORT"]


@needs_sglang
def test_a_family_sglang_has_no_class_for_is_named_as_the_users_model(tmp_path):
    """OLMo-3 (transformers 5.19's own Olmo3Config, the class that defines the model; SGLang 0.5.23 has OLMo and
    OLMo-2 classes only): SGLang's own ModelRegistry falls back to its Transformers backend, which has no
    set_eagle3_layers_to_capture. The advice names the user's Olmo3ForCausalLM, never SGLang's fallback class as if
    it were theirs. Before: "an engine that captures for TransformersForCausalLM"."""
    import transformers

    draft, target = make_pair(tmp_path, "llama-3.1-8b_eagle-official-train", ids=[1, 15, 28])
    cfg = transformers.Olmo3Config(vocab_size=128256).to_dict()
    cfg["architectures"] = ["Olmo3ForCausalLM"]
    (target / "config.json").write_text(json.dumps(cfg))
    rc, rep = doctor(draft, target)
    said = finding(rep, "E_TARGET_UNSUPPORTED")["message"]
    assert rc == 1 and rep["engine"]["class"] == "TransformersForCausalLM", rep["engine"]
    assert "captures for Olmo3ForCausalLM" in said and "captures for TransformersForCausalLM" not in said, said
    assert "vLLM 0.33.0 serves it through its Transformers backend" in said, said


@needs_sglang
def test_a_quoted_library_error_is_never_cut_mid_word(tmp_path):
    """A model_type neither transformers nor SGLang defines: SGLang's config parser raises transformers' long
    ValueError, which the doctor quotes (W_CONFIG_ASSUMED) cut at a sentence end and marked, never mid-word."""
    import re

    draft, target = make_pair(tmp_path, "llama-3.1-8b_eagle-official-train", ids=[1, 15, 28])
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(model_type="acme_llm", architectures=["AcmeForCausalLM"])
    (target / "config.json").write_text(json.dumps(cfg))
    rc, rep = doctor(draft, target)
    said = finding(rep, "W_CONFIG_ASSUMED")["message"]
    quoted = re.search(r"SGLang's config parser failed \(ValueError: (.*?)\); neither", said).group(1)
    assert "model type `acme_llm`" in quoted, said
    assert re.search(r"[.`'\")]( \[\.\.\.\])?$", quoted), f"cut mid-sentence: {quoted!r}"


@pytest.mark.parametrize("engine_code", ["table", "auto"])
def test_an_untied_draft_without_its_lm_head_is_an_error(tmp_path, engine_code):
    """The EAGLE authors' Llama-3.1-8B draft config (draft_vocab_size 32000, untied) with SGLang's head class and no
    lm_head.weight in the checkpoint: SGLang 0.5.23's LlamaForCausalLMEagle3 builds its own 32000-row head and never
    fills it (tests/sglang/test_untied_lm_head.py holds the rule to the class). Before: OK. With draft_vocab_size
    null SGLang gives it the target's head in place of the trained one; without the key it raises at start-up."""
    arch = {"architectures": ["LlamaForCausalLMEagle3"]}
    draft, target = make_pair(tmp_path / "a", "llama-3.1-8b_eagle-official-train", ids=[1, 15, 28], edit=arch,
                              drop=["lm_head.weight"])
    rc, rep = doctor(draft, target, "--engine-code", engine_code)
    assert rc == 1 and codes(rep, "error") == ["E_NO_LM_HEAD"], rep["findings"]
    said = finding(rep, "E_NO_LM_HEAD")["message"]
    assert "32000-row lm_head" in said and "uninitialised" in said and "re-export" in said, said
    assert "null" not in said, "a draft with d2t (a reduced vocabulary) cannot share the target's head"

    draft, target = make_pair(tmp_path / "b", "llama-3.1-8b_eagle-official-train", ids=[1, 15, 28], edit=arch)
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(dict(cfg, draft_vocab_size=None)))  # the 32000-row head stays
    rc, rep = doctor(draft, target, "--engine-code", engine_code)
    assert rc == 1 and codes(rep, "error") == ["E_LM_HEAD_REPLACED"], rep["findings"]
    assert 'Set "draft_vocab_size": 32000' in finding(rep, "E_LM_HEAD_REPLACED")["message"]

    draft, target = make_pair(tmp_path / "c", "llama-3.1-8b_eagle-official-train", ids=[1, 15, 28], edit=arch)
    cfg = json.loads((draft / "config.json").read_text())
    del cfg["draft_vocab_size"]
    (draft / "config.json").write_text(json.dumps(cfg))
    rc, rep = doctor(draft, target, "--engine-code", engine_code)
    assert "E_DRAFT_VOCAB_SIZE_MISSING" in codes(rep, "error"), rep["findings"]
    assert 'Set "draft_vocab_size": 32000' in finding(rep, "E_DRAFT_VOCAB_SIZE_MISSING")["message"]


def _speculators_draft(tmp_path, ids, extra_layer=None) -> tuple:
    """A speculators-format (0.9.0 layout: top-level eagle_aux_hidden_state_layer_ids, the layer under
    transformer_layer_config) draft of the EAGLE authors' Llama-3.1-8B layer config, its fc as wide as its ids."""
    src = HERE / "llama-3.1-8b_eagle-official-train"
    target = tmp_path / "target"
    shutil.copytree(src / "target", target)
    layer = json.loads((src / "draft" / "config.json").read_text())
    layer.update(extra_layer or {})
    cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "transformer_layer_config": layer,
           "eagle_aux_hidden_state_layer_ids": ids, "draft_vocab_size": layer["draft_vocab_size"],
           "norm_before_residual": False,
           "speculators_config": {"algorithm": "eagle3", "verifier": {"architectures": ["LlamaForCausalLM"]}}}
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(cfg))
    shapes = draft_shapes(layer, 4096, k=len(ids))
    write_sparse_safetensors(draft / "model.safetensors", shapes, vocab_maps(32000, 128256))
    return draft, target


def test_vllm_sizes_the_fc_by_its_own_rule_not_the_top_level_ids(tmp_path):
    """vLLM 0.33.0's Eagle3LlamaForCausalLM sizes its fc from num_aux_hidden_states, else eagle_config's ids, else 3
    (the table's fc_slots_from, read from llama_eagle3.py), never the top-level ids a speculators draft carries:
    a speculators draft with 4 aux layers fails to load (16384 vs 12288). Before: OK. With num_aux_hidden_states in
    transformer_layer_config (which vLLM builds the draft's config from) it loads."""
    draft, target = _speculators_draft(tmp_path / "a", [2, 10, 20, 29])
    rc, rep = doctor(draft, target, "--engine", "vllm")
    assert rc == 1 and "E_FC_WIDTH" in codes(rep, "error"), rep["findings"]
    said = next(f["message"] for f in rep["findings"] if f["code"] == "E_FC_WIDTH" and "vLLM" in f["message"])
    assert "(16384 vs 12288)" in said and "Eagle3LlamaForCausalLM" in said, said
    assert '"num_aux_hidden_states": 4 to transformer_layer_config' in said, said
    draft, target = _speculators_draft(tmp_path / "b", [2, 10, 20, 29], {"num_aux_hidden_states": 4})
    rc, rep = doctor(draft, target, "--engine", "vllm")
    assert "E_FC_WIDTH" not in codes(rep, "error"), rep["findings"]
    draft, target = _speculators_draft(tmp_path / "c", [2, 16, 29])  # three: vLLM's default happens to fit
    rc, rep = doctor(draft, target, "--engine", "vllm")
    assert "E_FC_WIDTH" not in codes(rep, "error"), rep["findings"]


def test_the_vllm_fc_rule_is_read_from_its_heads():
    """The table's fc_slots_from for vLLM 0.33.0's heads, as its source reads the keys (tools/vllm_tables.py)."""
    heads = tables.load("vllm")["draft_heads"]
    assert heads["Eagle3LlamaForCausalLM"]["fc_slots_from"] == [
        "num_aux_hidden_states", "eagle_config.eagle_aux_hidden_state_layer_ids", 3]
    assert heads["Eagle3Qwen3ForCausalLM"]["fc_slots_from"] == [
        "num_aux_layers", "num_aux_hidden_states", "eagle_aux_hidden_state_layer_ids",
        "eagle_config.eagle_aux_hidden_state_layer_ids", 3]


@pytest.mark.parametrize("engine_code", ["table", "auto"])
def test_a_draft_trained_on_a_shorter_context_is_named(tmp_path, engine_code):
    """The EAGLE authors' Llama-3.1-8B draft config (max_position_embeddings 2048) on Llama-3.1 (131072, llama3
    RoPE: SGLang's get_context_length applies no factor): SGLang 0.5.23 gives the draft the target's length and
    refuses to start without SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1; vLLM raises the draft's length silently.
    Either way acceptance past 2048 tokens falls. Before: nothing. A server started with --context-length 2048 is
    fine; one running longer (the variable set) is told."""
    from eagle3_ops.doctor.checks import Options, run_checks
    from eagle3_ops.doctor.configs import parse_draft

    draft, target = make_pair(tmp_path, "llama-3.1-8b_eagle-official-train", ids=[1, 15, 28],
                              edit={"architectures": ["LlamaForCausalLMEagle3"]})
    rc, rep = doctor(draft, target, "--engine-code", engine_code)
    said = finding(rep, "W_DRAFT_CONTEXT_SHORT")["message"]
    assert rc == 0 and "2048" in said and "131072" in said and "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN" in said
    assert "--context-length 2048" in said, said
    assert ("get_context_length" in said) == (engine_code == "auto" and rep["engine"]["rules_from"].startswith(
        "the installed")), said
    rc, rep = doctor(draft, target, "--engine", "vllm")
    assert "_maybe_override_draft_max_position_embeddings" in finding(rep, "W_DRAFT_CONTEXT_SHORT")["message"]

    t, d = parse_target(target), parse_draft(draft)
    weights = read_weight_headers(draft)
    for served, fires in ((2048, False), (None, True), (8192, True)):
        rep = run_checks(t, d, weights, Options(engine_code="table", server_running=True,
                                                served_context_length=served))
        got = rep.find(doctor_codes.W_DRAFT_CONTEXT_SHORT)
        assert (got is not None) == fires, (served, [f.code for f in rep.findings])
        if got is not None:
            assert "started it with SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN" in got.text
