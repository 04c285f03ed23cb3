"""A plain-PyTorch EAGLE-3 draft (first step only), used by ``doctor --replay`` and the tiny test pair.

It mirrors SGLang 0.5.23 ``srt/models/llama_eagle3.py`` (``LlamaModel.forward`` and its
``LlamaDecoderLayer``), with checkpoint names as SpecForge / SGLang write them:

- ``fc.weight`` [H_draft, K*H_target] (+ ``fc.bias`` when the config has ``bias: true``: SGLang builds
  ``fc`` with ``bias=config.bias``, and each layer's ``o_proj`` with ``attention_bias or bias`` while its
  ``qkv_proj`` never has one; a bias tensor the config does not ask for is not loaded, as in SGLang)
- ``input_norm.weight`` [K*H_target]      (``norm_before_fc``: one RMSNorm over the whole row)
- ``fc_norm.{k}.weight`` [H_target]       (``fc_norm`` / ``use_aux_norm``: one RMSNorm per slot;
  legacy names ``aux_norm_low|mid|high``)
- ``midlayer.*`` (legacy name of ``layers.0.*``), ``layers.{i}.*``: ``input_layernorm``,
  ``hidden_norm``, ``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``,
  ``mlp.{gate,up,down}_proj``. Layer 0's q/k/v take ``[embeds, hidden]`` (2*H_draft wide).
- ``norm.weight``, ``lm_head.weight`` [draft_vocab, H_draft]
- ``d2t`` [draft_vocab] int64 (target id = draft id + d2t[draft id]), ``t2d`` [vocab] bool
- optional ``embed_tokens.weight``; SGLang replaces it with the target's embedding
  (``set_embed``) unless ``target_hidden_size != hidden_size``.

Forward of the first draft step (what the draft does with the target's captures):
``h = fc([input_norm] [fc_norm] X)``; layer 0: ``residual = h`` (or ``hidden_norm(h)`` with
``norm_before_residual``, the vLLM/speculators variant), ``x = cat(input_layernorm(embeds),
hidden_norm(h))``, attention, ``post_attention_layernorm`` with residual add, MLP; later layers
fuse the residual add into ``hidden_norm``; then ``norm`` and ``lm_head``. RoPE is the default
(unscaled) Llama RoPE, which is what matters for the short sequences replay uses.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

LEGACY_NAMES = {
    "midlayer.": "layers.0.",
    "aux_norm_low.": "fc_norm.0.",
    "aux_norm_mid.": "fc_norm.1.",
    "aux_norm_high.": "fc_norm.2.",
}


def canonical_name(name: str) -> str:
    """Map a checkpoint tensor name to the names used here (drops ``model.``, maps legacy names)."""
    if name.startswith("model."):
        name = name[len("model."):]
    for old, new in LEGACY_NAMES.items():
        if name.startswith(old):
            name = new + name[len(old):]
    return name


@dataclasses.dataclass
class DraftSpec:
    """The shape of one EAGLE-3 draft as its config gives it: sizes, heads, vocabularies, activation, eps, RoPE theta
    and the fc-block and residual variants (head_dim and intermediate_size default from the hidden size)."""
    hidden_size: int
    target_hidden_size: int
    num_aux: int
    vocab_size: int
    draft_vocab_size: int
    num_layers: int = 1
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: Optional[int] = None
    intermediate_size: int = 0
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    norm_before_fc: bool = False
    fc_norm: bool = False
    fc_bias: bool = False
    o_proj_bias: bool = False
    norm_before_residual: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if not self.intermediate_size:
            self.intermediate_size = 4 * self.hidden_size


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with a learned ``weight`` [size], computed in fp32 as SGLang's native path
    does."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``weight * x * rsqrt(mean(x^2) + eps)`` over the last dim, in fp32, returned in x's dtype."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama (rotate-half) RoPE on x [..., heads, T, head_dim]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    return x * cos + rot * sin


class _Attention(nn.Module):
    def __init__(self, spec: DraftSpec, in_size: int):
        super().__init__()
        self.spec = spec
        hd = spec.head_dim
        self.q_proj = nn.Linear(in_size, spec.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(in_size, spec.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(in_size, spec.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(spec.num_heads * hd, spec.hidden_size, bias=spec.o_proj_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., T, in] -> [..., T, H]; causal attention along T."""
        s = self.spec
        lead, t = x.shape[:-2], x.shape[-2]
        q = self.q_proj(x).view(*lead, t, s.num_heads, s.head_dim).transpose(-2, -3)
        k = self.k_proj(x).view(*lead, t, s.num_kv_heads, s.head_dim).transpose(-2, -3)
        v = self.v_proj(x).view(*lead, t, s.num_kv_heads, s.head_dim).transpose(-2, -3)
        q, k = _rope(q, positions, s.rope_theta), _rope(k, positions, s.rope_theta)
        rep = s.num_heads // s.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=-3)
            v = v.repeat_interleave(rep, dim=-3)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(-2, -3).reshape(*lead, t, s.num_heads * s.head_dim))


# hidden_act values (Hugging Face names) the draft MLP computes; anything else is refused, never approximated.
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # HF NewGELUActivation is the tanh approximation
    "relu": F.relu,
}


class _MLP(nn.Module):
    def __init__(self, spec: DraftSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        if spec.hidden_act not in ACTIVATIONS:  # a silent stand-in would score a different model
            raise ValueError(f"hidden_act {spec.hidden_act!r} is not supported "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[spec.hidden_act]

    def forward(self, x):
        """The gated MLP: ``down_proj(act(gate_proj(x)) * up_proj(x))``."""
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, spec: DraftSpec, index: int):
        super().__init__()
        self.spec = spec
        self.is_input_layer = index == 0
        h = spec.hidden_size
        self.input_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)
        self.self_attn = _Attention(spec, 2 * h if self.is_input_layer else h)
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.mlp = _MLP(spec)

    def forward(self, positions, embeds, hidden, residual):
        """One decoder layer of the first draft step: hidden [T, H] (the fc output for layer 0, which also takes the
        normed embeds) and the residual in; returns (MLP output, residual) for the next layer."""
        if self.is_input_layer:
            if self.spec.norm_before_residual:
                hidden = self.hidden_norm(hidden)
                residual = hidden
            else:
                residual = hidden
                hidden = self.hidden_norm(hidden)
            x = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)
        else:
            residual = hidden + residual
            x = self.hidden_norm(residual)
        x = self.self_attn(x, positions)
        residual = x + residual
        x = self.mlp(self.post_attention_layernorm(residual))
        return x, residual


class Eagle3Draft(nn.Module):
    """First draft step of an EAGLE-3 draft: ``forward(aux [T, K*H_t], embeds [T, H]) -> logits``."""

    def __init__(self, spec: DraftSpec, embedding_rows: Optional[int] = None):
        """``embedding_rows``: how many rows of the embedding to hold (default: the vocabulary). A replay
        that needs only some tokens' rows (or none: the target's embeddings serve) holds only those and
        maps token ids to them with :meth:`use_embedding_rows`."""
        super().__init__()
        self.spec = spec
        s = spec
        self.embed_tokens = nn.Embedding(s.vocab_size if embedding_rows is None else max(int(embedding_rows), 1),
                                         s.hidden_size)
        self.token_rows: Optional[torch.Tensor] = None  # token id -> row of embed_tokens (None: the identity)
        in_f = s.num_aux * s.target_hidden_size
        self.fc = nn.Linear(in_f, s.hidden_size, bias=s.fc_bias)
        self.input_norm = RMSNorm(in_f, s.rms_norm_eps) if s.norm_before_fc else None
        self.fc_norm = (nn.ModuleList([RMSNorm(s.target_hidden_size, s.rms_norm_eps) for _ in range(s.num_aux)])
                        if s.fc_norm else None)
        self.layers = nn.ModuleList([_Layer(s, i) for i in range(s.num_layers)])
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(s.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(s.vocab_size, dtype=torch.bool))

    # ----------------------------------------------------------------- forward
    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """The draft-input path: [input_norm] -> [per-slot fc_norm] -> fc."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            chunks = aux.chunk(self.spec.num_aux, dim=-1)
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def forward(self, aux: torch.Tensor, embeds: torch.Tensor, positions: Optional[torch.Tensor] = None):
        """aux [..., T, K*H_t] (or [..., T, H]: the fc output itself), embeds [..., T, H] (embedding of the
        token *after* each aux position)."""
        if positions is None:
            positions = torch.arange(aux.shape[-2], device=aux.device)
        # SGLang's rule (llama_eagle3 LlamaModel.forward): an input as wide as the embeddings is the fc output
        hidden = self.project(aux) if aux.shape[-1] != embeds.shape[-1] else aux
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, embeds, hidden, residual)
        hidden = self.norm(hidden + residual)
        return self.lm_head(hidden)

    def use_embedding_rows(self, token_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """``embed_tokens`` holds ``rows`` (one per entry of ``token_ids``) of the checkpoint's embedding."""
        if tuple(rows.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(f"embedding rows of shape {tuple(rows.shape)} do not fit "
                             f"{tuple(self.embed_tokens.weight.shape)}")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(rows.to(self.embed_tokens.weight.dtype))
        index = torch.full((self.spec.vocab_size,), -1, dtype=torch.long)
        index[token_ids.long()] = torch.arange(token_ids.numel())
        self.token_rows = index

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The draft's own embedding of token ``ids`` (through the held rows when only some are held)."""
        if self.token_rows is None:
            return self.embed_tokens(ids)
        rows = self.token_rows.to(ids.device)[ids]
        if bool((rows < 0).any()):
            raise ValueError("a token whose embedding row was not loaded")
        return self.embed_tokens(rows)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids to target-vocabulary ids: ``id + d2t[id]``."""
        return draft_ids + self.d2t[draft_ids]

    # ------------------------------------------------------------ checkpoints
    def checkpoint_state_dict(self, include_embeddings: bool = True) -> Dict[str, torch.Tensor]:
        """State dict with SpecForge names (``midlayer.*`` for layer 0, ``layers.{i}.*`` after it)."""
        out = {}
        for k, v in self.state_dict().items():
            if k.startswith("embed_tokens.") and not include_embeddings:
                continue
            if k.startswith("layers.0."):
                k = "midlayer." + k[len("layers.0."):]
            out[k] = v.detach().contiguous()
        return out

    def load_checkpoint(self, tensors: Mapping[str, torch.Tensor]) -> List[str]:
        """Load tensors (any SpecForge/SGLang naming). Returns the model's names that were absent."""
        own = self.state_dict()
        loaded = set()
        with torch.no_grad():
            for name, value in tensors.items():
                cname = canonical_name(name)
                if cname not in own:
                    continue
                if tuple(own[cname].shape) != tuple(value.shape):
                    raise ValueError(f"draft tensor {name}: shape {tuple(value.shape)}, "
                                     f"expected {tuple(own[cname].shape)}")
                own[cname].copy_(value.to(own[cname].dtype))
                loaded.add(cname)
        missing = [k for k in own if k not in loaded]
        if self.spec.tie_word_embeddings and "lm_head.weight" in missing and "embed_tokens.weight" in loaded:
            self.lm_head.weight = self.embed_tokens.weight
            missing.remove("lm_head.weight")
        return missing


_LAYER_RE = re.compile(r"^layers\.(\d+)\.")


def count_draft_layers(names) -> int:
    """Number of draft decoder layers present in a set of (canonical) tensor names."""
    idx = [int(m.group(1)) for m in (_LAYER_RE.match(n) for n in names) if m]
    return max(idx) + 1 if idx else 0
