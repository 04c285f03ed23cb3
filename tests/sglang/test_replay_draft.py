"""The replay's two draft implementations agree: the plain-PyTorch llama_eagle3 twin (eagle3_ops.doctor.draft,
what runs where SGLang is not installed: vLLM users, offline) computes what SGLang 0.5.23's own
``LlamaForCausalLMEagle3`` computes when the replay runs it (eagle3_ops.doctor.sglang_draft), on the same
checkpoint, for every draft variant the twin accepts: per-slot fc_norm, norm_before_fc, grouped KV
heads or not, a second decoder layer, the biases the config's bias / attention_bias make SGLang build (and the
checkpoint's biases it does not load), a draft hidden size other than the target's (its own embedding, read at the
replayed tokens' rows only), a tied lm_head, no d2t. Random weights and inputs, fresh per variant; logits to
float32 rounding, and the same predicted target tokens wherever the top two logits are apart by more than that."""
import json

import pytest
import torch
from safetensors.torch import save_file

from doctor_fixtures import write_target
from eagle3_ops.doctor import checks, configs
from eagle3_ops.doctor.replay import build_runner

TARGET_H, VOCAB, K, B, N = 16, 128, 3, 3, 9


def _draft(path, *, hidden=16, draft_vocab=64, heads=4, kv_heads=2, layers=1, fc_norm=False, norm_before_fc=False,
           bias=False, attention_bias=False, fc_bias_tensor=None, tied=False, d2t=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) / s[-1] ** 0.5  # noqa: E731
    norm = lambda n: 1 + 0.2 * torch.randn(n, generator=g)  # noqa: E731
    hd = hidden // heads
    t = {"fc.weight": r(hidden, K * TARGET_H), "norm.weight": norm(hidden)}
    for i in range(layers):
        p, width = f"layers.{i}." if i else "midlayer.", 2 * hidden if i == 0 else hidden
        t.update({p + "self_attn.q_proj.weight": r(heads * hd, width),
                  p + "self_attn.k_proj.weight": r(kv_heads * hd, width),
                  p + "self_attn.v_proj.weight": r(kv_heads * hd, width),
                  p + "self_attn.o_proj.weight": r(hidden, heads * hd),
                  p + "input_layernorm.weight": norm(hidden), p + "hidden_norm.weight": norm(hidden),
                  p + "post_attention_layernorm.weight": norm(hidden),
                  p + "mlp.gate_proj.weight": r(2 * hidden, hidden),
                  p + "mlp.up_proj.weight": r(2 * hidden, hidden), p + "mlp.down_proj.weight": r(hidden, 2 * hidden)})
    if fc_norm:
        t.update({f"fc_norm.{k}.weight": norm(TARGET_H) for k in range(K)})
    if norm_before_fc:
        t["input_norm.weight"] = norm(K * TARGET_H)
    if bias if fc_bias_tensor is None else fc_bias_tensor:
        t["fc.bias"] = 0.1 * torch.randn(hidden, generator=g)
    for i in range(layers):
        p = f"layers.{i}." if i else "midlayer."
        if bias or attention_bias:
            t[p + "self_attn.o_proj.bias"] = 0.1 * torch.randn(hidden, generator=g)
        if attention_bias:  # trained with q/k/v biases too (SGLang's eagle3 layer has no qkv bias to load them into)
            t.update({p + f"self_attn.{n}_proj.bias": 0.1 * torch.randn(w, generator=g)
                      for n, w in (("q", heads * hd), ("k", kv_heads * hd), ("v", kv_heads * hd))})
    if hidden != TARGET_H or tied:
        t["embed_tokens.weight"] = torch.randn(VOCAB, hidden, generator=g)
    if not tied:
        t["lm_head.weight"] = r(draft_vocab, hidden)
    if d2t:
        hot = torch.sort(torch.randperm(VOCAB, generator=g)[:draft_vocab]).values
        t["d2t"] = hot - torch.arange(draft_vocab)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": 2 * hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "num_hidden_layers": layers, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
           "max_position_embeddings": 64, "vocab_size": VOCAB, "draft_vocab_size": VOCAB if tied else draft_vocab,
           "target_hidden_size": TARGET_H, "tie_word_embeddings": tied, "fc_norm": fc_norm, "bias": bias,
           "attention_bias": attention_bias,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 6], "use_aux_hidden_state": True,
                            "norm_before_fc": norm_before_fc}}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({n: v.contiguous() for n, v in t.items()}, str(path / "model.safetensors"))
    return path


VARIANTS = {
    "plain": {}, "fc_norm": dict(fc_norm=True), "norm_before_fc": dict(norm_before_fc=True),
    "mha": dict(kv_heads=4), "two_layers": dict(layers=2, fc_norm=True),
    "own_embedding_h24": dict(hidden=24, heads=4, kv_heads=2),
    "tied_h24": dict(hidden=24, tied=True, draft_vocab=VOCAB, d2t=False),
    "no_d2t": dict(draft_vocab=VOCAB, d2t=False),
    # config "bias": fc and every o_proj get one; "attention_bias": o_proj only (the checkpoint's q/k/v biases are
    # not loaded); an fc.bias the config does not ask for is not loaded either
    "bias": dict(bias=True), "attention_bias_two_layers": dict(attention_bias=True, layers=2),
    "unasked_fc_bias": dict(fc_bias_tensor=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_plain_twin_computes_what_sglangs_llama_eagle3_computes(sglang_cpu, variant, tmp_path):
    target = configs.parse_target(write_target(tmp_path / "target", num_layers=8, hidden=TARGET_H, vocab=VOCAB))
    d = _draft(tmp_path / "draft", seed=len(variant), **VARIANTS[variant])
    draft, weights = configs.parse_draft(d, use_sglang=True), configs.read_weight_headers(d)
    report = checks.run_checks(target, draft, weights, checks.Options(engine="sglang"))
    g = torch.Generator().manual_seed(1000 + len(variant))
    aux = 3 * torch.randn(B, N, K * TARGET_H, generator=g)
    ids = torch.randint(0, VOCAB, (B, N), generator=g)
    embeds = torch.randn(B, N, TARGET_H, generator=g)
    plain = build_runner(report, weights, token_ids=ids, implementation="plain")
    sglang = build_runner(report, weights, token_ids=ids, implementation="sglang")
    assert sglang.source.startswith("SGLang 0.5.23's own LlamaForCausalLMEagle3")
    assert plain.uses_target_embeddings == sglang.uses_target_embeddings == (variant not in ("own_embedding_h24",
                                                                                              "tied_h24"))
    want, got = plain.logits(aux, ids, embeds).double(), sglang.logits(aux, ids, embeds).double()
    assert got.shape == want.shape == (B, N, VOCAB if variant in ("no_d2t", "tied_h24") else 64)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-5, (variant, rel)
    sglang_cpu.same_where_clear(sglang.predict(aux, ids, embeds), plain.predict(aux, ids, embeds), want)


def test_a_parameter_sglangs_class_does_not_load_is_named(sglang_cpu, tmp_path):
    """SGLang's load_weights skips a tensor it does not know and leaves the parameter unset (uninitialised memory,
    here NaN): the runner names it instead of scoring garbage."""
    from eagle3_ops.doctor.configs import DoctorInputError

    target = configs.parse_target(write_target(tmp_path / "target", num_layers=8, hidden=TARGET_H, vocab=VOCAB))
    d = _draft(tmp_path / "draft")
    from safetensors.torch import load_file

    t = load_file(str(d / "model.safetensors"))
    t["midlayer.mlp.gate_proj_renamed.weight"] = t.pop("midlayer.mlp.gate_proj.weight")
    save_file(t, str(d / "model.safetensors"))
    draft, weights = configs.parse_draft(d, use_sglang=True), configs.read_weight_headers(d)
    report = checks.run_checks(target, draft, weights, checks.Options(engine="sglang"))
    with pytest.raises(DoctorInputError, match=r"left parameters unset .*model\.layers\.0\.mlp\.gate_up_proj\.weight"):
        build_runner(report, weights, token_ids=torch.arange(10)[None], implementation="sglang")


def test_sequences_longer_than_the_drafts_max_position_embeddings(sglang_cpu, tmp_path):
    """SGLang raises a draft's max_position_embeddings to the target's context length (model_config.py); the
    replay's runner does the same for the recorded prompts' length, so its class scores them as served."""
    target = configs.parse_target(write_target(tmp_path / "target", num_layers=8, hidden=TARGET_H, vocab=VOCAB))
    d = _draft(tmp_path / "draft", fc_norm=True)  # max_position_embeddings 64
    draft, weights = configs.parse_draft(d, use_sglang=True), configs.read_weight_headers(d)
    report = checks.run_checks(target, draft, weights, checks.Options(engine="sglang"))
    g = torch.Generator().manual_seed(7)
    n = 100
    aux, ids = torch.randn(1, n, K * TARGET_H, generator=g), torch.randint(0, VOCAB, (1, n), generator=g)
    embeds = torch.randn(1, n, TARGET_H, generator=g)
    plain = build_runner(report, weights, token_ids=ids, implementation="plain")
    sglang = build_runner(report, weights, token_ids=ids, implementation="sglang", max_positions=n + 1)
    want, got = plain.logits(aux, ids, embeds).double(), sglang.logits(aux, ids, embeds).double()
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_a_bias_the_config_asks_for_and_the_checkpoint_lacks_is_named(sglang_cpu, tmp_path):
    """config "bias": true without o_proj biases in the checkpoint: SGLang builds the parameters and serves them
    uninitialised; both implementations name them instead of scoring that."""
    from safetensors.torch import load_file

    from eagle3_ops.doctor.configs import DoctorInputError

    target = configs.parse_target(write_target(tmp_path / "target", num_layers=8, hidden=TARGET_H, vocab=VOCAB))
    d = _draft(tmp_path / "draft", bias=True)
    t = load_file(str(d / "model.safetensors"))
    del t["midlayer.self_attn.o_proj.bias"]
    save_file(t, str(d / "model.safetensors"))
    draft, weights = configs.parse_draft(d, use_sglang=True), configs.read_weight_headers(d)
    report = checks.run_checks(target, draft, weights, checks.Options(engine="sglang"))
    ids = torch.arange(10)[None]
    with pytest.raises(DoctorInputError, match=r"missing: layers\.0\.self_attn\.o_proj\.bias \(config\.json sets "
                                               r"bias: True, so SGLang builds these biases .*uninitialised"):
        build_runner(report, weights, token_ids=ids, implementation="plain")
    with pytest.raises(DoctorInputError, match=r"left parameters unset .*model\.layers\.0\.self_attn\.o_proj\.bias"):
        build_runner(report, weights, token_ids=ids, implementation="sglang")


@pytest.mark.parametrize("key", ["bias", "attention_bias"])
def test_the_plain_twin_refuses_biases_for_vllm(key, tmp_path):
    """vLLM 0.33.0's llama_eagle3 head builds other biases than SGLang's (qkv_proj with attention_bias, never fc):
    for --engine vllm the twin, which builds SGLang's, refuses a draft whose config asks for any."""
    from eagle3_ops.doctor.configs import DoctorInputError

    target = configs.parse_target(write_target(tmp_path / "target", num_layers=8, hidden=TARGET_H, vocab=VOCAB))
    d = _draft(tmp_path / "draft", **{key: True})
    draft, weights = configs.parse_draft(d), configs.read_weight_headers(d)
    report = checks.run_checks(target, draft, weights, checks.Options(engine="vllm"))
    with pytest.raises(DoctorInputError, match=rf"vLLM 0\.33\.0's head builds others .*{key}: True.*does not serve"):
        build_runner(report, weights, token_ids=torch.arange(10)[None], implementation="plain")


@pytest.mark.parametrize("impl", ["plain", "sglang"])
@pytest.mark.parametrize("variant", ["plain", "fc_norm", "norm_before_fc", "bias", "own_embedding_h24"])
def test_the_searchs_per_slot_projections_are_the_heads_own_fc(sglang_cpu, variant, impl, tmp_path):
    """The wiring search (doctor.search) sums per-slot projections of the fc (its fc_norm per slot; a whole-row
    input_norm as a scale after the sum; the bias once) and feeds the sum as the fc output: the head's own forward
    then skips its fc. That must compute what the head computes from the concatenated captures, for both runners,
    with any boundary in any slot (here the slots are filled from a pool of recorded boundaries, one repeated)."""
    from eagle3_ops.doctor.search import Chunk, Projections

    target = configs.parse_target(write_target(tmp_path / "target", num_layers=8, hidden=TARGET_H, vocab=VOCAB))
    d = _draft(tmp_path / "draft", seed=7 + len(variant), **VARIANTS[variant])
    draft, weights = configs.parse_draft(d, use_sglang=True), configs.read_weight_headers(d)
    report = checks.run_checks(target, draft, weights, checks.Options(engine="sglang"))
    g = torch.Generator().manual_seed(2000 + len(variant))
    bounds = {b: (1 + b) * torch.randn(B, N, TARGET_H, generator=g) for b in range(5)}
    ids = torch.randint(0, VOCAB, (B, N), generator=g)
    runner = build_runner(report, weights, token_ids=ids, implementation=impl)
    embeds = bounds[0] if runner.uses_target_embeddings else None
    chunk = Chunk(ids=ids, embeds=embeds, labels=ids, bounds=bounds)
    proj = Projections(runner.fc_parts(), [chunk], list(bounds))
    for wiring in [(1, 2, 3), (4, 0, 2), (3, 3, 1)]:
        want = runner.logits(torch.cat([bounds[b] for b in wiring], dim=-1), ids, embeds).double()
        got = runner.logits(proj.fc_output(0, wiring), ids, embeds).double()
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-5, (variant, impl, wiring, rel)


def test_sglangs_yarn_rope_head_builds_on_the_cpu(sglang_cpu):
    """The published Kimi-K2.5 MLA drafts set YaRN rope_scaling; SGLang's DeepseekScalingRotaryEmbedding then asks
    get_device() for an accelerator at construction and raises without one (why the replay failed at the real size
    while the tiny tests, without rope_scaling, passed). The replay's construction gives it the CPU."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    import kimi_pair

    from eagle3_ops.doctor import sglang_cpu as harness
    from eagle3_ops.doctor.configs import sglang_parse
    from eagle3_ops.doctor.sglang_draft import head_class

    cfg = dict(kimi_pair.mla_draft_config([2, 5, 7]), rope_scaling={
        "type": "yarn", "factor": 64.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 64})
    draft = configs.draft_from_config(cfg, None, use_sglang=True)
    cls, _ = head_class(draft)
    config, _ = sglang_parse(dict(cfg), None)
    if not torch.cuda.is_available():  # SGLang's own constructor, as is, on a machine without an accelerator
        with pytest.raises(RuntimeError, match="No accelerator"):
            cls(config)
    model = harness.construct(cls, config, torch.float32)
    assert type(model).__name__ == "Eagle3DeepseekV2ForCausalLM"
