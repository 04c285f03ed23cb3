"""A CPU harness that runs SGLang 0.5.23's own model code (no server, no GPU): the runtime pieces (process
groups, KV pools, batches, one forward) are :mod:`eagle3_ops.doctor.sglang_cpu`'s, re-exported here; this module
adds the plugin's install and configuration calls and the tiny model families of the demo and the tests.

* dynamo off: SGLang torch.compiles a few helpers (the vocab-parallel embedding at TP>1, MoE top-k)
  and each new shape costs seconds of compile on 2 cores. Worker processes call
  ``disable_dynamo()``; in a shared process scope it with ``torch._dynamo.config.patch(disable=True)``.

Model parameters are created uninitialised: load weights with ``load_weights`` (the tests load a
random Hugging Face model's, so HF ``output_hidden_states`` is the reference) or fill them from a
seed. Used by tests/sglang (the HF references live there) and by ``python -m eagle3_ops demo``.
Test scaffolding, not used by the plugin itself.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from ..doctor.sglang_cpu import cpu_environment

cpu_environment()  # before the demo or a test imports SGLang's distributed code

from ..doctor.sglang_cpu import (DEVICE, KVCache, Req, construct, decode_batch,  # noqa: E402, F401
                                 extend_batch, fill_req_to_token, free_port, init_distributed, run)


def disable_dynamo() -> None:
    """For worker processes only (it is process-wide): at TP>1 SGLang torch.compiles the
    vocab-parallel embedding, ~18 s of inductor on 2 cores for nothing a test looks at."""
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    import torch._dynamo

    torch._dynamo.config.disable = True


# ---- the plugin ----------------------------------------------------------------------------------
def plugin_install() -> bool:
    """Register and apply the eagle3_ops SGLang hooks in this process (what load_plugins does)."""
    from eagle3_ops.sglang import install

    return install()


def configure_capture(model, layer_ids: Optional[Sequence[int]], eagle: bool = True) -> None:
    """SGLang's own configuration call (the one ModelRunner makes before CUDA-graph capture).
    Looked up on the module at call time, so it is the hooked version once the plugin is applied."""
    from sglang.srt.model_executor.model_runner_components import attention_backend_setup as abs_

    abs_.configure_aux_hidden_state_capture(
        model=model, eagle_use_aux_hidden_state=eagle,
        eagle_aux_hidden_state_layer_ids=list(layer_ids) if layer_ids is not None else None,
        dflash_use_aux_hidden_state=False, dflash_target_layer_ids=None, is_dspark=False)


# ---- tiny models ----------------------------------------------------------------------------------
# Shared by the tiny llama/qwen configs (decoder sizes small enough for CPU tests).
_TINY_DECODER = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     rms_norm_eps=1e-6, tie_word_embeddings=False)


def _llama_cfg(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**{**_TINY_DECODER, **kw})


def _qwen2_cfg(**kw):
    from transformers import Qwen2Config

    return Qwen2Config(**{**_TINY_DECODER, **kw})


def _qwen3_cfg(**kw):
    from transformers import Qwen3Config

    return Qwen3Config(**{**_TINY_DECODER, "head_dim": 16, **kw})


def _qwen3_moe_cfg(**kw):
    from transformers import Qwen3MoeConfig

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[], num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    base.update(kw)
    return Qwen3MoeConfig(**base)


def _deepseek_v2_cfg(**kw):
    from transformers import DeepseekV2Config

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                moe_layer_freq=1, n_group=1, topk_group=1, topk_method="greedy", norm_topk_prob=False,
                routed_scaling_factor=1.0, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
                qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                tie_word_embeddings=False, rope_scaling=None)
    base.update(kw)
    cfg = DeepseekV2Config(**base)
    # fields SGLang's deepseek_v2 reads that the HF V2 config does not define (V2 defaults)
    for name, value in dict(scoring_func="softmax", n_group=1, topk_group=1, topk_method="greedy").items():
        if getattr(cfg, name, None) is None:
            setattr(cfg, name, value)
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    return cfg


def _gpt_oss_cfg(**kw):
    from transformers import GptOssConfig

    # alternating sliding/full attention, attention sinks, biased experts with the clamped SwiGLU,
    # YaRN (gpt-oss's factor 32, original context scaled down to the tiny one). Unquantized weights.
    # The window (32) is longer than the tests' sequences, so HF and SGLang's window conventions agree.
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=48, num_local_experts=4,
                num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, sliding_window=32, layer_types=["sliding_attention", "full_attention"] * 2,
                max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                     beta_slow=1.0, truncate=False, original_max_position_embeddings=8))
    base.update(kw)
    cfg = GptOssConfig(**base)
    cfg.architectures = ["GptOssForCausalLM"]
    return cfg


def _glm4_moe_cfg(**kw):
    from transformers import Glm4MoeConfig

    # GLM-4.5/4.6 shape: a dense first layer, then sigmoid-scored experts with a correction bias and a
    # shared expert; partial rotary (half the head), q/k/v bias
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                attention_bias=True, use_qk_norm=False, partial_rotary_factor=0.5,
                max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    base.update(kw)
    cfg = Glm4MoeConfig(**base)
    cfg.architectures = ["Glm4MoeForCausalLM"]
    return cfg


@dataclass(frozen=True)
class Family:
    """One tiny target model family of the demo and tests: its config factory, the Hugging Face class name and the
    SGLang module and class that implement it."""
    name: str
    make_config: object
    hf_class: str            # transformers class name
    sglang_module: str
    sglang_class: str


FAMILIES: Dict[str, Family] = {
    "llama": Family("llama", _llama_cfg, "LlamaForCausalLM", "sglang.srt.models.llama", "LlamaForCausalLM"),
    "qwen2": Family("qwen2", _qwen2_cfg, "Qwen2ForCausalLM", "sglang.srt.models.qwen2", "Qwen2ForCausalLM"),
    "qwen3": Family("qwen3", _qwen3_cfg, "Qwen3ForCausalLM", "sglang.srt.models.qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": Family("qwen3_moe", _qwen3_moe_cfg, "Qwen3MoeForCausalLM", "sglang.srt.models.qwen3_moe",
                        "Qwen3MoeForCausalLM"),
    "deepseek_v2": Family("deepseek_v2", _deepseek_v2_cfg, "DeepseekV2ForCausalLM",
                          "sglang.srt.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "gpt_oss": Family("gpt_oss", _gpt_oss_cfg, "GptOssForCausalLM", "sglang.srt.models.gpt_oss",
                      "GptOssForCausalLM"),
    "glm4_moe": Family("glm4_moe", _glm4_moe_cfg, "Glm4MoeForCausalLM", "sglang.srt.models.glm4_moe",
                       "Glm4MoeForCausalLM"),
}




def sglang_model(family: str, config, dtype: torch.dtype, weights=None, seed: int = 0):
    """The SGLang model class, built with ``dtype`` as default dtype; ``weights`` (name, tensor)
    pairs in checkpoint naming go through its ``load_weights``, else parameters are seeded."""
    import importlib

    cls = getattr(importlib.import_module(FAMILIES[family].sglang_module), FAMILIES[family].sglang_class)
    return build_model(cls, config, dtype, weights, seed)


def build_model(cls, config, dtype: torch.dtype, weights=None, seed: int = 0):
    """SGLang class ``cls`` built with ``dtype`` as default dtype, ``weights`` (checkpoint naming) loaded
    through its ``load_weights`` or parameters seeded, its ``post_load_weights`` run, in eval mode."""
    model = construct(cls, config, dtype)
    if weights is not None:
        model.load_weights(list(weights))
    else:
        fill_random(model, seed)
    post = getattr(model, "post_load_weights", None)
    if post is not None:
        try:
            post()
        except TypeError:
            pass
    return model.eval()


def eagle3_draft_config(target_config, *, layer_ids, fc_norm=False, norm_before_fc=False,
                        hidden_size: Optional[int] = None, draft_vocab_size: Optional[int] = None):
    """A one-layer ``LlamaForCausalLMEagle3`` draft config for ``target_config``: aux hidden states from ``layer_ids``,
    ``fc_norm`` / ``norm_before_fc`` as given, hidden size and draft vocab defaulting to the target's."""
    from transformers import LlamaConfig

    hidden = hidden_size or target_config.hidden_size
    cfg = LlamaConfig(vocab_size=target_config.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg.target_hidden_size = target_config.hidden_size
    cfg.draft_vocab_size = draft_vocab_size or target_config.vocab_size
    cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "norm_before_fc": norm_before_fc,
                        "use_aux_hidden_state": True}
    cfg.fc_norm = fc_norm
    cfg.architectures = ["LlamaForCausalLMEagle3"]
    return cfg


def fill_random(model, seed: int) -> None:
    """Deterministic weights for an SGLang model built with uninitialised parameters: norms near 1,
    matrices ~ N(0, 1/fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in name or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / max(p.shape[-1], 1) ** 0.5)


def eagle3_draft(config, dtype: torch.dtype, seed: int = 1):
    """SGLang's ``LlamaForCausalLMEagle3`` built from ``config`` in ``dtype``, parameters filled from ``seed``
    (:func:`fill_random`), in eval mode."""
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    model = construct(LlamaForCausalLMEagle3, config, dtype)
    fill_random(model, seed)
    return model.eval()


