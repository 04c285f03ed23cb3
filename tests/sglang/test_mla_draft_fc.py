"""The MLA EAGLE-3 head (SGLang's ``Eagle3DeepseekV2ForCausalLM``, kimi_k25_eagle3.py: the Kimi-K2.x
draft) on SGLang's own code: its fc block (``fc_norm`` per slot, ``ColumnParallelLinear(gather_output=
False)``, then its own ``_fc_gatherer``) as one eagle3::draft_fc call followed by the head's own
all-gather. The first draft step (EXTEND on the target's [T, K*H] aux states) and one DECODE step
are compared with the same draft run stock; the fc output with a float64 reference."""
import pytest
import torch

from test_draft_fc import _draft_steps

LAYER_IDS = [0, 1, 2]


def _fc_reference(aux, inner):
    x = aux.double()
    eps = inner.config.rms_norm_eps
    if inner.fc_norm is not None:
        K = len(inner.fc_norm)
        x = torch.cat([c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps) * n.weight.double()
                       for c, n in zip(x.chunk(K, dim=-1), inner.fc_norm)], dim=-1)
    y = x @ inner.fc.weight.double().t()
    return y + inner.fc.bias.double() if inner.fc.bias is not None else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fc_norm", [False, True], ids=["plain", "fc_norm"])
def test_mla_draft_fc_matches_stock(sglang_cpu, fc_norm, dtype):
    h = sglang_cpu
    tol = h.tolerances(dtype)
    cfg = h.FAMILIES["llama"].make_config()
    gen = torch.Generator().manual_seed(5)
    aux = (torch.randn(12, len(LAYER_IDS) * cfg.hidden_size, generator=gen) * 2).to(dtype)
    dcfg = h.mla_eagle3_draft_config(cfg, layer_ids=LAYER_IDS, fc_norm=fc_norm)
    draft = h.mla_eagle3_draft(dcfg, dtype)
    inner = draft.model
    s_ext, s_dec, s_fc = _draft_steps(h, draft, dcfg, dtype, aux)
    fc_weight_ptr = inner.fc.weight.data_ptr()

    calls = []
    gatherer = inner._fc_gatherer
    inner._fc_gatherer = lambda x: calls.append(tuple(x.shape)) or gatherer(x)
    h.configure_capture(draft, None, eagle=False)  # the draft runner's configure call
    from eagle3_ops.sglang.draft_fc_hooks import draft_fc_state

    state = draft_fc_state(draft)
    assert state is not None and state.column_parallel
    p_ext, p_dec, p_fc = _draft_steps(h, draft, dcfg, dtype, aux)
    assert state.stats == {"fused_calls": 1, "stock_calls": 1}  # EXTEND fused, DECODE stock
    assert calls == [(aux.shape[0], dcfg.hidden_size)]  # the head's own all-gather ran on the fused output
    assert inner.fc.weight.data_ptr() == fc_weight_ptr  # SGLang's column-parallel fc kept, no weight copy

    want_fc = _fc_reference(aux, inner)
    torch.testing.assert_close(p_fc.double(), want_fc, **tol)
    torch.testing.assert_close(s_fc.double(), want_fc, **tol)
    exact = dtype == torch.float32 or not fc_norm  # see test_draft_fc: stock rounds the normed input first
    for name, plugin, stock in [("fc output", p_fc, s_fc)] + [
            (f"{step} {what}", getattr(p, what), getattr(s, what))
            for step, p, s in (("extend", p_ext, s_ext), ("decode", p_dec, s_dec))
            for what in ("next_token_logits", "hidden_states")]:
        if exact:
            h.assert_plugin_matches_stock(plugin, stock, dtype, name)
        else:
            torch.testing.assert_close(plugin, stock, **tol, msg=name)


def test_quantized_mla_fc_stays_stock(sglang_cpu, caplog):
    """An fc whose quant method is not the unquantized one keeps SGLang's own fc, with one line."""
    h = sglang_cpu
    cfg = h.FAMILIES["llama"].make_config()
    draft = h.mla_eagle3_draft(h.mla_eagle3_draft_config(cfg, layer_ids=LAYER_IDS), torch.float32)

    class FakeFp8Method:
        pass

    draft.model.fc.quant_method = FakeFp8Method()
    with caplog.at_level("WARNING", logger="eagle3_ops.sglang"):
        h.configure_capture(draft, None, eagle=False)
    from eagle3_ops.sglang.draft_fc_hooks import draft_fc_state

    assert draft_fc_state(draft) is None
    assert any("runs stock" in r.getMessage() and "quantized (FakeFp8Method)" in r.getMessage()
               for r in caplog.records)
