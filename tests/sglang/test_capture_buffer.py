"""The persistent capture buffer: no clone / cat of aux states, one storage for every batch size,
the reuse contract (the draft consumes rows before the next target forward), and the stock
fallback for a forward larger than the buffer."""
import pytest
import torch

LAYER_IDS = [0, 1, 2]


@pytest.fixture
def llama(sglang_cpu):
    h = sglang_cpu
    dtype = torch.float32
    cfg = h.FAMILIES["llama"].make_config()
    hf = h.hf_model("llama", cfg, dtype)
    return h, cfg, dtype, hf


class _CopyCounter:
    """Records torch.cat outputs and Tensor.clone inputs (shapes) while active."""

    def __init__(self, monkeypatch):
        self.cats, self.clones = [], []
        real_cat, real_clone = torch.cat, torch.Tensor.clone

        def cat(tensors, *args, **kwargs):
            out = real_cat(tensors, *args, **kwargs)
            self.cats.append(tuple(out.shape))
            return out

        def clone(t, *args, **kwargs):
            self.clones.append(tuple(t.shape))
            return real_clone(t, *args, **kwargs)

        monkeypatch.setattr(torch, "cat", cat)
        monkeypatch.setattr(torch.Tensor, "clone", clone)


def _extend(h, model, cfg, dtype, prompts):
    kv = h.KVCache(cfg, dtype)
    reqs = [h.Req(kv.new_req()) for _ in prompts]
    return h.run(model, h.extend_batch(kv, reqs, prompts), kv)


def _aux_copies(counter, T, H, K):
    clones = [s for s in counter.clones if s == (T, H)]
    cats = [s for s in counter.cats if s == (T, K * H)]
    return clones, cats


def test_no_clone_or_cat_of_aux_states(llama, monkeypatch):
    h, cfg, dtype, hf = llama
    H, K = cfg.hidden_size, len(LAYER_IDS)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    T = sum(map(len, prompts))

    stock = h.sglang_from_hf("llama", cfg, dtype, hf)
    stock.set_eagle3_layers_to_capture(LAYER_IDS)
    plugin = h.sglang_from_hf("llama", cfg, dtype, hf)
    h.configure_capture(plugin, LAYER_IDS)

    with monkeypatch.context() as m:
        counter = _CopyCounter(m)
        s_out = _extend(h, stock, cfg, dtype, prompts)
    clones, cats = _aux_copies(counter, T, H, K)
    # the counter sees stock SGLang's copies: one clone per capture, one cat (so it can fail)
    assert len(clones) == K and len(cats) == 1

    with monkeypatch.context() as m:
        counter = _CopyCounter(m)
        p_out = _extend(h, plugin, cfg, dtype, prompts)
    clones, cats = _aux_copies(counter, T, H, K)
    assert clones == [] and cats == [], "the plugin path copied aux states"
    h.assert_plugin_matches_stock(p_out.hidden_states, s_out.hidden_states, dtype, "aux")


def test_one_storage_for_every_batch_size(llama):
    h, cfg, dtype, hf = llama
    model = h.sglang_from_hf("llama", cfg, dtype, hf)
    h.configure_capture(model, LAYER_IDS)
    from eagle3_ops.sglang.capture_hooks import capture_state

    buf = capture_state(model).buffer.buffer
    seen = []
    for prompts in ([[1, 2, 3, 4, 5, 6, 7, 8]], [[9, 10], [11, 12, 13]]):
        out = _extend(h, model, cfg, dtype, prompts)
        T = sum(map(len, prompts))
        aux = out.hidden_states
        assert aux.shape == (T, len(LAYER_IDS) * cfg.hidden_size)
        assert aux.data_ptr() == buf.data_ptr() and aux.is_contiguous()
        assert aux.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        seen.append(aux.untyped_storage().data_ptr())
        ref = h.hf_aux(h.hf_hidden_states(hf, prompts), [i + 1 for i in LAYER_IDS], [slice(None)] * len(prompts))
        torch.testing.assert_close(aux, ref, **h.tolerances(dtype))
    assert seen[0] == seen[1]


def _draft_extend(h, draft, dcfg, dtype, prompt, aux):
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    kv = h.KVCache(dcfg, dtype)
    req = h.Req(kv.new_req())
    spec = EagleDraftExtendInput(hidden_states=aux, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1)
    return h.run(draft, h.extend_batch(kv, [req], [prompt[1:] + [0]], capture="LAST", spec_info=spec), kv)


def test_draft_consumes_rows_before_next_target_forward(llama):
    """SGLang's EAGLE worker runs the draft's first (fc) step right after each target forward, on
    the same stream: that read, before the next target forward, is what makes reusing the rows
    safe. The draft's outputs are its own tensors, so the next target forward (which overwrites
    the rows) leaves them intact; the aux view itself is overwritten, which is why nothing may keep
    it past the next target forward without copying it."""
    h, cfg, dtype, hf = llama
    model = h.sglang_from_hf("llama", cfg, dtype, hf)
    h.configure_capture(model, LAYER_IDS)
    dcfg = h.eagle3_draft_config(cfg, layer_ids=LAYER_IDS, fc_norm=True)
    draft = h.eagle3_draft(dcfg, dtype)
    h.configure_capture(draft, None, eagle=False)
    prompt_a, prompt_b = [1, 2, 3, 4, 5], [60, 61, 62, 63, 64]

    aux_a = _extend(h, model, cfg, dtype, [prompt_a]).hidden_states
    private_a = aux_a.clone()
    draft_a = _draft_extend(h, draft, dcfg, dtype, prompt_a, aux_a)   # the worker's order
    logits_a = draft_a.next_token_logits.clone()
    _extend(h, model, cfg, dtype, [prompt_b])                         # next target forward
    assert not torch.equal(aux_a, private_a), "the next forward reuses the same rows"
    torch.testing.assert_close(draft_a.next_token_logits, logits_a)  # draft output untouched
    again = _draft_extend(h, draft, dcfg, dtype, prompt_a, private_a)
    torch.testing.assert_close(again.next_token_logits, logits_a)


def test_forward_larger_than_buffer_runs_stock(llama, monkeypatch):
    h, cfg, dtype, hf = llama
    from eagle3_ops.sglang.capture_hooks import capture_state
    from eagle3_ops.sglang.version import ENV_MAX_TOKENS

    monkeypatch.setenv(ENV_MAX_TOKENS, "6")
    model = h.sglang_from_hf("llama", cfg, dtype, hf)
    h.configure_capture(model, LAYER_IDS)
    state = capture_state(model)
    assert state.max_tokens == 6
    for prompts, path in (([[1, 2, 3, 4, 5, 6, 7, 8]], "stock"), ([[1, 2, 3, 4]], "buffer")):
        out = _extend(h, model, cfg, dtype, prompts)
        ref = h.hf_aux(h.hf_hidden_states(hf, prompts), [i + 1 for i in LAYER_IDS], [slice(None)])
        torch.testing.assert_close(out.hidden_states, ref, **h.tolerances(dtype))
        in_buffer = out.hidden_states.data_ptr() == state.buffer.buffer.data_ptr()
        assert in_buffer == (path == "buffer")
    assert state.stats["stock_forwards"] == 1 and state.stats["buffer_forwards"] == 1
