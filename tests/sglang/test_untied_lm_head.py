"""The doctor's rule for an untied draft's lm_head (the engine table's ``untied_lm_head``, read from SGLang's source)
held to what SGLang 0.5.23's own heads do, built on the CPU: with draft_vocab_size an integer the head builds its
own lm_head of that many rows and does not ask for the target's (``load_lm_head_from_target`` False), and its own
load_weights, fed a checkpoint without lm_head.weight, neither raises nor fills it; with draft_vocab_size null it
asks for the target's; LlamaForCausalLMEagle3 without the key raises AttributeError, the MLA head reads it as null.
A real published draft config without its lm_head tensor is an error (before: the doctor said OK)."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kimi_pair  # noqa: E402

from eagle3_ops.doctor import sglang_code  # noqa: E402
from eagle3_ops.doctor import tables  # noqa: E402


def _built(sglang_cpu, cfg: dict):
    from eagle3_ops.doctor import sglang_cpu as construction
    from eagle3_ops.doctor.configs import sglang_parse, draft_from_config
    from eagle3_ops.doctor.sglang_draft import head_class

    cls, _ = head_class(draft_from_config(cfg, None, use_sglang=True))
    config, _ = sglang_parse(copy.deepcopy(cfg), None)
    return cls, construction.construct(cls, config, torch.float32)


@pytest.mark.parametrize("mla", [False, True], ids=["LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"])
def test_the_tables_untied_lm_head_rule_is_what_the_head_does(sglang_cpu, mla):
    base = kimi_pair.mla_draft_config([2, 5, 7]) if mla else kimi_pair.llama_draft_config([2, 5, 7])
    base = dict(base, tie_word_embeddings=False)
    cls, model = _built(sglang_cpu, base)
    row = tables.load("sglang")["draft_heads"][cls.__name__]["untied_lm_head"]
    assert row == sglang_code.draft_head(cls)["untied_lm_head"]  # the table is the installed SGLang's
    assert row["shares_when"] == "draft_vocab_size is None"
    assert model.load_lm_head_from_target is False and model.lm_head.org_vocab_size == base["draft_vocab_size"]

    # its own load_weights, a checkpoint without lm_head.weight: no error, the head keeps what it was built with
    with torch.no_grad():
        model.lm_head.weight.fill_(7.0)  # a canary (what it was built with is uninitialised memory, NaN at times)
    named = [(n, torch.zeros_like(p)) for n, p in model.named_parameters()
             if "lm_head" not in n and "embed_tokens" not in n]
    model.load_weights(iter(named))
    assert bool((model.lm_head.weight == 7.0).all()), "lm_head was loaded from a checkpoint that has none"

    _, shared = _built(sglang_cpu, dict(base, draft_vocab_size=None))
    assert shared.load_lm_head_from_target is True  # the worker then calls set_embed_and_head

    absent = {k: v for k, v in base.items() if k != "draft_vocab_size"}
    if row["reads_draft_vocab_size"] == "attribute":
        with pytest.raises(AttributeError, match="draft_vocab_size"):
            _built(sglang_cpu, absent)
    else:
        assert _built(sglang_cpu, absent)[1].load_lm_head_from_target is True


def test_the_eagle3_worker_shares_the_targets_head_only_under_the_flag():
    """eagle_worker_v2's init_lm_head (the rule's ``worker``): set_embed_and_head under load_lm_head_from_target,
    set_embed otherwise; read from the installed source, named in the table."""
    from sglang.srt.speculative import eagle_worker_v2

    assert sglang_code.worker_lm_head() == "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.init_lm_head"
    assert hasattr(eagle_worker_v2.EagleDraftWorker, "init_lm_head")
    for row in tables.load("sglang")["draft_heads"].values():
        assert row["untied_lm_head"]["worker"] == sglang_code.worker_lm_head()
