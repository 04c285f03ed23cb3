"""Helpers and fixtures for the wiring-doctor tests (imported by tests/test_doctor_*.py).

- ``write_target`` / ``write_draft``: hand-written target configs and draft checkpoints (config.json +
  a small model.safetensors with SpecForge/SGLang tensor names) for the config checks.
- ``run_doctor``: ``eagle3_ops.doctor.cli.main([... , "--json"])`` in-process -> (exit status, JSON report).
- ``eagle3_ops``: ``python -m eagle3_ops ...`` as a fresh process (tests/spawn.py) -> CompletedProcess.
- ``tiny_pair`` / ``tiny_states`` (session fixtures): the real tiny target + trained draft of
  ``eagle3_ops.doctor.tiny``, built once per test session under pytest's base temp dir (shared by every
  test module that imports the fixtures), and its recorded states.
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import List, Optional

import pytest
import torch
from safetensors.torch import save_file

import machine
import spawn
from eagle3_ops.doctor import cli


# the architecture each model type's published configs name (what engines resolve the class from)
_ARCH = {"llama": ["LlamaForCausalLM"], "deepseek_v3": ["DeepseekV3ForCausalLM"], "gpt_oss": ["GptOssForCausalLM"],
         "qwen3": ["Qwen3ForCausalLM"]}


def write_target(path, *, model_type: str = "llama", num_layers: int = 32, hidden: int = 16, vocab: int = 128,
                 nested_outer: Optional[str] = None, architectures: Optional[List[str]] = None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # a config transformers' class accepts (heads divide the hidden size), read the way engines read it
    cfg = {"model_type": model_type, "architectures": architectures or _ARCH.get(model_type, []),
           "num_hidden_layers": num_layers, "hidden_size": hidden, "vocab_size": vocab,
           "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 2 * hidden}
    if nested_outer:  # Kimi-K2.5 style: the language model lives under text_config
        cfg = {"model_type": nested_outer, "architectures": ["KimiK25ForConditionalGeneration"], "text_config": cfg}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def draft_tensors(*, hidden: int = 16, target_hidden: int = 16, k: int = 3, fc_in: Optional[int] = None,
                  vocab: int = 128, draft_vocab: int = 64) -> dict:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    hot = torch.arange(draft_vocab) * (vocab // draft_vocab)  # every (vocab/draft_vocab)-th target token
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    return {
        "fc.weight": r(hidden, fc_in if fc_in is not None else k * target_hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": r(hidden, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": r(hidden, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": r(hidden, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": r(hidden, hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.mlp.gate_proj.weight": r(2 * hidden, hidden),
        "midlayer.mlp.up_proj.weight": r(2 * hidden, hidden),
        "midlayer.mlp.down_proj.weight": r(hidden, 2 * hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": r(draft_vocab, hidden),
        "d2t": hot - torch.arange(draft_vocab),
        "t2d": t2d,
    }


def write_draft(path, *, ids: Optional[List[int]] = None, top_ids: Optional[List[int]] = None,
                dialect: str = "specforge", hidden: int = 16, target_hidden: int = 16, k: Optional[int] = None,
                vocab: int = 128, draft_vocab: int = 64, fc_in: Optional[int] = None, extra: Optional[dict] = None,
                tensors: Optional[dict] = None, drop: tuple = ()) -> Path:
    """A draft checkpoint. ``ids``: the dialect's main ids (eagle_config for specforge, top level for
    speculators); ``top_ids``: an extra top-level copy (specforge) / eagle_config copy (speculators)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    layer = {"model_type": "llama", "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_attention_heads": 2,
             "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": vocab, "rms_norm_eps": 1e-6,
             "hidden_act": "silu", "tie_word_embeddings": False}
    if dialect == "specforge":
        cfg = dict(layer, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
                   target_hidden_size=target_hidden)
        if ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
        if top_ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = top_ids
    elif dialect == "speculators":
        cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
               "transformer_layer_config": layer, "draft_vocab_size": draft_vocab, "target_hidden_size": target_hidden,
               "norm_before_residual": False,
               "speculators_config": {"algorithm": "eagle3", "verifier": {"architectures": ["LlamaForCausalLM"]}}}
        if ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = ids
        if top_ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": top_ids}
    elif dialect == "eagle-original":
        cfg = dict(layer, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
                   target_hidden_size=target_hidden)
    else:
        raise ValueError(dialect)
    cfg.update(extra or {})
    (path / "config.json").write_text(json.dumps(cfg))
    if k is None:
        k = len(ids) if ids else 3
    t = draft_tensors(hidden=hidden, target_hidden=target_hidden, k=k, fc_in=fc_in, vocab=vocab,
                      draft_vocab=draft_vocab)
    t.update(tensors or {})
    for name in drop:
        t.pop(name)
    save_file({n: v.contiguous() for n, v in t.items()}, str(path / "model.safetensors"))
    return path


def eagle3_ops(*args, timeout: float = 120, env_extra: Optional[dict] = None):
    """``python -m eagle3_ops ...`` as a fresh process (tests/spawn.py), stdin empty; ``timeout`` is seconds on
    an idle machine, scaled to this one now. A doctor run reads SGLang's rules from the pinned table
    (``--engine-code table``): importing SGLang costs about a minute per process on 2 cores; the in-process
    tests run the installed SGLang."""
    if args and args[0] == "doctor" and "--engine-code" not in args:
        args = (*args, "--engine-code", "table")
    env = dict(spawn.base_env(), **(env_extra or {}))
    return spawn.run(args, env=env, timeout=machine.timeout(timeout))


def run_doctor(*args: str):
    """Run the doctor in-process with --json; returns (exit status, parsed report or None, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([*map(str, args), "--json"])
    report = json.loads(out.getvalue()) if out.getvalue().strip() else None
    return rc, report, err.getvalue()


def codes(report, severity: Optional[str] = None) -> List[str]:
    return [f["code"] for f in report["findings"] if severity is None or f["severity"] == severity]


def finding(report, code: str) -> dict:
    for f in report["findings"]:
        if f["code"] == code:
            return f
    raise AssertionError(f"no finding {code}; findings: {[f['code'] for f in report['findings']]}")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    from eagle3_ops.doctor.tiny import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.getbasetemp() / "doctor_tiny_pair")


@pytest.fixture(scope="session")
def tiny_states(tiny_pair):
    """STATES recorded from the tiny target by ``capture-states`` (the CLI code path), once per session."""
    out = tiny_pair.root / "states.safetensors"
    if not out.exists():
        tmp = tiny_pair.root / "states.partial.safetensors"
        rc = cli.capture_states_main(["--model", str(tiny_pair.target_dir), "--prompts", str(tiny_pair.prompts_file),
                                      "--out", str(tmp), "--dtype", "float32"])
        assert rc == 0
        shutil.move(str(tmp), str(out))
    return out


def copy_draft_with_ids(source, dest, *, nested=None, top=None) -> Path:
    """A draft (``source``: a folder, or a pair with ``draft_dir``) with its config's ids edited (weights
    unchanged)."""
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(getattr(source, "draft_dir", source), dest)
    cfg = json.loads((dest / "config.json").read_text())
    if nested is not None:
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = nested
    if top is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = top
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest
