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
from eagle3_ops.doctor.configs import parse_target

HERE = Path(__file__).resolve().parent

_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64", torch.bool: "BOOL"}


def draft_shapes(cfg: dict, target_hidden: int, k: int = 3) -> dict:
    """name -> (shape, dtype) of an EAGLE-3 llama draft in SpecForge/SGLang naming."""
    h = cfg["hidden_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    dv = cfg.get("draft_vocab_size") or vocab
    dt = torch.bfloat16
    return {
        "fc.weight": ((h, k * target_hidden), dt),
        "midlayer.input_layernorm.weight": ((h,), dt),
        "midlayer.hidden_norm.weight": ((h,), dt),
        "midlayer.self_attn.q_proj.weight": ((heads * hd, 2 * h), dt),
        "midlayer.self_attn.k_proj.weight": ((kv * hd, 2 * h), dt),
        "midlayer.self_attn.v_proj.weight": ((kv * hd, 2 * h), dt),
        "midlayer.self_attn.o_proj.weight": ((h, heads * hd), dt),
        "midlayer.post_attention_layernorm.weight": ((h,), dt),
        "midlayer.mlp.gate_proj.weight": ((inter, h), dt),
        "midlayer.mlp.up_proj.weight": ((inter, h), dt),
        "midlayer.mlp.down_proj.weight": ((h, inter), dt),
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


def make_pair(tmp_path, case: str, *, ids=None, shards: int = 1, bin_format: bool = False):
    """(draft_dir, target_dir) for a case folder; ``ids`` replaces eagle_config's ids (a derived case)."""
    src = HERE / case
    target = tmp_path / "target"
    shutil.copytree(src / "target", target)
    draft = tmp_path / "draft"
    draft.mkdir()
    raw = (src / "draft" / "config.json").read_text()
    cfg = json.loads(raw)
    if ids is not None:
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
        raw = json.dumps(cfg, indent=2)
    (draft / "config.json").write_text(raw)
    t_hidden = parse_target(target).hidden_size  # as transformers reads it (llava-hf's text_config omits it)
    shapes = draft_shapes(cfg, t_hidden)
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
    assert rc == 1 and "LlamaForCausalLM" in msg and "LlamaForCausalLMEagle3" in msg


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