"""Target side on more SGLang 0.5.23 EAGLE-3 target families: the multimodal wrappers whose language
model holds the capture, Gemma-3/4 (boundary L after the loop) and more MoE families (CPU,
torch_native, float32 unless a family says otherwise).

Each case builds SGLang's own class (the wrapper where that is what checkpoints name), runs an EXTEND
and a TARGET_VERIFY (chain of draft tokens, prefix in the KV cache) stock (capture configured with
SGLang's ``set_eagle3_layers_to_capture`` only), then the same model again with the plugin
(configured through SGLang's ``configure_aux_hidden_state_capture``, which the plugin hooks), and
checks (``check_family``): the plugin installed on the decoder loop SGLang configured
(``capture_state``, the owner's path), both forwards went through its persistent buffer (none
stock), the verify output is that buffer, the aux hidden states and logits are BITWISE stock's
(reference backend), and, where transformers has the model and SGLang's captures are its hidden
states, both are Hugging Face ``output_hidden_states`` at the capture indices.

What is covered, and what was tried and is not (with the exact exception), is ``COVERED`` and
``NOT_COVERED`` below; ``python tests/sglang/families.py --write`` turns them (with the older files'
families) into docs/sglang_families.md.
"""
import copy

import pytest
import torch

from kimi_pair import kimi_config

PROMPTS = [[5, 17, 3, 99, 42], [7, 1, 64, 23, 88, 120, 11]]
DRAFTS = [[9, 31, 2, 77], [54, 6, 101, 13]]  # one chain of draft tokens per request
DTYPE = torch.float32


# One row per test of this file (test_coverage_table_names_every_test keeps it complete):
# family, SGLang class, capture owner (its path in the model; the accumulator), reference, dtype.
COVERED = {
    "test_kimi_k25_wrapper": ("Kimi-K2.5", "KimiK25ForConditionalGeneration",
                              "language_model.model: DeepseekV2Model (AuxHiddenStatePacker), both id rules",
                              "HF DeepseekV3ForCausalLM", "fp32"),
    "test_llama4_wrapper": ("Llama-4 (dense layers, text only)", "Llama4ForConditionalGeneration",
                            "language_model.model: Llama4Model (AuxHiddenStateList)",
                            "stock only (SGLang drops RoPE off CUDA)", "bf16"),
    "test_qwen2_5_vl_wrapper": ("Qwen2.5-VL (text only, M-RoPE)", "Qwen2_5_VLForConditionalGeneration",
                                "model: Qwen2Model (AuxHiddenStateList)", "HF Qwen2_5_VLForConditionalGeneration",
                                "fp32"),
    "test_qwen2_5_vl_states_dump": ("Qwen2.5-VL: the states dump", "Qwen2_5_VLForConditionalGeneration",
                                    "model: Qwen2Model", "HF greedy next tokens; bitwise captures", "fp32"),
    "test_qwen3_vl_wrapper": ("Qwen3-VL (text only, M-RoPE)", "Qwen3VLForConditionalGeneration",
                              "model: Qwen3LLMModel (AuxHiddenStateList)", "HF Qwen3VLForConditionalGeneration",
                              "fp32"),
    "test_cosmos3_wrapper": ("Cosmos3 (Qwen3-VL understanding tower, text only)", "Cosmos3ForConditionalGeneration",
                             "model: Qwen3LLMModel (AuxHiddenStateList)", "stock only (seeded)", "fp32"),
    "test_qwen3_vl_moe_wrapper": ("Qwen3-VL-MoE (text only, M-RoPE)", "Qwen3VLMoeForConditionalGeneration",
                                  "model: Qwen3MoeLLMModel (AuxHiddenStateList)",
                                  "HF Qwen3VLMoeForConditionalGeneration", "fp32"),
    "test_gemma4_unified_wrapper": ("Gemma-4 unified (encoder-free, text only), boundary L",
                                    "Gemma4UnifiedForConditionalGeneration",
                                    "language_model: Gemma4TextModel (AuxHiddenStateList + append)",
                                    "HF Gemma4ForConditionalGeneration (text weights)", "fp32"),
    "test_teleflm_with_mup": ("TeleFLM (µP input and output scaling)", "TeleFLMForCausalLM",
                              "model: TeleFLMModel (AuxHiddenStateList)", "stock only (Llama weights)", "fp32"),
    "test_gemma3_with_boundary_L": ("Gemma-3, boundary L", "Gemma3ForCausalLM",
                                    "model: Gemma3TextModel (plain list)", "HF logits (captures: hidden-only)", "fp32"),
    "test_gemma4_with_boundary_L": ("Gemma-4, boundary L", "Gemma4ForCausalLM",
                                    "model: Gemma4TextModel (AuxHiddenStateList + append)", "HF Gemma4ForCausalLM",
                                    "fp32"),
    "test_gemma3_wrapper": ("Gemma-3 multimodal (text only), boundary L", "Gemma3ForConditionalGeneration",
                            "language_model.model: Gemma3TextModel (plain list)", "HF logits (captures: hidden-only)",
                            "fp32"),
    "test_gemma4_wrapper": ("Gemma-4 multimodal (text only), boundary L", "Gemma4ForConditionalGeneration",
                            "language_model: Gemma4TextModel (AuxHiddenStateList + append)",
                            "HF Gemma4ForConditionalGeneration", "fp32"),
    "test_minimax_m2": ("MiniMax-M2 (no QK norm)", "MiniMaxM2ForCausalLM", "model: MiniMaxM2Model",
                        "stock only (seeded)", "fp32"),
    "test_llama4_text": ("Llama-4 text-only (dense layers)", "Llama4ForCausalLM", "model: Llama4Model "
                         "(AuxHiddenStateList)", "stock only (SGLang drops RoPE off CUDA)", "bf16"),
    "test_exaone_moe": ("EXAONE MoE", "ExaoneMoEForCausalLM, ExaoneMoeForCausalLM", "model: ExaoneMoEModel",
                        "HF ExaoneMoeForCausalLM",
                        "fp32"),
    "test_bailing_moe_v2": ("Bailing MoE V2 (Ling-2.0 shape), Bailing V1, Sarvam-MoE",
                            "BailingMoeV2ForCausalLM, BailingMoeForCausalLM, BailingMoEForCausalLM, "
                            "SarvamMoEForCausalLM",
                            "model: BailingMoEModel", "stock only (seeded)", "fp32"),
    "test_deepseek_v3": ("DeepSeek-V3", "DeepseekV3ForCausalLM", "model: DeepseekV2Model (AuxHiddenStatePacker)",
                         "HF DeepseekV3ForCausalLM", "fp32"),
    "test_more_decoders": ("Qwen2-MoE, Phi-3, Apertus, Ministral-3, Mistral, InternLM3, IQuest-Coder, Mellum",
                           "Qwen2MoeForCausalLM, Phi3ForCausalLM, ApertusForCausalLM, Ministral3ForCausalLM, "
                           "MistralForCausalLM, InternLM3ForCausalLM, IQuestCoderForCausalLM, MellumForCausalLM",
                           "model: their decoder loops",
                           "HF (Apertus: captures only)", "fp32"),
    "test_mistral_large_3": ("Mistral-Large-3", "MistralLarge3ForCausalLM", "model: DeepseekV2Model "
                             "(AuxHiddenStatePacker)", "HF DeepseekV3ForCausalLM (renamed weights)", "fp32"),
    "test_minimax_m3_with_boundary_L": ("MiniMax-M3 and its VL wrapper (no sparse attention, text only), boundary L",
                                        "MiniMaxM3SparseForCausalLM, MiniMaxM3SparseForConditionalGeneration",
                                        "model: MiniMaxM3Model (final norm)", "stock only (seeded)", "fp32"),
    "test_qwen3_next_full_attention_layers": ("Qwen3-Next (full-attention layers only)", "Qwen3NextForCausalLM",
                                              "model: Qwen3NextModel (AuxHiddenStateList)", "stock only (seeded)",
                                              "fp32"),
    "test_qwen3_5_text_full_attention_layers": ("Qwen3.5 text, dense and MoE (full-attention layers only)",
                                                "Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM",
                                                "model: qwen3_5.Qwen3_5(Moe)ForCausalLM (layer flags)",
                                                "stock only (seeded)", "fp32"),
    "test_qwen3_5_vl_wrappers_full_attention_layers": (
        "Qwen3.5 / Qwen3.5-MoE multimodal, Intern-S2-Preview, Intern-S2-Mobius (full-attention layers, text only)",
        "Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration, "
        "InternS2PreviewForConditionalGeneration, InternS2MobiusForConditionalGeneration",
        "model: the Qwen3.5 decoder (layer flags)", "stock only (seeded)", "fp32"),
    "test_dsa_classes_without_the_indexer": ("DeepSeek-V3.2, GLM-MoE-DSA (no sparse indexer)",
                                             "DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM",
                                             "model: DeepseekV2Model (AuxHiddenStatePacker)", "stock only (seeded)",
                                             "fp32"),
    "test_glm5_next_wrapper_mla_layers_only": ("GLM-5-Next (MLA layers only, no sparse indexer, text only)",
                                               "Glm5NextForConditionalGeneration", "model: Glm5NextModel",
                                               "stock only (seeded)", "fp32"),
}

# Tried and not covered, with the exact reason (what SGLang 0.5.23 raised on this CPU).
NOT_COVERED = {
    "Llama-4 MoE layers (Llama4MoE)": (
        "SGLang's CPU MoE path moe_forward_native raises NotImplementedError for apply_router_weight_on_input=True "
        "(Llama4MoE's FusedMoE), the only CPU MoE runner without sgl_kernel's CPU build"),
    "MiniMax-M2 QK norm (use_qk_norm=True, as released)": (
        "MiniMaxM2QKRMSNorm._forward_naive runs the Triton kernel rms_sumsq_serial: AssertionError at "
        "`assert x1.is_cuda and x2.is_cuda` (minimax_m2.py:205); the CPU path needs AMX and sgl_kernel's CPU build"),
    "GLM-4-MoE-Lite / GLM-4.7-Flash (Glm4MoeLiteForCausalLM)": (
        "cannot be built: Glm4MoeLiteDecoderLayer passes get_rope_config's rope_parameters even for rope_type "
        "default, which DeepseekV2AttentionMLA rewrites to deepseek_yarn; DeepseekScalingRotaryEmbedding then calls "
        "get_device(): RuntimeError: No accelerator (CUDA, XPU, HPU, NPU, MUSA, MPS) or platform plugin is "
        "available. (rope_variant.py:373)"),
    "LongCat-Flash (LongcatFlashForCausalLM)": (
        "LongcatFlashModel.__init__ takes a CUDA stream (get_stream(\"alt\")): torch.AcceleratorError: CUDA error: "
        "CUDA driver version is insufficient for CUDA runtime version (longcat_flash.py:573); its zero experts are "
        "a Triton kernel too (zero_experts_compute_triton)"),
    "The DSA sparse-attention indexer (DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM, Glm5NextForConditionalGeneration "
    "with index_topk)": (
        "the MLA forward's indexer has no CPU path: NotImplementedError: Indexer has no native (pure-torch) path "
        "(dsa_indexer.py:1891); the classes are tested without it (test_dsa_classes_without_the_indexer)"),
    "Intern-S1-Pro (InternS1ProForConditionalGeneration)": (
        "cannot be built in SGLang 0.5.23 on any device: Qwen2MoeModel constructs every decoder layer with "
        "start_layer=, which InternS1ProTextDecoderLayer.__init__ does not take: TypeError: "
        "InternS1ProTextDecoderLayer.__init__() got an unexpected keyword argument 'start_layer' (qwen2_moe.py:1134)"),
    "Gated-delta-net (linear-attention) layers of Qwen3-Next and Qwen3.5 (Qwen3NextForCausalLM, Qwen3_5ForCausalLM "
    "and the classes on them) as released (full_attention_interval 4)": (
        "Qwen3GatedDeltaNet.__init__ builds its gated norm on torch.get_device_module().current_device(): "
        "RuntimeError: Found no NVIDIA driver on your system (qwen3_next.py:252); Qwen3.5's first linear-attention "
        "layer runs the Triton kernel fused_qkvzba_split_reshape_cat_contiguous_kernel: RuntimeError: 0 active "
        "drivers ([]). There should only be one. (triton_gdn_fused_proj.py:324); both need SGLang's hybrid "
        "linear-attention backend and Mamba state pool, which torch_native does not provide. Tested with every "
        "layer full attention"),
    "The attention output gate and the shared-expert gate of Qwen3-Next / Qwen3.5 (Qwen3_5ForCausalLM, as released)": (
        "off NPU SGLang runs them as the Triton kernels fused_sigmoid_mul and fused_gate_sigmoid_mul_add: "
        "RuntimeError: 0 active drivers ([]). There should only be one. (triton/runtime/driver.py:20); tested with "
        "attn_output_gate=False (Qwen3.5) and no shared expert"),
    "KDA linear-attention layers of GLM-5-Next (Glm5NextForConditionalGeneration)": (
        "RadixLinearAttention hands them to the attention backend's linear-attention forward, which torch_native "
        "does not have: TypeError: AttentionBackend.forward() missing 3 required positional arguments: 'q', 'k', "
        "and 'v' (radix_linear_attention.py:151); tested with kda_layers empty"),
    "EmbeddingGemma (EmbeddingGemmaModel)": (
        "stock SGLang itself fails with EAGLE-3 capture configured: its forward hands the decoder's output, a "
        "(hidden, aux) pair once capture is on, to its mean pooler: TypeError: cumsum(): argument 'input' "
        "(position 1) must be Tensor, not tuple (pooler.py:69). An embedding model, nothing to draft for"),
    "Qwen4-Exp (Qwen4ExpForConditionalGeneration)": (
        "stock SGLang itself fails with EAGLE-3 capture configured (bf16, every layer full attention): ValueError: "
        "too many values to unpack (expected 2) (qwen3_vl.py:1664); Qwen4ExpModel.forward returns "
        "(hidden_states, hc_hidden_states) on every forward that is not idle and its aux states only on an idle "
        "one (qwen4_exp.py:2170-2175)"),
    "MindSpore (MindSporeForCausalLM)": (
        "a MindSpore network, not torch modules (sglang/srt/models/mindspore.py imports mindspore; not installable "
        "here), which SGLang serves only on Ascend NPUs (arg_groups/validation_hook.py: \"MindSpore model impl is "
        "only supported on Ascend npu.\")"),
}


def test_coverage_table_names_every_test():
    import inspect
    import sys

    tests = {name for name, f in inspect.getmembers(sys.modules[__name__], inspect.isfunction)
             if name.startswith("test_") and name != "test_coverage_table_names_every_test"}
    assert tests == set(COVERED), (sorted(tests - set(COVERED)), sorted(set(COVERED) - tests))


def _randomise_hf(hf):
    """Visible norm weights and router correction biases (HF inits them to 1 and 0)."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.add_(0.1 * torch.randn_like(p))
        for name, b in list(hf.named_buffers()) + list(hf.named_parameters()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b))
    return hf


def _hf(cls_name, cfg, dtype=DTYPE, seed=0):
    import transformers

    torch.manual_seed(seed)
    # a copy: HF's constructor writes implementation choices into its config (Gemma-4: a
    # "grouped_mm" experts implementation that SGLang's PreTrainedModel-based class then refuses)
    return _randomise_hf(getattr(transformers, cls_name)(copy.deepcopy(cfg)).eval()).to(dtype)


def _build(cls, cfg, weights=None, dtype=DTYPE, seed=0):
    from eagle3_ops.demos.sglang_cpu_harness import build_model

    return build_model(cls, cfg, dtype, weights, seed)


def check_family(h, model, kv_cfg, layer_ids, capture_ids, inner_path, hf=None, refs=None, kv_factory=None,
                 dtype=DTYPE, hf_logits=None, hf_captures=None):
    """Stock vs plugin on ``model`` (see the module docstring). ``kv_cfg``: the text config the KV
    cache is sized from; ``inner_path``: where the capture owner (the decoder loop) sits; ``hf``: the
    HF reference for captures and logits; ``hf_logits`` / ``hf_captures``: one for the logits only
    (where SGLang's captures are not HF hidden states) / the captures only. Returns the plugin's
    capture state."""
    from eagle3_ops.sglang.capture_hooks import capture_state, find_capture_owner

    make_kv = kv_factory or (lambda: h.KVCache(kv_cfg, dtype))
    model.set_eagle3_layers_to_capture(layer_ids)  # stock
    owner, why = find_capture_owner(model)
    assert owner is not None, why
    assert owner.path == inner_path and list(owner.inner.layers_to_capture) == capture_ids
    stock = h.two_forwards(model, kv_cfg, dtype, PROMPTS, DRAFTS, kv=make_kv())

    h.configure_capture(model, layer_ids)  # what ModelRunner does; the plugin installs here
    state = capture_state(model)
    assert state is not None and state.layer_ids == capture_ids
    plugin = h.two_forwards(model, kv_cfg, dtype, PROMPTS, DRAFTS, kv=make_kv())

    (s_ext, s_ext_aux, s_ptr, s_ver), (p_ext, p_ext_aux, p_ptr, p_ver) = stock, plugin
    hidden = state.buffer.buffer.shape[-1] // len(capture_ids)
    if hf is not None:
        h.assert_captures_match_hf_and_stock(stock, plugin, hf, capture_ids, PROMPTS, DRAFTS, dtype, hidden,
                                             refs=refs)
    else:
        width = len(capture_ids) * hidden
        for name, s, p, rows in (("extend", s_ext_aux, p_ext_aux, sum(map(len, PROMPTS))),
                                 ("verify", s_ver.hidden_states, p_ver.hidden_states, sum(map(len, DRAFTS)))):
            assert s.shape == (rows, width), name
            h.assert_plugin_matches_stock(p, s, dtype, f"plugin {name} vs stock")
        h.assert_plugin_matches_stock(p_ext.next_token_logits, s_ext.next_token_logits, dtype, "extend logits")
        h.assert_plugin_matches_stock(p_ver.next_token_logits, s_ver.next_token_logits, dtype, "verify logits")
    if hf_captures is not None:
        outs = h.hf_hidden_states(hf_captures, [p + d for p, d in zip(PROMPTS, DRAFTS)])
        for name, p, rows in (("extend", p_ext_aux, [slice(0, len(q)) for q in PROMPTS]),
                              ("verify", p_ver.hidden_states,
                               [slice(len(q), len(q) + len(d)) for q, d in zip(PROMPTS, DRAFTS)])):
            torch.testing.assert_close(p.float(), h.hf_aux(outs, capture_ids, rows).float(), **h.tolerances(dtype),
                                       msg=f"plugin {name} vs HF")
    if hf_logits is not None:
        with torch.no_grad():
            ref = torch.stack([hf_logits(torch.tensor(p)[None]).logits[0, -1] for p in PROMPTS])
        torch.testing.assert_close(p_ext.next_token_logits.float(), ref.float(), **h.tolerances(dtype))

    assert state.stats["buffer_forwards"] == 2 and state.stats["stock_forwards"] == 0
    buf_ptr = state.buffer.buffer.data_ptr()
    assert s_ptr != buf_ptr and s_ver.hidden_states.data_ptr() != buf_ptr
    assert p_ptr == buf_ptr and p_ver.hidden_states.data_ptr() == buf_ptr
    return state


# ---- Kimi-K2.5 ------------------------------------------------------------------------------------
def _deepseek_v3_text_cfg():
    from transformers import DeepseekV3Config

    # Kimi-K2's text shape, tiny: MLA with a q LoRA, a dense first layer, sigmoid-scored experts with a
    # correction bias (noaux_tc), a shared expert, routed scaling
    cfg = DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_scaling=None, moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid")
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    return cfg


@pytest.mark.parametrize("layer_ids,capture_ids", [([1, 2], [2, 3]), ([0, 1, 3], [0, 1, 3])],
                         ids=["first-id-1-shifted", "ids-as-is-with-embedding"])
def test_kimi_k25_wrapper(sglang_cpu, fused_norm_qualified, layer_ids, capture_ids):
    h = sglang_cpu
    from sglang.srt.models.deepseek_v2 import DeepseekV2Model, DeepseekV3ForCausalLM
    from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration

    text = _deepseek_v3_text_cfg()
    hf = _hf("DeepseekV3ForCausalLM", text)
    weights = [("language_model." + n, t) for n, t in h.checkpoint_weights(hf)]
    model = _build(KimiK25ForConditionalGeneration, kimi_config(text), weights)
    assert type(model.language_model) is DeepseekV3ForCausalLM and type(model.language_model.model) is DeepseekV2Model
    state = check_family(h, model, text, layer_ids, capture_ids, "language_model.model", hf=hf)
    # the EXTEND learns (by identity) which norm's residual SGLang captures; the VERIFY fuses there
    assert state.fused_sites == [f"language_model.model.layers.{i}.input_layernorm" for i in capture_ids if i > 0]


def test_deepseek_v3(sglang_cpu, fused_norm_qualified):
    """DeepSeek-V3 itself (the language model of the Kimi test, as its own checkpoint), SGLang's id rule for
    it (first id 1: every id + 1); HF reference."""
    h = sglang_cpu
    from sglang.srt.models.deepseek_v2 import DeepseekV2Model, DeepseekV3ForCausalLM

    cfg = _deepseek_v3_text_cfg()
    hf = _hf("DeepseekV3ForCausalLM", cfg)
    model = _build(DeepseekV3ForCausalLM, cfg, h.checkpoint_weights(hf))
    assert type(model.model) is DeepseekV2Model
    state = check_family(h, model, cfg, [1, 2], [2, 3], "model", hf=hf)
    assert state.fused_sites == [f"model.layers.{i}.input_layernorm" for i in (2, 3)]


# ---- Llama-4 --------------------------------------------------------------------------------------
def _llama4_cfg():
    from transformers import Llama4Config, Llama4TextConfig

    # dense layers only (interleave step 8 > 4 layers: see the module docstring for why no MoE layer),
    # QK L2-norm, NoPE on layer 3, chunked attention with chunks longer than the tests' sequences
    # (torch_native does not chunk; HF does)
    text = Llama4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=8, max_position_embeddings=256, rms_norm_eps=1e-6, use_qk_norm=True,
        attention_chunk_size=128, no_rope_layers=[1, 1, 1, 0], tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=500000.0))
    text.architectures = ["Llama4ForCausalLM"]
    cfg = Llama4Config(text_config=text)
    cfg.architectures = ["Llama4ForConditionalGeneration"]
    return cfg


def test_llama4_wrapper(sglang_cpu, fused_norm_qualified):
    """Stock vs plugin only (no HF reference): off CUDA, SGLang 0.5.23's ``Llama4Attention.forward``
    drops RoPE (it keeps ``qk`` and discards what ``rotary_emb`` returns, counting on the in-place
    CUDA kernel; the native rotary returns new tensors), so its outputs are not HF's
    ``Llama4ForCausalLM`` (layer-0 output off by 0.016 where HF bf16 vs fp32 differ by 0.0004). The
    plugin is not on that path: stock runs the same attention."""
    h = sglang_cpu
    from sglang.srt.models.llama4 import Llama4Model
    from sglang.srt.models.mllama4 import Llama4ForConditionalGeneration

    cfg = _llama4_cfg()
    # bf16 only: off CUDA, SGLang's Llama4Attention runs the QK norm in bf16 whatever the model dtype
    # (``qk.bfloat16()``; an fp32 model fails in o_proj: "expected m1 and m2 to have the same dtype")
    dtype = torch.bfloat16
    hf = _hf("Llama4ForCausalLM", cfg.text_config, dtype)  # random weights in checkpoint naming
    weights = [("language_model." + n, t) for n, t in hf.state_dict().items()]
    model = _build(Llama4ForConditionalGeneration, cfg, weights, dtype)
    assert model.vision_model is None and type(model.language_model.model) is Llama4Model
    state = check_family(h, model, cfg.text_config, [0, 1, 2], [1, 2, 3], "language_model.model", dtype=dtype)
    assert state.fused_sites == [f"language_model.model.layers.{i}.input_layernorm" for i in (1, 2, 3)]


def test_llama4_text(sglang_cpu, fused_norm_qualified):
    """Llama-4's text-only class (``Llama4ForCausalLM``, a checkpoint of the language model alone); stock
    vs plugin only, bf16, for the reasons of test_llama4_wrapper."""
    h = sglang_cpu
    from sglang.srt.models.llama4 import Llama4ForCausalLM, Llama4Model

    text = _llama4_cfg().text_config
    dtype = torch.bfloat16
    hf = _hf("Llama4ForCausalLM", text, dtype)
    model = _build(Llama4ForCausalLM, text, list(hf.state_dict().items()), dtype)
    assert type(model.model) is Llama4Model
    state = check_family(h, model, text, [0, 1, 2], [1, 2, 3], "model", dtype=dtype)
    assert state.fused_sites == [f"model.layers.{i}.input_layernorm" for i in (1, 2, 3)]


# ---- Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE ---------------------------------------------------------
@pytest.fixture
def mrope_batches(monkeypatch):
    """Text-only M-RoPE batches: SGLang's VL wrappers read ``forward_batch.mrope_positions`` ([3, T]);
    for text every section's position is the token's (what SGLang's scheduler computes without
    images)."""
    import eagle3_ops.demos.sglang_cpu_harness as harness_module

    original = harness_module.extend_batch

    def extend_batch(*args, **kwargs):
        fb = original(*args, **kwargs)
        fb.mrope_positions = fb.positions.unsqueeze(0).expand(3, -1).clone()
        return fb

    monkeypatch.setattr(harness_module, "extend_batch", extend_batch)


_VL_TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]))
_VL_VISION = dict(depth=1, hidden_size=32, out_hidden_size=64, num_heads=2, intermediate_size=64)


def _vl_cfg(config_cls, arch, text, vision, flatten_text):
    cfg = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if flatten_text:
        # SGLang 0.5.23's Qwen2_5_VLForConditionalGeneration builds Qwen2Model(config) from the top-level
        # config; the released checkpoints' config.json keep the text fields there (transformers 5
        # moves them into text_config only)
        for k, v in cfg.text_config.to_dict().items():
            if k not in ("model_type", "architectures") and not hasattr(cfg, k):
                setattr(cfg, k, v)
    cfg.encoder_only, cfg.language_only = False, False
    cfg.architectures = [arch]
    return cfg


def _vl_checkpoint(hf):
    """transformers 5 names (``model.language_model.*``, ``model.visual.*``) in the released
    checkpoints' naming (``model.*``, ``visual.*``)."""
    out = []
    for n, t in hf.state_dict().items():
        if n.startswith("model.language_model."):
            n = "model." + n[len("model.language_model."):]
        elif n.startswith("model.visual."):
            n = "visual." + n[len("model.visual."):]
        out.append((n, t))
    return out


def _qwen2_5_vl(h):
    from transformers import Qwen2_5_VLConfig
    from sglang.srt.models.qwen2 import Qwen2Model
    from sglang.srt.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

    cfg = _vl_cfg(Qwen2_5_VLConfig, "Qwen2_5_VLForConditionalGeneration", _VL_TEXT,
                  dict(_VL_VISION, fullatt_block_indexes=[0]), flatten_text=True)
    hf = _hf("Qwen2_5_VLForConditionalGeneration", cfg)
    model = _build(Qwen2_5_VLForConditionalGeneration, cfg, _vl_checkpoint(hf))
    assert model.is_mrope_enabled and type(model.model) is Qwen2Model
    return cfg, hf, model


def test_qwen2_5_vl_wrapper(sglang_cpu, fused_norm_qualified, mrope_batches, caplog):
    """Qwen2.5-VL: the wrapper runs ``self.model`` (Qwen2Model) itself, and SGLang flags that inner
    module ``capture_aux_hidden_states`` too. HF reference: transformers' Qwen2.5-VL, text only."""
    h = sglang_cpu
    cfg, hf, model = _qwen2_5_vl(h)
    state = check_family(h, model, cfg.text_config, [0, 1, 2], [1, 2, 3], "model", hf=hf)
    assert state.fused_sites == [f"model.layers.{i}.input_layernorm" for i in (1, 2, 3)]
    # the rest of the install (states dump, live wiring check) ran too: no "could not patch" error
    assert not [r for r in caplog.records if "could not patch" in r.getMessage()]


def test_qwen2_5_vl_states_dump(sglang_cpu, mrope_batches, monkeypatch, tmp_path):
    """The states dump on a target whose flagged module is the decoder loop itself (Qwen2.5-VL):
    it records there and takes the wrapper's lm_head for the next tokens (it used to look for
    ``flagged.model`` and failed, which also skipped the live wiring check's start)."""
    h = sglang_cpu
    from eagle3_ops.doctor.states import read_states
    from eagle3_ops.sglang.dump_states import dump_state

    cfg, hf, model = _qwen2_5_vl(h)
    L = cfg.num_hidden_layers
    path = tmp_path / "states.safetensors"
    monkeypatch.setenv("EAGLE3_OPS_DUMP_STATES", str(path))
    monkeypatch.setenv("EAGLE3_OPS_DUMP_TOKENS", str(sum(map(len, PROMPTS))))
    h.configure_capture(model, [0, 1])
    rec = dump_state(model)
    assert rec is not None and rec.inner is model.model and rec.lm is model
    import eagle3_ops.demos.sglang_cpu_harness as harness_module  # its extend_batch: the M-RoPE one

    kv = h.KVCache(cfg.text_config, DTYPE)
    out = h.run(model, harness_module.extend_batch(kv, [h.Req(kv.new_req()) for _ in PROMPTS], PROMPTS), kv)
    rec.wait()  # written off the forward's thread
    assert rec.done and path.is_file()
    states = read_states(path, num_layers=L, hidden_size=cfg.text_config.hidden_size)
    H = cfg.text_config.hidden_size
    got = torch.cat([p["boundaries"][1] for p in states.prompts])
    assert torch.equal(got, out.hidden_states[:, :H].float())
    with torch.no_grad():  # next tokens: HF's greedy ones
        for p, prompt in zip(states.prompts, PROMPTS):
            assert torch.equal(p["next_token"], hf(torch.tensor(prompt)[None]).logits[0].argmax(-1))


def test_qwen3_vl_wrapper(sglang_cpu, fused_norm_qualified, mrope_batches):
    """Qwen3-VL: ``self.model`` is ``Qwen3LLMModel`` (Qwen3 with the deepstack inputs, none without
    images), flagged itself like Qwen2.5-VL. HF reference: transformers' Qwen3-VL, text only;
    weights in its (the released checkpoints') ``model.language_model.*`` naming."""
    h = sglang_cpu
    from transformers import Qwen3VLConfig
    from sglang.srt.models.qwen3_vl import Qwen3LLMModel, Qwen3VLForConditionalGeneration

    cfg = _vl_cfg(Qwen3VLConfig, "Qwen3VLForConditionalGeneration", dict(_VL_TEXT, head_dim=16),
                  dict(_VL_VISION, deepstack_visual_indexes=[0]), flatten_text=True)
    cfg.rope_scaling = cfg.text_config.rope_parameters  # SGLang reads config.rope_scaling["mrope_section"]
    hf = _hf("Qwen3VLForConditionalGeneration", cfg)
    model = _build(Qwen3VLForConditionalGeneration, cfg, list(hf.state_dict().items()))
    assert model.is_mrope_enabled and type(model.model) is Qwen3LLMModel
    state = check_family(h, model, cfg.text_config, [0, 1, 2], [1, 2, 3], "model", hf=hf)
    assert state.fused_sites == [f"model.layers.{i}.input_layernorm" for i in (1, 2, 3)]


def test_cosmos3_wrapper(sglang_cpu, fused_norm_qualified, mrope_batches):
    """Cosmos3 (``Cosmos3ForConditionalGeneration``: SGLang's Qwen3-VL subclass for Cosmos3's unified
    checkpoints, whose understanding tower it serves). Its weight mapper reads Cosmos3's flat naming,
    which no transformers model writes: seeded weights, stock vs plugin."""
    h = sglang_cpu
    from transformers import Qwen3VLConfig
    from sglang.srt.models.cosmos3 import Cosmos3ForConditionalGeneration
    from sglang.srt.models.qwen3_vl import Qwen3LLMModel

    cfg = _vl_cfg(Qwen3VLConfig, "Cosmos3ForConditionalGeneration", dict(_VL_TEXT, head_dim=16),
                  dict(_VL_VISION, deepstack_visual_indexes=[0]), flatten_text=True)
    cfg.rope_scaling = cfg.text_config.rope_parameters
    model = _build(Cosmos3ForConditionalGeneration, cfg, seed=7)
    assert type(model.model) is Qwen3LLMModel
    state = check_family(h, model, cfg.text_config, [0, 1, 2], [1, 2, 3], "model")
    assert state.fused_sites == [f"model.layers.{i}.input_layernorm" for i in (1, 2, 3)]


def test_qwen3_vl_moe_wrapper(sglang_cpu, fused_norm_qualified, mrope_batches):
    """Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``): ``self.model`` is ``Qwen3MoeLLMModel``,
    built from ``config.text_config``; experts in the released checkpoints' fused layout
    (``experts.gate_up_proj`` [E, H, 2I], ``experts.down_proj`` [E, I, H]: transformers 5 keeps them
    transposed). HF reference: transformers' Qwen3-VL-MoE, text only."""
    h = sglang_cpu
    from transformers import Qwen3VLMoeConfig
    from sglang.srt.models.qwen3_vl_moe import Qwen3MoeLLMModel, Qwen3VLMoeForConditionalGeneration

    text = dict(_VL_TEXT, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    cfg = _vl_cfg(Qwen3VLMoeConfig, "Qwen3VLMoeForConditionalGeneration", text,
                  dict(_VL_VISION, deepstack_visual_indexes=[0]), flatten_text=False)
    cfg.text_config.rope_scaling = cfg.text_config.rope_parameters  # read as config.rope_scaling
    hf = _hf("Qwen3VLMoeForConditionalGeneration", cfg)
    weights = [(n, t.transpose(-1, -2).contiguous() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
                else t) for n, t in hf.state_dict().items()]
    model = _build(Qwen3VLMoeForConditionalGeneration, cfg, weights)
    assert model.is_mrope_enabled and type(model.model) is Qwen3MoeLLMModel
    state = check_family(h, model, cfg.text_config, [0, 1, 2], [1, 2, 3], "model", hf=hf)
    assert state.fused_sites == [f"model.layers.{i}.input_layernorm" for i in (1, 2, 3)]


def test_teleflm_with_mup(sglang_cpu, fused_norm_qualified):
    """TeleFLM (``TeleFLMForCausalLM``: SGLang's Llama with µP: embeddings times ``input_mult`` inside
    ``TeleFLMModel.forward``, logits scaled by ``output_mult / mup_scale_factor``). No HF class: stock
    only, on Llama weights."""
    h = sglang_cpu
    from transformers import LlamaConfig
    from sglang.srt.models.teleflm import TeleFLMForCausalLM, TeleFLMModel

    cfg = LlamaConfig(**_DECODER, use_mup=True, input_mult=2.5, mup_scale_factor=4.0, output_mult=2.0)
    cfg.architectures = ["TeleFLMForCausalLM"]
    model = _build(TeleFLMForCausalLM, cfg, h.checkpoint_weights(_hf("LlamaForCausalLM", cfg)))
    assert type(model.model) is TeleFLMModel and model.model.use_mup
    assert model.logits_processor.logit_scale == 0.5
    state = check_family(h, model, cfg, [0, 1, 2], [1, 2, 3], "model")
    assert state.fused_sites == [f"model.layers.{i}.input_layernorm" for i in (1, 2, 3)]


# ---- Gemma-3 / Gemma-4 ----------------------------------------------------------------------------
def _gemma3_text_cfg():
    from transformers import Gemma3TextConfig

    # sliding/full attention (window 32, longer than the tests' sequences), QK norm, pre/post norms
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                           rms_norm_eps=1e-6, sliding_window=32, query_pre_attn_scalar=16,
                           layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                                        "full_attention"], tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    cfg.architectures = ["Gemma3ForCausalLM"]
    return cfg


def test_gemma3_with_boundary_L(sglang_cpu, fused_norm_qualified):
    """Gemma-3 (plain-list capture, boundary L appended after the loop). HF reference for the logits
    only: SGLang's captures here are not HF's hidden states (stock's own semantics, see below)."""
    h = sglang_cpu
    from sglang.srt.models.gemma3_causal import Gemma3ForCausalLM, Gemma3TextModel

    cfg = _gemma3_text_cfg()
    hf = _hf("Gemma3ForCausalLM", cfg)
    model = _build(Gemma3ForCausalLM, cfg, list(hf.state_dict().items()))
    assert type(model.model) is Gemma3TextModel
    L = cfg.num_hidden_layers
    state = check_family(h, model, cfg, [0, 1, L - 1], [1, 2, L], "model", hf_logits=hf)
    # SGLang's Gemma-3 captures the layers' ``hidden_states`` output, not the residual stream HF calls
    # hidden states (the doctor table's "hidden-only"): no norm returns the captured value, so every
    # capture is a copy; boundary L (after the loop) is the buffer's last slot
    assert state.fused_sites == [] and state.stats["copied_captures"] == 2 * 3


def _gemma4_text_cfg():
    from transformers import Gemma4TextConfig

    # sliding/full attention (window 32 > the tests' sequences; the full layer's head_dim as the
    # others', so one KV pool serves all), proportional partial RoPE on the full layer, no per-layer
    # embeddings, no KV sharing, dense MLP
    cfg = Gemma4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=16,
                           max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=32,
                           hidden_size_per_layer_input=0, vocab_size_per_layer_input=128,
                           layer_types=["sliding_attention"] * 3 + ["full_attention"], tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    cfg.architectures = ["Gemma4ForCausalLM"]
    return cfg


def test_gemma4_with_boundary_L(sglang_cpu, fused_norm_qualified):
    """Gemma-4 (AuxHiddenStateList: layer boundaries through ``capture``, boundary L by a plain
    ``append`` after the loop). HF reference: boundaries 1, 2 and L (the final norm's input). Before
    the plugin took appended values into their slots (capture_hooks._copy_appended), every forward
    with boundary L configured ran stock ("captured 2 of the 3 configured boundaries")."""
    h = sglang_cpu
    from sglang.srt.models.gemma4_causal import Gemma4ForCausalLM, Gemma4TextModel

    cfg = _gemma4_text_cfg()
    hf = _hf("Gemma4ForCausalLM", cfg)
    model = _build(Gemma4ForCausalLM, cfg, list(hf.state_dict().items()))
    assert type(model.model) is Gemma4TextModel
    L = cfg.num_hidden_layers
    state = check_family(h, model, cfg, [0, 1, L - 1], [1, 2, L], "model", hf=hf,
                         refs=h.hf_refs_with_last(hf, PROMPTS, DRAFTS))
    # Gemma's norms are GemmaRMSNorm ((1 + w) scaling), not the fused op's RMSNorm: every capture a copy
    assert state.fused_sites == [] and state.stats["copied_captures"] == 2 * 3


def test_gemma3_wrapper(sglang_cpu, fused_norm_qualified):
    """Gemma-3 multimodal (``Gemma3ForConditionalGeneration``, gemma3_mm.py: SigLIP + projector around
    ``Gemma3ForCausalLM``; capture by ``language_model.model``), text only, boundary L. Logits vs HF's
    Gemma-3 (captures: SGLang's own "hidden-only" values, see test_gemma3_with_boundary_L)."""
    h = sglang_cpu
    from transformers import Gemma3Config, SiglipVisionConfig
    from sglang.srt.models.gemma3_causal import Gemma3TextModel
    from sglang.srt.models.gemma3_mm import Gemma3ForConditionalGeneration

    text = _gemma3_text_cfg()
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14, vision_use_head=False)
    cfg = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    hf = _hf("Gemma3ForConditionalGeneration", cfg)
    weights = []
    for n, t in hf.state_dict().items():
        for old, new in (("model.language_model.", "language_model.model."),
                         ("model.vision_tower.", "vision_tower.vision_model."),
                         ("model.multi_modal_projector.", "multi_modal_projector."),
                         ("lm_head.", "language_model.lm_head.")):
            if n.startswith(old):
                n = new + n[len(old):]
                break
        weights.append((n, t))
    model = _build(Gemma3ForConditionalGeneration, cfg, weights)
    assert type(model.language_model.model) is Gemma3TextModel
    L = text.num_hidden_layers
    state = check_family(h, model, cfg.text_config, [0, 1, L - 1], [1, 2, L], "language_model.model", hf_logits=hf)
    assert state.fused_sites == [] and state.stats["copied_captures"] == 2 * 3


def _gemma4_mm_cfg(text, vision, architecture):
    """Gemma-4's multimodal config around ``text`` (``vision`` a Gemma4VisionConfig or None; no audio),
    eager attention in HF; media tokens 121..127: in the tiny vocabulary, none in the tests' prompts."""
    from transformers import Gemma4Config

    cfg = Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict() if vision is not None else None,
                       audio_config=None, boi_token_id=121, eoi_token_id=122, image_token_id=123,
                       video_token_id=124, boa_token_id=125, eoa_token_index=126, audio_token_id=127)
    cfg.architectures = [architecture]
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    return cfg


def test_gemma4_wrapper(sglang_cpu, fused_norm_qualified):
    """Gemma-4 multimodal (``Gemma4ForConditionalGeneration``, gemma4_mm.py: vision encoder +
    embedder around ``Gemma4TextModel``, which is the capture owner at ``language_model``; the flag
    sits on the wrapper), text only, boundary L. HF reference: transformers' Gemma-4, boundaries
    1, 2 and L (the final norm's input)."""
    h = sglang_cpu
    from transformers import Gemma4VisionConfig
    from sglang.srt.models.gemma4_causal import Gemma4TextModel
    from sglang.srt.models.gemma4_mm import Gemma4ForConditionalGeneration

    text = _gemma4_text_cfg()
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16, patch_size=14, pooling_kernel_size=2,
                                position_embedding_size=64)
    cfg = _gemma4_mm_cfg(text, vision, "Gemma4ForConditionalGeneration")
    hf = _hf("Gemma4ForConditionalGeneration", cfg)
    model = _build(Gemma4ForConditionalGeneration, cfg, list(hf.state_dict().items()))
    assert type(model.language_model) is Gemma4TextModel
    L = text.num_hidden_layers
    hf.model.norm = hf.model.language_model.norm  # where hf_refs_with_last hooks the final norm
    state = check_family(h, model, cfg.text_config, [0, 1, L - 1], [1, 2, L], "language_model", hf=hf,
                         refs=h.hf_refs_with_last(hf, PROMPTS, DRAFTS))
    assert state.fused_sites == [] and state.stats["copied_captures"] == 2 * 3


def test_gemma4_unified_wrapper(sglang_cpu, fused_norm_qualified):
    """Gemma-4 unified (``Gemma4UnifiedForConditionalGeneration``, gemma4_unified.py: encoder-free
    embedders instead of the SigLIP / conformer towers, around the same ``Gemma4TextModel``), text only,
    no media configs, boundary L. HF reference: transformers' Gemma-4 on the same text weights."""
    h = sglang_cpu
    from sglang.srt.models.gemma4_causal import Gemma4TextModel
    from sglang.srt.models.gemma4_unified import Gemma4UnifiedForConditionalGeneration

    text = _gemma4_text_cfg()
    cfg = _gemma4_mm_cfg(text, None, "Gemma4UnifiedForConditionalGeneration")
    hf = _hf("Gemma4ForConditionalGeneration", cfg)
    model = _build(Gemma4UnifiedForConditionalGeneration, cfg, list(hf.state_dict().items()))
    assert type(model.language_model) is Gemma4TextModel and model.vision_tower is None
    # SGLang's unified class masks the end-of-media tokens' logits (HF's generation_config.suppress_tokens,
    # which transformers applies at generation, not in the forward): the reference does the same
    assert model.suppress_token_ids == [122, 126]

    def suppress(_module, _args, out):
        out.logits[..., model.suppress_token_ids] = torch.finfo(out.logits.dtype).min

    hf.register_forward_hook(suppress)
    L = text.num_hidden_layers
    hf.model.norm = hf.model.language_model.norm  # where hf_refs_with_last hooks the final norm
    state = check_family(h, model, cfg.text_config, [0, 1, L - 1], [1, 2, L], "language_model", hf=hf,
                         refs=h.hf_refs_with_last(hf, PROMPTS, DRAFTS))
    assert state.fused_sites == [] and state.stats["copied_captures"] == 2 * 3


# ---- MiniMax-M2 -----------------------------------------------------------------------------------
def test_minimax_m2(sglang_cpu, fused_norm_qualified):
    """MiniMax-M2: partial rotary, sigmoid router with a correction bias, MoE every layer; WITHOUT the
    released model's QK norm (``use_qk_norm=False``): off CUDA, SGLang's MiniMaxM2QKRMSNorm runs the
    Triton kernel ``rms_sumsq_serial`` (``assert x1.is_cuda and x2.is_cuda``: AssertionError) unless
    the CPU has AMX and sgl_kernel's CPU build. Hence no HF reference either (transformers'
    MiniMaxM2Attention always applies its q/k norms): seeded weights, stock vs plugin bitwise."""
    h = sglang_cpu
    from transformers import MiniMaxM2Config
    from sglang.srt.models.minimax_m2 import MiniMaxM2ForCausalLM, MiniMaxM2Model

    cfg = MiniMaxM2Config(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                          rms_norm_eps=1e-6, num_experts_per_tok=2, num_local_experts=4, use_qk_norm=False,
                          rotary_dim=8, scoring_func="sigmoid", use_routing_bias=True, tie_word_embeddings=False,
                          bos_token_id=None, eos_token_id=None)
    cfg.architectures = ["MiniMaxM2ForCausalLM"]
    model = _build(MiniMaxM2ForCausalLM, cfg, seed=3)
    assert type(model.model) is MiniMaxM2Model
    state = check_family(h, model, cfg, [0, 1, 2], [1, 2, 3], "model")
    assert state.fused_sites == [f"model.layers.{i}.input_layernorm" for i in (1, 2, 3)]


# ---- EXAONE MoE -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cls_name", ["ExaoneMoEForCausalLM", "ExaoneMoeForCausalLM"])  # both names SGLang registers
def test_exaone_moe(sglang_cpu, fused_norm_qualified, cls_name):
    """EXAONE MoE (``ExaoneMoEForCausalLM``): sliding/full attention (window 32 > the tests'
    sequences) with QK norm, a dense first layer, sigmoid-routed experts with a correction bias and
    a shared expert. HF reference: transformers' ExaoneMoeForCausalLM. SGLang reads two fields the
    released config.json carries and transformers 5 does not define: ``is_moe_layer`` and a top-level
    ``rope_theta`` (else it assumes 1e6)."""
    import sglang.srt.models.exaone_moe as exaone

    h = sglang_cpu
    from transformers import ExaoneMoeConfig

    cfg = ExaoneMoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                          rms_norm_eps=1e-6, sliding_window=32, sliding_window_pattern=4, first_k_dense_replace=1,
                          moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                          tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.architectures = [cls_name]
    cfg.is_moe_layer = [t == "sparse" for t in cfg.mlp_layer_types]
    cfg.rope_theta = cfg.rope_parameters["rope_theta"]
    hf = _hf("ExaoneMoeForCausalLM", cfg)
    weights = [(n.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"), t)
               for n, t in h.checkpoint_weights(hf)]
    model = _build(getattr(exaone, cls_name), cfg, weights)
    assert type(model.model) is exaone.ExaoneMoEModel
    state = check_family(h, model, cfg, [0, 1, 2], [1, 2, 3], "model", hf=hf)
    assert state.fused_sites == [f"model.layers.{i}.input_layernorm" for i in (1, 2, 3)]


# ---- Bailing (Ling) MoE ---------------------------------------------------------------------------
def _bailing_v2_cfg():
    from transformers import PretrainedConfig

    # Ling-2.0's shape (BailingMoeV2), tiny: a dense first layer, sigmoid-routed experts with an expert
    # bias, one shared expert, routed scaling, QK norm, partial rotary. transformers has no Bailing
    # model: a plain config with the released config.json's fields
    cfg = PretrainedConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, hidden_act="silu", max_position_embeddings=256, rms_norm_eps=1e-6, num_experts=4,
        num_experts_per_tok=2, num_shared_experts=1, norm_topk_prob=True, first_k_dense_replace=1,
        score_function="sigmoid", moe_router_enable_expert_bias=True, routed_scaling_factor=2.5, n_group=1,
        topk_group=1, use_qk_norm=True, partial_rotary_factor=0.5, use_qkv_bias=False, use_bias=False,
        embedding_dropout=0.0, norm_head=False, num_nextn_predict_layers=0, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=600000.0), torch_dtype=DTYPE)
    cfg.architectures = ["BailingMoeV2ForCausalLM"]
    return cfg


@pytest.mark.parametrize("cls_name", ["BailingMoeV2ForCausalLM", "BailingMoeForCausalLM", "BailingMoEForCausalLM",
                                      "SarvamMoEForCausalLM"])
def test_bailing_moe_v2(sglang_cpu, fused_norm_qualified, cls_name):
    """Bailing MoE V2 (Ling-2.0; ``BailingMoEModel``), and the classes SGLang serves on the same model
    (Bailing V1's two names, Sarvam-MoE). No HF model: seeded weights, stock vs plugin."""
    import importlib

    h = sglang_cpu
    from sglang.srt.models.bailing_moe import BailingMoEModel

    module = "sglang.srt.models.sarvam_moe" if cls_name.startswith("Sarvam") else "sglang.srt.models.bailing_moe"
    cfg = _bailing_v2_cfg()
    cfg.architectures = [cls_name]
    model = _build(getattr(importlib.import_module(module), cls_name), cfg, seed=4)
    assert type(model.model) is BailingMoEModel
    state = check_family(h, model, cfg, [0, 1, 2], [1, 2, 3], "model")
    assert state.fused_sites == [f"model.layers.{i}.input_layernorm" for i in (1, 2, 3)]




# ---- more decoder families with a transformers model (HF reference) -------------------------------
_DECODER = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _qwen2_moe_cfg():
    from transformers import Qwen2MoeConfig

    # experts + a gated shared expert on every layer, q/k/v bias
    return Qwen2MoeConfig(**_DECODER, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                          num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False)


def _phi3_cfg():
    from transformers import Phi3Config

    return Phi3Config(**_DECODER)  # checkpoints keep q/k/v and gate/up fused (qkv_proj, gate_up_proj)


def _apertus_cfg():
    from transformers import ApertusConfig

    return ApertusConfig(**_DECODER, head_dim=16)  # xIELU MLP (no gate), QK norm


def _ministral3_cfg():
    from transformers import Ministral3Config

    return Ministral3Config(**_DECODER, head_dim=16)


def _mistral_cfg():
    from transformers import MistralConfig

    return MistralConfig(**_DECODER, head_dim=16, sliding_window=None)


def _llama_variant_cfg():  # InternLM3 / IQuest-Coder: SGLang serves them with its llama code (subclasses)
    from transformers import LlamaConfig

    return LlamaConfig(**_DECODER)


def _mellum_cfg():
    from transformers import MellumConfig

    return MellumConfig(**_DECODER, head_dim=16)


# name: (config builder, HF class, SGLang module, SGLang class, SGLang inner class). Apertus is checked
# against HF at the captures only: SGLang's XIELU keeps its eps (-1e-6) in bf16 whatever the model dtype,
# which moves fp32 logits by up to 1.5e-4 from HF's (the fp32 tolerance is 1e-4)
DECODERS = {
    "qwen2_moe": (_qwen2_moe_cfg, "Qwen2MoeForCausalLM", "sglang.srt.models.qwen2_moe", "Qwen2MoeForCausalLM",
                  "Qwen2MoeModel"),
    "phi3": (_phi3_cfg, "Phi3ForCausalLM", "sglang.srt.models.llama", "Phi3ForCausalLM", "LlamaModel"),
    "apertus": (_apertus_cfg, "ApertusForCausalLM", "sglang.srt.models.apertus", "ApertusForCausalLM",
                "ApertusModel"),
    "ministral3": (_ministral3_cfg, "Ministral3ForCausalLM", "sglang.srt.models.ministral3",
                   "Ministral3ForCausalLM", "Ministral3Model"),
    "mistral": (_mistral_cfg, "MistralForCausalLM", "sglang.srt.models.mistral", "MistralForCausalLM", "LlamaModel"),
    "internlm3": (_llama_variant_cfg, "LlamaForCausalLM", "sglang.srt.models.llama", "InternLM3ForCausalLM",
                  "LlamaModel"),
    "iquest_coder": (_llama_variant_cfg, "LlamaForCausalLM", "sglang.srt.models.llama", "IQuestCoderForCausalLM",
                     "LlamaModel"),
    "mellum": (_mellum_cfg, "MellumForCausalLM", "sglang.srt.models.mellum", "MellumForCausalLM", "MellumModel"),
}


@pytest.mark.parametrize("family", list(DECODERS))
def test_more_decoders(sglang_cpu, fused_norm_qualified, family):
    import importlib

    h = sglang_cpu
    make_cfg, hf_cls, module, cls_name, inner_name = DECODERS[family]
    cfg = make_cfg()
    cfg.architectures = [cls_name]
    hf = _hf(hf_cls, cfg)
    model = _build(getattr(importlib.import_module(module), cls_name), cfg, h.checkpoint_weights(hf))
    assert type(model.model).__name__ == inner_name
    if family == "apertus":
        state = check_family(h, model, cfg, [0, 1, 2], [1, 2, 3], "model", hf_captures=hf)
    else:
        state = check_family(h, model, cfg, [0, 1, 2], [1, 2, 3], "model", hf=hf)
    norm = "attention_layernorm" if family == "apertus" else "input_layernorm"  # Apertus names it so
    assert state.fused_sites == [f"model.layers.{i}.{norm}" for i in (1, 2, 3)]


# ---- Mistral-Large-3 ------------------------------------------------------------------------------
def _mistral_native_names(weights):
    """DeepSeek-V3 checkpoint names in Mistral's native naming, by inverting SGLang's own
    ``MistralLarge3ForCausalLM.remapping`` (each mistral regex -> deepseek template)."""
    import re

    from sglang.srt.models.mistral_large_3 import MistralLarge3ForCausalLM

    inverse = []
    for mistral, deepseek in MistralLarge3ForCausalLM.remapping.items():
        groups = re.findall(r"\((\\d\+|\\w\+)\)", mistral)
        parts = re.split(r"\\(\d)", deepseek)  # literal, group number, literal, ...
        pattern = "".join(re.escape(p) if i % 2 == 0 else f"({groups[int(p) - 1]})" for i, p in enumerate(parts))
        n = iter(range(1, len(groups) + 1))
        # re.sub calls the lambda right here (with the match as a positional arg): the late binding is harmless
        template = re.sub(r"\((\\d\+|\\w\+)\)", lambda _m: f"\\{next(n)}", mistral).replace(r"\.", ".")  # noqa: B023
        inverse.append((pattern, template))
    out = []
    for name, t in weights:
        new = next((re.sub(p, tpl, name) for p, tpl in inverse if re.fullmatch(p, name)), None)
        assert new is not None, f"no Mistral name for {name}"
        out.append((new, t))
    return out


def test_mistral_large_3(sglang_cpu, fused_norm_qualified):
    """Mistral-Large-3 (``MistralLarge3ForCausalLM``: SGLang's DeepSeek-V3 code under Mistral's native
    weight names; capture by ``DeepseekV2Model``, AuxHiddenStatePacker). HF reference: the same
    DeepSeek-V3 weights in transformers' DeepseekV3ForCausalLM, renamed to Mistral's names."""
    h = sglang_cpu
    from sglang.srt.models.deepseek_v2 import DeepseekV2Model
    from sglang.srt.models.mistral_large_3 import MistralLarge3ForCausalLM

    cfg = _deepseek_v3_text_cfg()
    cfg.architectures = ["MistralLarge3ForCausalLM"]
    hf = _hf("DeepseekV3ForCausalLM", cfg)
    model = _build(MistralLarge3ForCausalLM, cfg, _mistral_native_names(h.checkpoint_weights(hf)))
    assert type(model.model) is DeepseekV2Model
    state = check_family(h, model, cfg, [1, 2], [2, 3], "model", hf=hf)
    assert state.fused_sites == [f"model.layers.{i}.input_layernorm" for i in (2, 3)]


# ---- MiniMax-M3 -----------------------------------------------------------------------------------
def test_minimax_m3_with_boundary_L(sglang_cpu, fused_norm_qualified, monkeypatch):
    """MiniMax-M3 (``MiniMaxM3SparseForCausalLM``; capture by ``MiniMaxM3Model``, boundary L at its
    final norm): a dense first layer, sigmoid-routed experts with a bias and a shared expert. Two
    departures from the released model, both forced by the CPU: no sparse-attention layers
    (``sparse_attention_config`` unset; not tried), and SGLang's bf16 router GEMM off
    (``SGLANG_OPT_USE_BF16_ROUTER_GEMM=0``: its default path calls ``torch.mm(..., out_dtype=float32)``,
    ``NotImplementedError: Could not run 'aten::mm.dtype' with arguments from the 'CPU' backend``).
    No HF model: seeded weights, stock vs plugin bitwise."""
    h = sglang_cpu
    from transformers import PretrainedConfig

    monkeypatch.setenv("SGLANG_OPT_USE_BF16_ROUTER_GEMM", "0")
    from sglang.srt.models.minimax_m3 import MiniMaxM3Model, MiniMaxM3SparseForCausalLM

    cfg = PretrainedConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, dense_intermediate_size=128, n_shared_experts=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=2, num_local_experts=4,
        num_hidden_layers=4, num_mtp_modules=0, rms_norm_eps=1e-6, scoring_func="sigmoid", swiglu_alpha=None,
        swiglu_limit=None, hidden_act="silu", max_position_embeddings=256, use_routing_bias=True,
        moe_layer_freq=[0, 1, 1, 1], rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        tie_word_embeddings=False, torch_dtype=DTYPE)
    cfg.architectures = ["MiniMaxM3SparseForCausalLM"]
    model = _build(MiniMaxM3SparseForCausalLM, cfg, seed=2)
    assert type(model.model) is MiniMaxM3Model
    L = cfg.num_hidden_layers
    check_family(h, model, cfg, [0, 1, L - 1], [1, 2, L], "model")
    # the VL wrapper (minimax_m3_vl.py: a CLIP vision tower and projector around the same MiniMaxM3Model),
    # text only, seeded weights
    from sglang.srt.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_channels=3,
                  image_size=28, patch_size=14, hidden_act="gelu", layer_norm_eps=1e-5,
                  img_token_compression_config=dict(temporal_patch_size=2, spatial_merge_size=2),
                  position_embedding_type="rope", rope_mode="3d", rope_theta=10000.0, vision_segment_max_frames=None)
    vl_cfg = PretrainedConfig(text_config=cfg, vision_config=vision, projector_hidden_size=64, encoder_only=False,
                              torch_dtype=DTYPE)
    vl_cfg.architectures = ["MiniMaxM3SparseForConditionalGeneration"]
    vl = _build(MiniMaxM3SparseForConditionalGeneration, vl_cfg, seed=2)
    assert type(vl.model) is MiniMaxM3Model
    check_family(h, vl, cfg, [0, 1, L - 1], [1, 2, L], "model")


# ---- hybrid linear-attention families with every layer full attention ----------------------------
# Qwen3-Next, Qwen3.5 and the families built on Qwen3.5's decoder interleave gated-delta-net layers
# (``full_attention_interval`` 4 as released) whose CPU forward SGLang 0.5.23 does not have (Triton
# kernels, the hybrid linear-attention backend); with ``full_attention_interval=1`` every layer is SGLang's
# own attention layer of the family, so the capture path (the family's decoder loop, norms and
# ``AuxHiddenStateList``) runs on CPU. What this leaves out is in NOT_COVERED.
def _qwen3_next_cfg():
    from sglang.srt.configs.qwen3_next import Qwen3NextConfig

    # shared expert 0: SGLang's shared-expert gate is a Triton kernel (fused_gate_sigmoid_mul_add) off NPU
    cfg = Qwen3NextConfig(**dict(_DECODER, head_dim=16), full_attention_interval=1, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=0,
                          decoder_sparse_step=1)
    cfg.architectures = ["Qwen3NextForCausalLM"]
    return cfg


def test_qwen3_next_full_attention_layers(sglang_cpu, fused_norm_qualified):
    """Qwen3-Next (``Qwen3NextForCausalLM``): every layer full attention (see above), gated attention
    output, routed experts; seeded weights, stock vs plugin bitwise."""
    h = sglang_cpu
    from sglang.srt.models.qwen3_next import Qwen3HybridAttentionDecoderLayer, Qwen3NextForCausalLM, Qwen3NextModel

    cfg = _qwen3_next_cfg()
    model = _build(Qwen3NextForCausalLM, cfg, seed=3)
    assert type(model.model) is Qwen3NextModel
    assert {type(layer) for layer in model.model.layers} == {Qwen3HybridAttentionDecoderLayer}
    check_family(h, model, cfg, [0, 1, 2], [1, 2, 3], "model")


# Qwen3.5 text: M-RoPE sections on a partial rotary, no attention output gate (SGLang's is the Triton
# kernel fused_sigmoid_mul off NPU); MoE variants without the shared expert (its gate: see above)
_QWEN3_5_TEXT = dict(_DECODER, head_dim=16, full_attention_interval=1, attn_output_gate=False,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                          mrope_section=[2, 1, 1], mrope_interleaved=True))
_QWEN3_5_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=0)


@pytest.mark.parametrize("cls_name", ["Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"])
def test_qwen3_5_text_full_attention_layers(sglang_cpu, fused_norm_qualified, mrope_batches, cls_name):
    """Qwen3.5 text-only classes (``qwen3_5_text.py``: the causal LM around ``qwen3_5``'s decoder),
    dense and MoE; seeded weights, stock vs plugin bitwise."""
    import sglang.srt.models.qwen3_5_text as text_models
    from sglang.srt.configs.qwen3_5 import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    h = sglang_cpu
    moe = "Moe" in cls_name
    cfg = (Qwen3_5MoeTextConfig(**_QWEN3_5_TEXT, **_QWEN3_5_MOE) if moe else Qwen3_5TextConfig(**_QWEN3_5_TEXT))
    cfg.architectures = [cls_name]
    cls = getattr(text_models, cls_name)
    model = _build(cls, cfg, seed=3)
    from sglang.srt.models.qwen3_5 import Qwen3_5AttentionDecoderLayer

    assert type(model.model) is cls.body_cls
    assert {type(layer) for layer in model.model.layers} == {Qwen3_5AttentionDecoderLayer}
    check_family(h, model, cfg, [0, 1, 2], [1, 2, 3], "model")


_QWEN3_5_VL = {  # SGLang class -> (its module, its config class's module and name, MoE)
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "qwen3_5", "Qwen3_5Config", False),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5", "qwen3_5", "Qwen3_5MoeConfig", True),
    "InternS2PreviewForConditionalGeneration": ("interns2preview", "qwen3_5", "Qwen3_5MoeConfig", True),
    "InternS2MobiusForConditionalGeneration": ("interns2_mobius", "interns2_mobius", "InternS2MobiusConfig", True),
}


@pytest.mark.parametrize("cls_name", sorted(_QWEN3_5_VL))
def test_qwen3_5_vl_wrappers_full_attention_layers(sglang_cpu, fused_norm_qualified, mrope_batches, cls_name):
    """The Qwen3.5 multimodal wrappers (Qwen3-VL's wrapper around a Qwen3.5 decoder) and the Intern-S2
    classes SGLang builds on them, text only (a one-block vision tower is built, no image fed);
    seeded weights, stock vs plugin bitwise. Intern-S2-Mobius keeps its checkpoint's per-layer
    schedule (``layer_types``): all full attention here."""
    import importlib

    h = sglang_cpu
    module, config_module, config_name, moe = _QWEN3_5_VL[cls_name]
    config_cls = getattr(importlib.import_module(f"sglang.srt.configs.{config_module}"), config_name)
    text = dict(_QWEN3_5_TEXT, **(_QWEN3_5_MOE if moe else {}))
    if cls_name.startswith("InternS2Mobius"):
        text["layer_types"] = ["full_attention"] * text["num_hidden_layers"]
    cfg = config_cls(text_config=text, vision_config=_VL_VISION, tie_word_embeddings=False)
    cfg.architectures = [cls_name]
    model = _build(getattr(importlib.import_module(f"sglang.srt.models.{module}"), cls_name), cfg, seed=3)
    from sglang.srt.models.qwen3_5 import Qwen3_5ForCausalLM

    assert isinstance(model.model, Qwen3_5ForCausalLM)
    assert all(type(layer).__name__.endswith("AttentionDecoderLayer") for layer in model.model.layers)
    check_family(h, model, cfg.text_config, [0, 1, 2], [1, 2, 3], "model")


# ---- DSA classes without the sparse indexer ------------------------------------------------------
@pytest.mark.parametrize("cls_name", ["DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"])
def test_dsa_classes_without_the_indexer(sglang_cpu, fused_norm_qualified, cls_name):
    """DeepSeek-V3.2 and GLM-MoE-DSA (GLM-5): SGLang builds their sparse-attention indexer only when the
    config has ``index_topk`` (configs/model_config.is_deepseek_dsa), and the indexer has no CPU path
    (NOT_COVERED); without it each class runs its MLA layers, experts and capture (DeepseekV2Model,
    AuxHiddenStatePacker) on CPU. Seeded weights, stock vs plugin bitwise, SGLang's id rule for them."""
    h = sglang_cpu
    from sglang.srt.configs.model_config import is_deepseek_dsa
    from sglang.srt.models.deepseek_v2 import DeepseekV2Model

    cfg = _deepseek_v3_text_cfg()
    if cls_name == "GlmMoeDsaForCausalLM":
        from transformers import GlmMoeDsaConfig
        from sglang.srt.models.glm4_moe import GlmMoeDsaForCausalLM as cls

        d = cfg.to_dict()
        cfg = GlmMoeDsaConfig(**{k: d[k] for k in (
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
            "first_k_dense_replace", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "kv_lora_rank",
            "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "max_position_embeddings",
            "rms_norm_eps")}, head_dim=8, bos_token_id=None, eos_token_id=None,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0))
        for k in ("moe_layer_freq", "topk_method", "scoring_func"):  # what SGLang's DeepseekV2 reads besides
            setattr(cfg, k, d[k])
        cfg.__dict__["index_topk"] = None  # the strict config refuses None through setattr
    else:
        from sglang.srt.models.deepseek_v2 import DeepseekV32ForCausalLM as cls
    cfg.architectures = [cls_name]
    assert not is_deepseek_dsa(cfg)
    model = _build(cls, cfg, seed=3)
    assert type(model.model) is DeepseekV2Model
    check_family(h, model, cfg, [1, 2], [2, 3], "model")


def test_glm5_next_wrapper_mla_layers_only(sglang_cpu, fused_norm_qualified):
    """GLM-5-Next (``Glm5NextForConditionalGeneration``), text only (a one-block vision tower is built):
    no KDA linear-attention layers (``linear_attn_config`` with ``kda_layers`` empty; their forward needs
    SGLang's hybrid linear-attention backend) and no sparse indexer (no ``index_topk``, as above): MLA
    layers with experts, Glm5NextModel's own capture loop. Seeded weights, stock vs plugin bitwise."""
    h = sglang_cpu
    from sglang.srt.configs.glm5_next import Glm5NextConfig
    from sglang.srt.models.glm5_next import Glm5NextForConditionalGeneration, Glm5NextModel

    d = _deepseek_v3_text_cfg().to_dict()
    text = {k: d[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
        "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
        "max_position_embeddings", "rms_norm_eps")}
    vision = dict(swiglu_limit=7.0, depth=1, hidden_size=32, out_hidden_size=64, num_heads=2, intermediate_size=64,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    cfg = Glm5NextConfig(text_config=dict(text, rope_theta=10000.0, linear_attn_config={"kda_layers": []}),
                         vision_config=vision)
    cfg.architectures = ["Glm5NextForConditionalGeneration"]
    model = _build(Glm5NextForConditionalGeneration, cfg, seed=3)
    assert type(model.model) is Glm5NextModel and cfg.text_config.linear_layer_ids == []
    check_family(h, model, cfg.text_config, [1, 2], [2, 3], "model")
