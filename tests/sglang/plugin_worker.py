"""A fresh SGLang process loading its plugins the way every SGLang process does
(``sglang.srt.plugins.load_plugins``), then building a tiny Llama target + EAGLE-3 draft and running
them through SGLang's own configure call and forward. Prints one JSON line.

``python plugin_worker.py MODE`` with MODE in: default | off | excluded | old-version | bad-max-tokens
(the caller sets EAGLE3_OPS_SGLANG / SGLANG_PLUGINS / EAGLE3_OPS_SGLANG_MAX_TOKENS; ``old-version``
pretends SGLang 0.5.22)."""
import hashlib
import inspect
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TARGETS = (
    ("sglang.srt.model_executor.model_runner_components.attention_backend_setup",
     "configure_aux_hidden_state_capture"),
    ("sglang.srt.layers.aux_hidden_states", "AuxHiddenStateList"),
    ("sglang.srt.layers.aux_hidden_states", "AuxHiddenStatePacker"),
    ("sglang.srt.layers.layer_boundary.residual.batch", "final_norm"),
)
RUNNER_METHODS = ("initialize", "alloc_memory_pool", "init_cuda_graphs", "init_prefill_cuda_graph")


def _digest(t) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy()).hexdigest()


def main(mode: str) -> None:
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.name, record.levelname, record.getMessage(), record.exc_info is not None))

    logging.getLogger().addHandler(Keep())
    logging.getLogger().setLevel(logging.INFO)
    if mode == "old-version":
        import eagle3_ops.sglang.version as version

        version.installed_sglang_version = lambda: "0.5.22"

    import importlib

    originals = {}
    for module, name in TARGETS:
        obj = getattr(importlib.import_module(module), name)
        originals[(module, name)] = obj
    list_capture = originals[TARGETS[1]].capture
    packer_append = originals[TARGETS[2]].append
    # ModelRunner calls configure_aux_hidden_state_capture through its own module-level name (a
    # ``from ... import``): that binding, not only the defining module's, must be the hooked one.
    model_runner = importlib.import_module("sglang.srt.model_executor.model_runner")
    runner_configure = model_runner.configure_aux_hidden_state_capture
    runner_methods = {m: getattr(model_runner.ModelRunner, m) for m in RUNNER_METHODS}
    assert runner_configure is originals[TARGETS[0]]

    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_plugins()
    ours = sorted(t for t, hooks in HookRegistry._hooks.items()
                  for _, hook, _ in hooks if getattr(hook, "__module__", "").startswith("eagle3_ops"))
    configure_now = getattr(importlib.import_module(TARGETS[0][0]), TARGETS[0][1])
    runner_configure_now = model_runner.configure_aux_hidden_state_capture
    unchanged = (configure_now is originals[TARGETS[0]]
                 and runner_configure_now is runner_configure
                 and originals[TARGETS[1]].capture is list_capture
                 and originals[TARGETS[2]].append is packer_append
                 and getattr(importlib.import_module(TARGETS[3][0]), TARGETS[3][1]) is originals[TARGETS[3]]
                 and all(getattr(model_runner.ModelRunner, m) is f for m, f in runner_methods.items()))
    runner_configure_hooked = (runner_configure_now is configure_now and configure_now is not runner_configure
                               and inspect.unwrap(runner_configure_now) is runner_configure)  # AROUND + AFTER
    runner_methods_hooked = all(getattr(getattr(model_runner.ModelRunner, m), "__wrapped__", None) is f
                                for m, f in runner_methods.items())

    import harness as h
    import torch

    h.disable_dynamo()
    h.init_distributed()
    dtype = torch.float32
    cfg = h.FAMILIES["llama"].make_config()
    target = h.sglang_model("llama", cfg, dtype, seed=0)
    before = set(vars(target.model)) | {f"norm{i}:{k}" for i, layer in enumerate(target.model.layers)
                                         for k in vars(layer.input_layernorm)}
    h.configure_capture(target, [0, 1, 2])  # looked up on the module: hooked if the plugin is on
    dcfg = h.eagle3_draft_config(cfg, layer_ids=[0, 1, 2], fc_norm=True)
    draft = h.eagle3_draft(dcfg, dtype)
    h.configure_capture(draft, None, eagle=False)
    after = set(vars(target.model)) | {f"norm{i}:{k}" for i, layer in enumerate(target.model.layers)
                                        for k in vars(layer.input_layernorm)}

    prompts = [[5, 17, 3, 99, 42], [7, 1, 64, 23, 88, 120, 11]]
    kv = h.KVCache(cfg, dtype)
    reqs = [h.Req(kv.new_req()) for _ in prompts]
    out = h.run(target, h.extend_batch(kv, reqs, prompts), kv)
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    dkv = h.KVCache(dcfg, dtype)
    dreqs = [h.Req(dkv.new_req()) for _ in prompts]
    spec = EagleDraftExtendInput(hidden_states=out.hidden_states, num_tokens_per_req=1,
                                 num_tokens_for_logprob_per_req=1)
    dout = h.run(draft, h.extend_batch(dkv, dreqs, [p[1:] + [0] for p in prompts], capture="LAST",
                                       spec_info=spec), dkv)
    from eagle3_ops.sglang.capture_hooks import capture_state
    from eagle3_ops.sglang.draft_fc_hooks import draft_fc_state

    state = capture_state(target)
    print(json.dumps({
        "mode": mode,
        "our_hooks": ours,
        "sglang_functions_unchanged": unchanged,
        "model_runner_configure_hooked": runner_configure_hooked,
        "model_runner_graph_setup_hooked": runner_methods_hooked,
        "model_attrs_added": sorted(after - before),
        "target_patched": state is not None,
        "draft_patched": draft_fc_state(draft) is not None,
        "aux_in_buffer": state is not None and out.hidden_states.data_ptr() == state.buffer.buffer.data_ptr(),
        "digests": {"target_logits": _digest(out.next_token_logits), "aux": _digest(out.hidden_states),
                    "draft_logits": _digest(dout.next_token_logits)},
        "values": {"target_logits": out.next_token_logits.tolist(), "aux": out.hidden_states.tolist(),
                   "draft_logits": dout.next_token_logits.tolist()},
        "backends": __import__("eagle3_ops").backends(torch.device("cpu")),
        "eagle3_log": [m for n, lvl, m, _ in records if n.startswith("eagle3_ops")],
        "eagle3_warnings": [m for n, lvl, m, _ in records if n.startswith("eagle3_ops") and lvl == "WARNING"],
        "eagle3_errors": [m for n, lvl, m, _ in records if n.startswith("eagle3_ops") and lvl == "ERROR"],
        "eagle3_tracebacks": sum(tb for n, _, _, tb in records if n.startswith("eagle3_ops")),
        "sglang_applied": [m for n, lvl, m, _ in records if "Applied" in m and "eagle3_ops" in m],
    }))


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):  # a test's worker script: its usage, nothing run
        print(f"usage: python tests/sglang/plugin_worker.py MODE\n\n{__doc__}")
        sys.exit(0)
    main(sys.argv[1])
