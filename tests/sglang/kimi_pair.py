"""The seed user's family, tiny: a Kimi-K2.5 target (SGLang 0.5.23's ``KimiK25ForConditionalGeneration`` over a
10-layer ``DeepseekV3ForCausalLM``: MLA attention with a q LoRA, a dense first layer, sigmoid-routed experts) and
EAGLE-3 drafts of BOTH SGLang draft classes, trained on the target's own hidden states:

- ``llama_default`` / ``mla_default``: ``LlamaForCausalLMEagle3`` / ``Eagle3DeepseekV2ForCausalLM`` (the MLA head of
  the published Kimi-K2.5 drafts) trained on SGLang's default boundaries (2, L//2, L-3) = [2, 5, 7], config ids
  [2, 5, 7] (SGLang's deepseek rule takes ids as boundaries unless the first id is 1);
- ``llama_hf`` / ``mla_hf``: trained with "output of layer k" numbering (Hugging Face ``output_hidden_states[k+1]``)
  on the outputs of layers 2, 5, 7 = boundaries [3, 6, 8], config ids [2, 5, 7] as such a trainer writes them.

The target's weights are a random Hugging Face ``DeepseekV3ForCausalLM`` (the reference SGLang's class is tested
against), with layer ``i``'s output projections (attention, dense MLP, shared and routed experts) scaled by
``2**(i+1)`` so that neighbouring boundaries are distinct (see eagle3_ops.doctor.tiny). Like the tiny llama pair's,
such a target predicts nearly one token per prompt (the scaled attention averages dominate; with them unscaled the
next token is a function no tiny draft learns), so a replay's positions are correlated within a prompt: the tests
record 32 prompts, not the live check's default 8, so that a wiring wins on evidence rather than on a few prompts.

The drafts are trained on Hugging Face's hidden states and served on SGLang's: the two agree to float32 rounding
(``test_the_drafts_are_trained_and_sglang_runs_them_as_trained``). The MLA draft is trained through a twin built
from Hugging Face's DeepSeek-V3 attention (:class:`MlaDraftTwin`, saved under SGLang's checkpoint names); that
SGLang's own class computes what the twin was trained to compute is checked there, not assumed.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Dict

import torch
from torch import nn

NUM_LAYERS = 10
HIDDEN = 64
VOCAB = 64
DRAFT_VOCAB = 32
DEFAULT_BOUNDARIES = [2, NUM_LAYERS // 2, NUM_LAYERS - 3]   # SGLang's default for DeepseekV2ForCausalLM
HF_BOUNDARIES = [3, 6, 8]                                  # "the outputs of layers 2, 5, 7"
CONFIG_IDS = [2, 5, 7]                                     # what both kinds of trainer write
LAYER_GAIN = 2.0
VERSION = 3


def text_config():
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_scaling=None, moe_layer_freq=1, topk_method="noaux_tc",
        scoring_func="sigmoid", bos_token_id=0, eos_token_id=1, pad_token_id=None)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    return cfg


def kimi_config(text=None):
    from sglang.srt.configs.kimi_k25 import KimiK25Config, KimiK25VisionConfig

    text = text or text_config()
    # the vision tower is built (MoonViT3d + patch-merger projector) but no image is fed
    vision = KimiK25VisionConfig(patch_size=14, init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=1,
                                 num_attention_heads=2, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                 text_hidden_size=text.hidden_size, vt_hidden_size=32)
    cfg = KimiK25Config(text_config=text, vision_config=vision)
    cfg.encoder_only, cfg.language_only = False, False
    cfg.architectures = ["KimiK25ForConditionalGeneration"]
    return cfg


def hf_target(seed: int = 0):
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(text_config()).eval()
    with torch.no_grad():
        for name, b in model.named_buffers():  # a visible router correction bias (HF inits it to 0)
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
        for i, layer in enumerate(model.model.layers):
            gain = LAYER_GAIN ** (i + 1)
            layer.self_attn.o_proj.weight.mul_(gain)
            for name, p in layer.mlp.named_parameters():
                if "down_proj" in name:
                    p.mul_(gain)
    return model


# ---- the drafts -------------------------------------------------------------------------------------------------
def llama_draft_config(ids) -> dict:
    from eagle3_ops.doctor.tiny import draft_config

    cfg = draft_config(ids)
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["draft_vocab_size"]) == (HIDDEN, VOCAB, DRAFT_VOCAB)
    return cfg


def mla_draft_config(ids) -> dict:
    """SGLang's MLA head, one layer, the target's hidden size and vocabulary, per-slot fc_norm (eagle3.1)."""
    return {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": HIDDEN,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": HIDDEN, "max_position_embeddings": 256, "rope_theta": 10000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "fc_norm": True, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True}}


class MlaDraftTwin(nn.Module):
    """SGLang 0.5.23's ``Eagle3DeepseekV2ForCausalLM`` first step (kimi_k25_eagle3.py) in trainable form:
    per-slot fc_norm, fc, then one layer: ``residual = h``; MLA attention (Hugging Face's ``DeepseekV3Attention``,
    its q_a / kv_a projections widened to take ``[input_layernorm(embeds), hidden_norm(h)]``), the residual add
    in ``post_attention_layernorm``, a dense MLP; ``norm(mlp + residual)``; lm_head."""

    def __init__(self, cfg: dict, num_aux: int = 3):
        super().__init__()
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention, DeepseekV3MLP,
                                                                          DeepseekV3RMSNorm,
                                                                          DeepseekV3RotaryEmbedding)

        hf = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "eagle_config",
                                                                           "draft_vocab_size", "target_hidden_size",
                                                                           "fc_norm", "torch_dtype", "model_type")})
        hf._attn_implementation = "sdpa"
        H, Ht, eps = hf.hidden_size, cfg["target_hidden_size"], hf.rms_norm_eps
        self.num_aux = num_aux
        self.fc_norm = nn.ModuleList([DeepseekV3RMSNorm(Ht, eps) for _ in range(num_aux)])
        self.fc = nn.Linear(num_aux * Ht, H, bias=False)
        self.input_layernorm = DeepseekV3RMSNorm(H, eps)
        self.hidden_norm = DeepseekV3RMSNorm(H, eps)
        self.post_attention_layernorm = DeepseekV3RMSNorm(H, eps)
        attn = DeepseekV3Attention(hf, 0)
        attn.q_a_proj = nn.Linear(2 * H, hf.q_lora_rank, bias=False)
        attn.kv_a_proj_with_mqa = nn.Linear(2 * H, hf.kv_lora_rank + hf.qk_rope_head_dim, bias=False)
        self.self_attn = attn
        self.rotary = DeepseekV3RotaryEmbedding(hf)
        self.mlp = DeepseekV3MLP(hf)
        self.norm = DeepseekV3RMSNorm(H, eps)
        self.lm_head = nn.Linear(H, cfg["draft_vocab_size"], bias=False)
        self.register_buffer("d2t", torch.zeros(cfg["draft_vocab_size"], dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg["vocab_size"], dtype=torch.bool))

    def forward(self, aux: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """aux [B, T, K*Ht], embeds [B, T, H] -> logits [B, T, draft vocab]."""
        B, T = aux.shape[:2]
        h = self.fc(torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(self.num_aux, dim=-1))], dim=-1))
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(h)], dim=-1)
        cos, sin = self.rotary(x, torch.arange(T, device=x.device)[None].expand(B, T))
        attn, _ = self.self_attn(x, (cos, sin), attention_mask=None)
        residual = attn + h
        out = self.mlp(self.post_attention_layernorm(residual))
        return self.lm_head(self.norm(out + residual))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def checkpoint_state_dict(self) -> Dict[str, torch.Tensor]:
        """SGLang's names (kimi_k25_eagle3 load_weights: ``layers.0.*`` -> its midlayer; q_a / kv_a fused there)."""
        out = {}
        for k, v in self.state_dict().items():
            if k.startswith("rotary."):
                continue
            if k.split(".")[0] in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn", "mlp"):
                k = "layers.0." + k
            out[k] = v.detach().contiguous()
        return out


# ---- building ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class KimiPair:
    root: Path
    target_dir: Path
    drafts: Dict[str, Path]          # llama_default, mla_default, llama_hf, mla_hf
    trained: Dict[str, list]         # boundaries each draft was trained on
    prompts_file: Path
    accuracy: Dict[str, float]       # held-out top-1 of each draft on its trained wiring (Hugging Face states)


def _write(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n")


def build(root, *, steps: int = 300, num_train: int = 512, seq_len: int = 32, num_prompts: int = 48) -> KimiPair:
    """Build (or reuse, when ``root/DONE`` matches) the target and the four drafts."""
    from safetensors.torch import save_file

    from harness import checkpoint_weights

    from eagle3_ops.doctor.draft import Eagle3Draft
    from eagle3_ops.doctor.tiny import _spec_from, target_states, train_draft

    root = Path(root)
    params = {"steps": steps, "num_train": num_train, "seq_len": seq_len, "num_prompts": num_prompts,
              "version": VERSION}
    names = {"llama_default": DEFAULT_BOUNDARIES, "mla_default": DEFAULT_BOUNDARIES, "llama_hf": HF_BOUNDARIES,
             "mla_hf": HF_BOUNDARIES}
    done = root / "DONE"
    pair = KimiPair(root, root / "target", {n: root / n for n in names}, dict(names), root / "prompts.json", {})
    if done.exists() and json.loads(done.read_text()).get("params") == params:
        pair.accuracy = json.loads(done.read_text())["accuracy"]
        return pair
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is fastest on a busy 2-core machine
    try:
        root.mkdir(parents=True, exist_ok=True)
        hf = hf_target()
        gen = torch.Generator().manual_seed(100)
        train_ids = torch.randint(2, VOCAB, (num_train, seq_len), generator=gen)
        hidden, nxt = target_states(hf, train_ids)
        prompts = torch.randint(2, VOCAB, (num_prompts, seq_len), generator=gen)
        h_eval, n_eval = target_states(hf, prompts)
        pair.target_dir.mkdir(parents=True, exist_ok=True)
        _write(pair.target_dir / "config.json", kimi_config().to_dict())
        save_file({"language_model." + n: t.contiguous() for n, t in checkpoint_weights(hf)},
                  str(pair.target_dir / "model.safetensors"), metadata={"format": "pt"})
        for n, (name, bounds) in enumerate(names.items()):
            mla = name.startswith("mla")
            cfg = mla_draft_config(CONFIG_IDS) if mla else llama_draft_config(CONFIG_IDS)
            torch.manual_seed(10 + n)
            model = MlaDraftTwin(cfg) if mla else Eagle3Draft(_spec_from(cfg))
            draft = train_draft(hidden, nxt, bounds, steps=steps, draft=model, seed=10 + n)
            with torch.no_grad():
                x = torch.cat([h_eval[b] for b in bounds], dim=-1)[:, :-1]
                pred = draft.draft_to_target(draft(x, h_eval[0][:, 1:]).argmax(-1))
                pair.accuracy[name] = (pred == n_eval[:, 1:]).float().mean().item()
            d = pair.drafts[name]
            d.mkdir(parents=True, exist_ok=True)
            _write(d / "config.json", cfg)
            sd = draft.checkpoint_state_dict() if mla else draft.checkpoint_state_dict(include_embeddings=False)
            save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        _write(pair.prompts_file, prompts.tolist())
        _write(done, {"params": params, "accuracy": pair.accuracy})
    finally:
        torch.set_num_threads(threads)
    return pair

