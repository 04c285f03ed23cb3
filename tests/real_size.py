"""Full-size random checkpoints for the live check's replay at the seed's real dimensions (issue 37).

Two pairs, from the published configs in ``tests/doctor/real``:

- ``kimi``: the Kimi-K2.5 target's config (61 layers, hidden 7168, vocabulary 163840) and the published MLA
  draft shape (TorchSpec's ``kimi_k25_eagle3_mla.json``: ``Eagle3DeepseekV2ForCausalLM``, 1 layer, hidden 7168,
  q_lora 1536, kv_lora 512, 64 heads, intermediate 18432) with a 32000-token draft vocabulary (the published
  SpecForge Kimi drafts' size; the TorchSpec template keeps the whole 163840);
- ``llama70b``: Llama-3.3-70B's config (80 layers, hidden 8192, vocabulary 128256) and SpecForge's published
  ``LlamaForCausalLMEagle3`` draft for it (hidden 8192, intermediate 28672, 64 heads / 8 KV heads, draft
  vocabulary 32000).

Weights are random (bfloat16, as published), written as real full-size safetensors under the names SGLang's
classes load (the tiny tests' twins on the meta device give every name and shape); the STATES file holds every
boundary 0..L of random prompts, as the live check records them. Random weights predict nothing: these pairs
measure time, CPU and memory (and exercise the "no wiring fits" verdict), not which wiring wins.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

import torch

REAL = Path(__file__).resolve().parent / "doctor" / "real"
DRAFT_VOCAB = 32000
PAIRS = {
    "kimi": ("kimi-k25_torchspec-mla", {"draft_vocab_size": DRAFT_VOCAB}),
    "llama70b": ("llama-3.3-70b_specforge", {}),
}


def _shapes(kind: str, cfg: dict) -> Dict[str, tuple]:
    """Checkpoint tensor name -> shape, from the twins the tiny tests train (built on the meta device)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang"))
    with torch.device("meta"):
        if kind == "kimi":
            from kimi_pair import MlaDraftTwin

            mcfg = dict(cfg, target_hidden_size=cfg["hidden_size"], fc_norm=False)
            sd = MlaDraftTwin(mcfg).checkpoint_state_dict()
        else:
            from eagle3_ops.doctor.draft import DraftSpec, Eagle3Draft

            spec = DraftSpec(hidden_size=cfg["hidden_size"], target_hidden_size=cfg["hidden_size"], num_aux=3,
                             vocab_size=cfg["vocab_size"], draft_vocab_size=cfg["draft_vocab_size"],
                             num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"],
                             head_dim=cfg.get("head_dim"), intermediate_size=cfg["intermediate_size"])
            sd = Eagle3Draft(spec).checkpoint_state_dict(include_embeddings=False)
    return {n: tuple(t.shape) for n, t in sd.items()}


def build(kind: str, root, *, positions=(256, 1024), prompt_tokens: int = 257, seed: int = 0) -> dict:
    """Write ``root/{target,draft}`` and ``root/states-{N}.safetensors`` for each N in ``positions`` (reused
    when ``root/DONE`` matches). Returns {"target", "draft", "states": {N: path}, "num_layers", "hidden"}."""
    from safetensors.torch import save_file

    from eagle3_ops.doctor.states import write_states

    name, overrides = PAIRS[kind]
    root = Path(root)
    params = {"kind": kind, "positions": list(positions), "prompt_tokens": prompt_tokens, "seed": seed, "v": 1}
    done = root / "DONE"
    tcfg = json.loads((REAL / name / "target" / "config.json").read_text())
    text = tcfg.get("text_config", tcfg)
    L, H, V = int(text["num_hidden_layers"]), int(text["hidden_size"]), int(text["vocab_size"])
    out = {"target": root / "target", "draft": root / "draft", "num_layers": L, "hidden": H,
           "states": {n: root / f"states-{n}.safetensors" for n in positions}}
    if done.exists() and json.loads(done.read_text()) == params:
        return out
    gen = torch.Generator().manual_seed(seed)
    out["target"].mkdir(parents=True, exist_ok=True)
    (out["target"] / "config.json").write_text(json.dumps(tcfg, indent=1))
    dcfg = dict(json.loads((REAL / name / "draft" / "config.json").read_text()), **overrides)
    dcfg["eagle_config"] = dict(dcfg.get("eagle_config") or {}, use_aux_hidden_state=True)
    out["draft"].mkdir(parents=True, exist_ok=True)
    (out["draft"] / "config.json").write_text(json.dumps(dcfg, indent=1))
    tensors = {}
    for n, shape in _shapes(kind, dcfg).items():
        if n == "d2t":
            hot = torch.sort(torch.randperm(V, generator=gen)[:shape[0]]).values
            tensors[n] = hot - torch.arange(shape[0])
        elif n == "t2d":
            continue  # SGLang's heads load d2t only
        elif n.endswith("norm.weight") or ".norm" in n or "layernorm" in n:
            tensors[n] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            fan_in = shape[-1] if len(shape) > 1 else 1
            tensors[n] = (torch.randn(shape, generator=gen) / fan_in ** 0.5).to(torch.bfloat16)
    save_file(tensors, str(out["draft"] / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    for n, path in out["states"].items():
        prompts = []
        for _ in range((n + prompt_tokens - 2) // (prompt_tokens - 1)):
            ids = torch.randint(0, V, (prompt_tokens,), generator=gen)
            bounds = {b: (torch.randn(prompt_tokens, H, generator=gen) * (1 + b)).to(torch.bfloat16)
                      for b in range(L + 1)}
            prompts.append({"input_ids": ids, "next_token": torch.randint(0, V, (prompt_tokens,), generator=gen),
                            "boundaries": bounds})
        write_states(path, prompts, num_layers=L, hidden_size=H, boundaries=list(range(L + 1)),
                     meta={"source": "tests/real_size.py (random)"})
        del prompts
    done.write_text(json.dumps(params))
    return out


def run_replay_child(pair: dict, positions: int) -> dict:
    """The replay as the live check starts it (wiring_check: its command, its limits, its environment: nice 19,
    THREADS threads, an address-space and a CPU-time limit, no GPU), timed: wall, CPU (user + system of the
    child) and peak RSS."""
    from eagle3_ops.doctor.configs import draft_snapshot
    from eagle3_ops.sglang import wiring_check as wc

    check = wc.WiringCheck("real", Path(pair["draft"]), {}, [], pair["num_layers"], 0, 1)
    check.snapshot = draft_snapshot(Path(pair["draft"]))
    snap = Path(pair["draft"]).parent / "draft-snapshot.json"
    snap.write_text(json.dumps(check.snapshot, default=str))
    states = Path(pair["states"][positions])
    cmd = check.command(states, Path(pair["target"]), snap)
    limit = check.memory_limit(states)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run(wc.limited(cmd, limit, wc.TIME_LIMIT_S * wc.THREADS + 60), capture_output=True,
                          env=wc.child_env(), timeout=wc.TIME_LIMIT_S)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    report = wc.parse_report(proc.stdout)
    return {"rc": proc.returncode, "wall_s": round(wall, 1),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
            "peak_rss_gib": round(after.ru_maxrss / 2**20, 2), "address_space_limit_gib": round(limit / 2**30, 1),
            "report": report, "stderr": proc.stderr.decode(errors="replace")[-3000:]}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python tests/real_size.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=sorted(PAIRS))
    ap.add_argument("root", help="folder for the pair and its states (reused when built with the same parameters)")
    ap.add_argument("positions", nargs="?", type=int, default=256, choices=(256, 1024))
    a = ap.parse_args()
    kind, root, n = a.kind, a.root, a.positions
    t0 = time.monotonic()
    pair = build(kind, root)
    print(f"built {kind} in {time.monotonic() - t0:.0f} s", flush=True)
    res = run_replay_child(pair, n)
    rep = res.pop("report") or {}
    r = rep.get("replay") or {}
    print(json.dumps({**res, "compute_dtype": r.get("compute_dtype"), "verdict": r.get("verdict"),
                      "search": {k: v for k, v in (r.get("search") or {}).items() if k != "top"},
                      "findings": [f.get("code") for f in rep.get("findings", [])]}, indent=1))
