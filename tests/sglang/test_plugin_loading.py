"""The plugin as SGLang loads it: discovered through the installed ``sglang.srt.plugins`` entry
point in a fresh process (``load_plugins``), one log line per patched site; off with
EAGLE3_OPS_SGLANG=0 (SGLang byte-for-byte stock) or when left out of SGLANG_PLUGINS; inactive with
one warning on an unsupported SGLang version; unknown model families left stock."""
import json
import os
from importlib.metadata import entry_points

import pytest
import torch

import machine

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUR_TARGETS = sorted([
    "sglang.srt.layers.aux_hidden_states.AuxHiddenStateList.capture",
    "sglang.srt.layers.aux_hidden_states.AuxHiddenStatePacker.append",
    "sglang.srt.layers.layer_boundary.residual.batch.final_norm",  # the states dump (inert unless recording)
    "sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool",  # the buffer before KV sizing
    "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs",
    "sglang.srt.model_executor.model_runner.ModelRunner.initialize",  # the draft fc before KV sizing
    "sglang.srt.model_executor.model_runner.ModelRunner.init_prefill_cuda_graph",
    "sglang.srt.model_executor.model_runner_components.attention_backend_setup.configure_aux_hidden_state_capture",
    # twice: AROUND (the ids to capture where SGLang would fail on the config's, wiring_check.ids_to_serve), AFTER
    "sglang.srt.model_executor.model_runner_components.attention_backend_setup.configure_aux_hidden_state_capture",
    # re-fold kept folded draft fc weights after every online weight update
    "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater.load_weights_from_distributed",
    "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater.update_weights_from_disk",
    "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater.update_weights_from_ipc",
    "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater.update_weights_from_tensor",
    # static_inputs.py: SGLang's static copies of the aux states become same-storage
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.capture",
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.load_batch",
    "sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend.BreakableCudaGraphBackend._alloc_full_buffer",
    "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner.EAGLEDraftExtendCudaGraphRunner.capture",
    "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner.EAGLEDraftExtendCudaGraphRunner.execute",
    # wiring_check.py: the forward the live check records runs eagerly; observed acceptance is counted
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.can_run_graph",
    "sglang.srt.model_executor.runner.base_runner.BaseRunner._dummy_run",
    "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor."
    "_resolve_spec_v2_tokens",
    # spec_report.py: where a decode cycle's time goes (the cycle and its three phases)
    "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation",
    "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.draft",
    "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.verify",
    "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker._draft_extend_for_decode",
])


def _other_plugins():
    return [ep.name for ep in entry_points(group="sglang.srt.plugins") if ep.name != "eagle3_ops"]


@pytest.fixture(scope="module")
def worker_runs(tmp_path_factory):
    """The scenarios, each in a fresh SGLang process (forked side by side from one that imported SGLang:
    tests/sglang/forked.py)."""
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
                SGLANG_NCCL_SO_PATH="/nonexistent", TORCHDYNAMO_DISABLE="1")
    for var in [v for v in base if v.startswith("EAGLE3_OPS_")] + ["SGLANG_USE_CPU_ENGINE", "SGLANG_PLUGINS"]:
        base.pop(var, None)
    scenarios = {
        "default": {},
        "off": {"EAGLE3_OPS_SGLANG": "0"},
        # every installed plugin except ours (SGLANG_PLUGINS is a whitelist)
        "excluded": {"SGLANG_PLUGINS": ",".join(_other_plugins()) or "none"},
        "old-version": {},
        "bad-max-tokens": {"EAGLE3_OPS_SGLANG_MAX_TOKENS": "1e9"},
    }
    import harness

    modes = list(scenarios)
    jobs = [{"script": os.path.join(HERE, "plugin_worker.py"), "argv": [mode], "env": scenarios[mode],
             "out": str(tmp_path_factory.mktemp("plugin_worker") / f"{mode}.log")} for mode in modes]
    outputs = harness.run_forked(jobs, base, tmp_path_factory.mktemp("plugin_jobs"), machine.timeout(420))
    return {mode: json.loads(out.strip().splitlines()[-1]) for mode, out in zip(modes, outputs)}


def test_entry_point_is_installed():
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("eagle3_ops") == "eagle3_ops.sglang.plugin:register"


def test_discovered_through_entry_point_and_patches_each_site(worker_runs):
    r = worker_runs["default"]
    assert r["our_hooks"] == OUR_TARGETS and not r["sglang_functions_unchanged"]
    # the name ModelRunner actually calls (its own ``from ... import`` binding) is the hooked one
    assert r["model_runner_configure_hooked"] and r["model_runner_graph_setup_hooked"]
    assert r["target_patched"] and r["draft_patched"] and r["aux_in_buffer"]
    log = r["eagle3_log"]
    assert sum("plugin registered" in m for m in log) == 1
    # one line per patched site, each naming the backend in use
    sites = [m for m in log if m.startswith("eagle3_ops: patched")]
    assert len(sites) == 2  # target capture + draft fc
    assert all("backend " in m for m in sites)
    # the CPU is not qualified under the default (auto): SGLang's norms run, every capture is a copy
    assert "SGLang's own norms run and every capture is one copy into its slot (not qualified" in sites[0]
    # the only warning: the capture buffer's size (it is outside SGLang's memory budget)
    assert len(r["eagle3_warnings"]) == 1, r["eagle3_warnings"]
    assert "capture buffer" in r["eagle3_warnings"][0] and "EAGLE3_OPS_SGLANG_MAX_TOKENS" in r["eagle3_warnings"][0]
    assert len(r["sglang_applied"]) == len(set(OUR_TARGETS))  # SGLang says "Applied N hook(s)" once per target
    assert any("Applied 2 hook(s) to sglang.srt.model_executor.model_runner_components.attention_backend_setup."
               "configure_aux_hidden_state_capture" in m for m in r["sglang_applied"]), r["sglang_applied"]


def test_bad_max_tokens_is_one_message_and_the_target_stays_stock(worker_runs):
    """A bad EAGLE3_OPS_SGLANG_MAX_TOKENS: one error line, at startup, naming the variable, the
    value and what is accepted; no traceback; the target keeps SGLang's capture (bit-identical to
    a process without the plugin) while the draft fc, which the variable does not affect, is patched."""
    r, off = worker_runs["bad-max-tokens"], worker_runs["off"]
    assert r["eagle3_errors"] == [
        "eagle3_ops: EAGLE3_OPS_SGLANG_MAX_TOKENS='1e9' is not valid: expected a whole number of tokens from 1 to "
        "1048576 (unset: SGLang's chunked_prefill_size, at least the largest CUDA-graph batch); to turn the plugin "
        "off use EAGLE3_OPS_SGLANG=0; no capture buffer is installed: EAGLE-3 targets keep SGLang's stock capture"]
    assert r["eagle3_tracebacks"] == 0 and not any("could not patch" in m for m in r["eagle3_log"])
    assert not r["target_patched"] and r["draft_patched"]
    assert r["digests"]["aux"] == off["digests"]["aux"]
    assert r["digests"]["target_logits"] == off["digests"]["target_logits"]


def test_off_switch_leaves_sglang_stock(worker_runs):
    off, excluded = worker_runs["off"], worker_runs["excluded"]
    for r in (off, excluded):
        assert r["our_hooks"] == [] and r["sglang_functions_unchanged"] and not r["model_runner_configure_hooked"]
        assert r["model_attrs_added"] == [] and not r["target_patched"] and not r["draft_patched"]
        assert r["eagle3_log"] == [] and r["sglang_applied"] == []
    # the same bits as a process in which SGLang never called the plugin
    assert off["digests"] == excluded["digests"]


def test_plugin_on_gives_the_stock_answers(worker_runs):
    on, off = worker_runs["default"], worker_runs["off"]
    assert on["model_attrs_added"]  # it did patch this time, and the answers are stock's
    for name in ("target_logits", "aux", "draft_logits"):
        torch.testing.assert_close(torch.tensor(on["values"][name]), torch.tensor(off["values"][name]),
                                   atol=1e-5, rtol=1e-5, msg=name)
    if set(on["backends"].values()) == {"reference"}:
        assert on["digests"] == off["digests"]  # fp32 reference ops: bit-identical to SGLang's own


def test_unsupported_sglang_version_warns_once_and_stays_stock(worker_runs):
    r = worker_runs["old-version"]
    assert r["our_hooks"] == [] and r["sglang_functions_unchanged"] and not r["target_patched"]
    assert len(r["eagle3_warnings"]) == 1 and "0.5.22" in r["eagle3_warnings"][0]
    assert r["digests"] == worker_runs["off"]["digests"]


def test_version_check():
    from eagle3_ops.sglang.version import check_sglang_version

    assert check_sglang_version("0.5.23")[0]
    assert check_sglang_version("0.5.23+cu130")[0]
    assert not check_sglang_version("0.5.22")[0] and not check_sglang_version("0.6.0")[0]


def test_a_model_class_of_its_own_goes_through_the_shared_mechanism(sglang_cpu):
    """The plugin hooks SGLang's shared capture mechanism, not a list of model classes: a model class
    nobody told it about (here a LlamaModel subclass with a forward of its own) gets the persistent
    buffer, and its captures and logits are bitwise stock's."""
    h = sglang_cpu
    dtype = torch.float32
    cfg = h.FAMILIES["llama"].make_config()
    stock, model = h.sglang_model("llama", cfg, dtype, seed=3), h.sglang_model("llama", cfg, dtype, seed=3)

    class CustomModel(type(model.model)):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model.model.__class__ = CustomModel
    stock.set_eagle3_layers_to_capture([0, 1, 2])
    h.configure_capture(model, [0, 1, 2])
    from eagle3_ops.sglang.capture_hooks import capture_state

    state = capture_state(model)
    assert state is not None and state.owner_class.endswith("CustomModel") and state.layer_ids == [1, 2, 3]
    outs = []
    for m in (model, stock):
        kv = h.KVCache(cfg, dtype)
        outs.append(h.run(m, h.extend_batch(kv, [h.Req(kv.new_req())], [[1, 2, 3]]), kv))
    assert state.stats["buffer_forwards"] == 1
    assert outs[0].hidden_states.data_ptr() == state.buffer.buffer.data_ptr()
    assert torch.equal(outs[0].hidden_states, outs[1].hidden_states)
    assert torch.equal(outs[0].next_token_logits, outs[1].next_token_logits)


def test_a_structure_the_mechanism_does_not_recognise_is_left_stock(sglang_cpu, caplog):
    """Two modules holding a configured layers_to_capture: the plugin cannot tell which forward
    captures, so the model keeps SGLang's own capture path, with one log line naming the class and
    the reason."""
    h = sglang_cpu
    dtype = torch.float32
    cfg = h.FAMILIES["llama"].make_config()
    model = h.sglang_model("llama", cfg, dtype, seed=3)
    model.model.layers[0].layers_to_capture = [1]  # a second holder
    with caplog.at_level("WARNING", logger="eagle3_ops.sglang"):
        h.configure_capture(model, [0, 1, 2])
        h.configure_capture(model, [0, 1, 2])
    from eagle3_ops.sglang.capture_hooks import capture_state

    assert capture_state(model) is None
    warnings = [r.getMessage() for r in caplog.records if "left stock" in r.getMessage()]
    assert len(warnings) == 1 and "LlamaForCausalLM" in warnings[0] and "several modules hold layers_to_capture" \
        in warnings[0] and "model.layers.0" in warnings[0]
    kv = h.KVCache(cfg, dtype)
    out = h.run(model, h.extend_batch(kv, [h.Req(kv.new_req())], [[1, 2, 3]]), kv)
    assert out.hidden_states.shape == (3, 3 * cfg.hidden_size)
