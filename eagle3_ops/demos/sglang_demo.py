"""The SGLang part of ``python -m eagle3_ops demo``: a tiny random-weight Llama target and EAGLE-3
draft built from SGLang 0.5.23's own classes, run on CPU (torch_native attention, gloo group of one)
stock and then with the eagle3_ops plugin, per path: do the outputs match.

The paths are the ones the plugin changes: the target's EXTEND (prefill) and TARGET_VERIFY forwards
(aux states captured into one persistent buffer; where the fused add+RMSNorm qualified bitwise,
written by it), the draft's first step (fc block as one eagle3::draft_fc) and a draft DECODE step
(fc not involved: must be unchanged).

It shows no times: on a CPU the plugin's ops run the reference backend (plain PyTorch computing in
float32) in place of stock SGLang's own modules, so stock-vs-plugin milliseconds of these tiny
forwards would compare two different computations, not the plugin; the demo says so under its table.
"""
from __future__ import annotations

from typing import List

import torch

from .table import print_table

LAYER_IDS = [0, 1, 2]
NO_TIMES = ("(a correctness check, no time column: on a CPU the plugin's ops run the reference backend, plain "
            "PyTorch computing in float32, in place of stock SGLang's own {dtype} modules, so stock-vs-plugin "
            "milliseconds here would compare two different computations, not the plugin. GPU speed is measured "
            "by benchmarks/device_check.sh (benchmarks/NOTES.md))")


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run_sglang_demo(dtype: torch.dtype = torch.bfloat16, hidden_size: int = 128,
                    prompt_len: int = 32, batch: int = 2, draft_tokens: int = 4) -> List[dict]:
    """Run the comparison, print a table, return its rows."""
    from . import sglang_cpu_harness as h
    from ..sglang.capture_hooks import capture_state
    from ..sglang.draft_fc_hooks import draft_fc_state

    import logging

    # the plugin's INFO lines, as SGLang's default logging shows them in a server (only where nobody
    # configured logging: a caller's own handlers decide otherwise)
    plugin_log, handler, previous = logging.getLogger("eagle3_ops"), None, None
    if not logging.getLogger().handlers and not plugin_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        previous = plugin_log.level
        plugin_log.addHandler(handler)
        plugin_log.setLevel(logging.INFO)
    try:
        return _run(h, capture_state, draft_fc_state, dtype, hidden_size, prompt_len, batch, draft_tokens)
    finally:
        if handler is not None:
            plugin_log.removeHandler(handler)
            plugin_log.setLevel(previous)


def _run(h, capture_state, draft_fc_state, dtype, hidden_size, prompt_len, batch, draft_tokens) -> List[dict]:
    h.init_distributed()
    active = h.plugin_install()
    if not active:
        print("SGLang demo: the eagle3_ops plugin is off (EAGLE3_OPS_SGLANG=0 or unsupported SGLang); "
              "nothing to compare")
        return []
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput, EagleDraftInput

    cfg = h.FAMILIES["llama"].make_config(hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                          num_attention_heads=8, num_key_value_heads=4, vocab_size=512)
    dcfg = h.eagle3_draft_config(cfg, layer_ids=LAYER_IDS, fc_norm=True)
    # Two copies of each model with the same weights: one left stock, one patched by the plugin
    # (through SGLang's own configure call).
    stock_target, plugin_target = (h.sglang_model("llama", cfg, dtype, seed=0) for _ in range(2))
    stock_draft, plugin_draft = (h.eagle3_draft(dcfg, dtype, seed=1) for _ in range(2))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    chains = [torch.randint(0, cfg.vocab_size, (draft_tokens,), generator=gen).tolist() for _ in range(batch)]

    def target_paths(model):
        kv = h.KVCache(cfg, dtype)
        reqs = [h.Req(kv.new_req()) for _ in prompts]
        ext_fb = h.extend_batch(kv, reqs, prompts)
        ext = h.run(model, ext_fb, kv)
        ext_out = (ext.hidden_states.clone(), ext.next_token_logits.clone())
        ver_fb = h.extend_batch(kv, reqs, chains, mode="TARGET_VERIFY")
        ver = h.run(model, ver_fb, kv)
        ver_out = (ver.hidden_states.clone(), ver.next_token_logits.clone())
        return ext_out, ver_out

    def draft_paths(model, aux):
        kv = h.KVCache(dcfg, dtype)
        reqs = [h.Req(kv.new_req()) for _ in prompts]
        spec = EagleDraftExtendInput(hidden_states=aux, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1)
        ext_fb = h.extend_batch(kv, reqs, [p[1:] + [c[0]] for p, c in zip(prompts, chains)], capture="LAST",
                                spec_info=spec)
        ext = h.run(model, ext_fb, kv)
        ext_out = (ext.hidden_states.clone(), ext.next_token_logits.clone())
        step = EagleDraftInput(hidden_states=ext.hidden_states, num_tokens_per_req=1,
                               num_tokens_for_logprob_per_req=1)
        dec_fb = h.decode_batch(kv, reqs, ext.next_token_logits.argmax(-1).tolist(), spec_info=step)
        dec = h.run(model, dec_fb, kv)
        dec_out = (dec.hidden_states.clone(), dec.next_token_logits.clone())
        return ext_out, dec_out

    with torch._dynamo.config.patch(disable=True):
        stock_target.set_eagle3_layers_to_capture(LAYER_IDS)  # stock SGLang
        h.configure_capture(plugin_target, LAYER_IDS)  # SGLang's configure call: the plugin patches here
        h.configure_capture(plugin_draft, None, eagle=False)
        s_out = target_paths(stock_target)
        p_out = target_paths(plugin_target)
        s_dout = draft_paths(stock_draft, s_out[0][0])
        p_dout = draft_paths(plugin_draft, p_out[0][0].clone())

    tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5
    state, dstate = capture_state(plugin_target), draft_fc_state(plugin_draft)
    # a site the plugin left stock (it refused a setting, or could not serve it: its log line above
    # says why) is compared stock against stock, and the table says so
    left_stock = "nothing: left stock (see the log above)"
    rows = []
    T_ext, T_ver = batch * prompt_len, batch * draft_tokens
    how_target = left_stock if state is None else (
        "aux -> buffer, fused add+RMSNorm" if state.stats.get("fused_captures") else
        "aux -> buffer (SGLang's norm: no fused one qualified bitwise here)")
    how_draft = "fc block -> eagle3::draft_fc" if dstate is not None else left_stock
    for path, stock, plugin, how in (
            (f"target EXTEND (T={T_ext})", s_out[0], p_out[0], how_target),
            (f"target TARGET_VERIFY (T={T_ver})", s_out[1], p_out[1], how_target),
            (f"draft EXTEND (T={T_ext}, fc)", s_dout[0], p_dout[0], how_draft),
            (f"draft DECODE (bs={batch})", s_dout[1], p_dout[1], "unchanged (no fc)")):
        err = max(_max_rel(plugin[0], stock[0]), _max_rel(plugin[1], stock[1]))
        rows.append({"path": path, "plugin does": how, "outputs match": "yes" if err <= tol else "NO",
                     "max rel diff": f"{err:.1e}"})
    print(f"SGLang demo (sglang's own LlamaForCausalLM + LlamaForCausalLMEagle3 on CPU, {str(dtype)[6:]}, "
          f"H={hidden_size}, K={len(LAYER_IDS)}): stock vs eagle3_ops plugin")
    print("capture buffer: " + (f"{tuple(state.buffer.buffer.shape)} {str(state.buffer.dtype)[6:]}, one storage "
                                f"for every forward; stats {state.stats}" if state is not None else
                                "none (the plugin left the target stock)")
          + ("; draft fc stats " + str(dstate.stats) if dstate is not None else
             "; draft fc: stock (the plugin left it)"))
    print_table(rows)
    print(NO_TIMES.format(dtype=str(dtype)[6:]))
    return rows


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(prog="python -m eagle3_ops.demos.sglang_demo", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    run_sglang_demo()
