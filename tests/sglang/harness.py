"""Test side of the CPU harness: the SGLang-running part lives in
``eagle3_ops.sglang.cpu_harness`` (shared with the demo); here are the Hugging Face references."""
from __future__ import annotations

from typing import List, Sequence

import torch

from eagle3_ops.sglang.cpu_harness import *  # noqa: F401,F403
from eagle3_ops.sglang.cpu_harness import FAMILIES, sglang_model


def hf_model(family: str, config, dtype: torch.dtype, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family].hf_class)(config).eval()
    with torch.no_grad():
        # visible norm weights (HF inits them to 1, which would hide a mixed-up norm)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype)


def checkpoint_weights(hf) -> List[tuple]:
    """HF weights in checkpoint naming: transformers 5 keeps MoE experts fused
    (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]); checkpoints and SGLang's
    loaders name them per expert (``experts.{e}.gate_proj.weight`` ...)."""
    out = []
    for name, t in hf.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out.append((f"{prefix}{e}.gate_proj.weight", t[e, :inter].contiguous()))
                out.append((f"{prefix}{e}.up_proj.weight", t[e, inter:].contiguous()))
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out.append((f"{prefix}{e}.down_proj.weight", t[e].contiguous()))
        else:
            out.append((name, t))
    return out


def hf_hidden_states(hf, sequences: List[List[int]]):
    """HF ``output_hidden_states`` per sequence (a tuple of [L, H] per index), and last-token logits."""
    outs = []
    with torch.no_grad():
        for seq in sequences:
            o = hf(torch.tensor(seq)[None], output_hidden_states=True)
            outs.append(([h[0] for h in o.hidden_states], o.logits[0]))
    return outs


def hf_aux(outs, capture_indices: Sequence[int], rows: List[slice]) -> torch.Tensor:
    """The packed [T, K*H] aux matrix HF gives for the capture indices (rows[i]: which positions of
    sequence i this forward covered)."""
    return torch.cat([torch.cat([hs[i][r] for i in capture_indices], dim=-1)
                      for (hs, _), r in zip(outs, rows)], dim=0)


def tolerances(dtype: torch.dtype) -> dict:
    return {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=6e-2, rtol=5e-2),
            torch.float16: dict(atol=1e-2, rtol=1e-2)}[dtype]


def sglang_from_hf(family: str, config, dtype: torch.dtype, hf):
    return sglang_model(family, config, dtype, weights=checkpoint_weights(hf))
