"""The SGLang plugin entry point: ``eagle3_ops = eagle3_ops.sglang.plugin:register`` in the
``sglang.srt.plugins`` entry-point group.

SGLang calls :func:`register` (no arguments) early in every process (``load_plugins``), then
applies the hooks registered with its ``HookRegistry``. We register:

* AFTER ``ModelRunner.initialize`` — for a draft runner (loaded inside SGLang's draft TP context,
  before any KV sizing): the fused fc, sharded under TP > 1, so the replicated weight it releases
  is memory the KV sizing sees.
* BEFORE ``ModelRunner.alloc_memory_pool`` — where SGLang sizes the KV cache. For a target runner
  that will capture EAGLE-3 aux states, the capture (and its persistent buffer) is installed here,
  so the buffer counts against ``--mem-fraction-static`` (capture_hooks.install_before_kv_sizing).
* AFTER ``attention_backend_setup.configure_aux_hidden_state_capture`` — SGLang calls it for every
  model runner (target and draft) after the weights are loaded and before CUDA-graph capture. For
  a target configured for EAGLE-3 it installs the persistent capture buffer (capture_hooks) if the
  hook above did not already; for an EAGLE-3 draft it installs the fused fc and, under TP > 1, shards
  it over the TP ranks (draft_fc_hooks). Nothing is patched before these, and only on that model
  instance.
* AROUND ``AuxHiddenStateList.capture`` and ``AuxHiddenStatePacker.append`` — inert (one
  thread-local read) unless a model with an installed buffer is running its forward.
* AFTER each online weight update of ``WeightUpdater`` (from disk, tensor, IPC, distributed) — the
  folded draft fc weights (kept only where qualification chose them) are folded again in place.
* AFTER ``ModelRunner.init_cuda_graphs`` and ``ModelRunner.init_prefill_cuda_graph`` (the draft's
  prefill graphs are set up by the latter) — a check only: SGLang's graph/compile setup may replace
  a model's ``forward`` (``tc_piecewise``'s ``install_torch_compiled``); the plugin wraps the model
  class's forward, which that trampoline still calls, and warns once if a patched model no longer
  routes through it.

``EAGLE3_OPS_SGLANG=0`` makes :func:`register` return before touching anything (SGLang runs
byte-for-byte stock), as does leaving ``eagle3_ops`` out of ``SGLANG_PLUGINS`` (SGLang then never
calls it). An unsupported SGLang version gets one warning and no hooks. No error in here may stop
SGLang: every failure is logged and leaves SGLang stock.

With ``EAGLE3_OPS_DUMP_STATES=PATH`` (off by default) the target also records a STATES file for
``doctor --replay`` (dump_states.py), through one more hook: AROUND SGLang's
``residual_batch.final_norm``, inert (one thread-local read) outside a recorded forward.
"""
from __future__ import annotations

import logging

from .version import check_sglang_version, plugin_enabled

log = logging.getLogger("eagle3_ops.sglang")

CONFIGURE_TARGET = ("sglang.srt.model_executor.model_runner_components.attention_backend_setup."
                    "configure_aux_hidden_state_capture")
LIST_CAPTURE_TARGET = "sglang.srt.layers.aux_hidden_states.AuxHiddenStateList.capture"
PACKER_APPEND_TARGET = "sglang.srt.layers.aux_hidden_states.AuxHiddenStatePacker.append"
FINAL_NORM_TARGET = "sglang.srt.layers.layer_boundary.residual.batch.final_norm"  # the states dump only
ALLOC_MEMORY_POOL_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool"
INITIALIZE_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.initialize"
GRAPHS_TARGETS = ("sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs",
                  "sglang.srt.model_executor.model_runner.ModelRunner.init_prefill_cuda_graph")
# Every online weight update of SGLang's WeightUpdater (some write the parameters directly, not
# through the model's load_weights): the folded draft fc weights are folded again after each.
_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater."
WEIGHT_UPDATE_TARGETS = tuple(_UPDATER + m for m in ("update_weights_from_disk", "load_weights_from_distributed",
                                                     "update_weights_from_tensor", "update_weights_from_ipc"))

_registered = False
_warned_version = False


def _around_configure_aux_hidden_state_capture(original, *args, **kwargs):
    """AROUND SGLang's configure call: where the draft config asks for captures SGLang will not take (its first
    forward would fail), the live check's choice of ids to capture instead (wiring_check.ids_to_serve)."""
    try:
        if kwargs.get("eagle_use_aux_hidden_state") and kwargs.get("model") is not None:
            from .wiring_check import ids_to_serve

            served = ids_to_serve(kwargs["model"], kwargs.get("eagle_aux_hidden_state_layer_ids"))
            if served is not None:
                kwargs = dict(kwargs, eagle_aux_hidden_state_layer_ids=served)
    except Exception:  # never stop SGLang: its own configuration stands
        log.debug("eagle3_ops: the live check's choice of ids failed; SGLang configures the capture as asked",
                  exc_info=True)
    return original(*args, **kwargs)


def _on_configure_aux_hidden_state_capture(result, *args, **kwargs):
    """AFTER hook: SGLang has configured (or not) the aux capture of ``model``."""
    model = kwargs.get("model", args[0] if args else None)
    try:
        if model is None:
            return None
        if kwargs.get("eagle_use_aux_hidden_state"):
            from .capture_hooks import install_target_capture

            install_target_capture(model)
            _install_dump(model)
            _start_wiring_check(model)
        else:
            from .draft_fc_hooks import install_draft_fc

            install_draft_fc(model)
    except Exception:  # never stop SGLang; the model keeps whatever stock path it had
        log.exception("eagle3_ops: could not patch %s; it runs stock", type(model).__name__)
    return None


def _after_weight_update(result, *args, **kwargs):
    """AFTER each WeightUpdater update: re-fold every kept folded draft fc weight in place (the
    parameters were overwritten; the folded copies, which captured graphs read, must follow). When
    a fold fails, SGLang's ``(success, message)`` answer becomes ``(False, why)``: the update did
    not fully take effect, and the caller must hear it (never a silent "Success")."""
    failures = []
    try:
        from .draft_fc_hooks import refold_all

        failures = refold_all()
    except Exception as e:  # never stop SGLang
        log.exception("eagle3_ops: re-folding the draft fc weights after a weight update failed")
        failures = [f"eagle3_ops: re-folding the draft fc weights failed: {e}"]
    if failures and isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        return False, "; ".join(failures)
    return result


def _after_initialize(result, *args, **kwargs):
    """AFTER ``ModelRunner.initialize`` (weights loaded and post-processed): for a draft runner,
    install the fused fc now (and shard it under TP > 1), inside SGLang's draft TP context and
    before the target's ``alloc_memory_pool`` sizes the KV cache, so the released replicated fc
    weight is free memory the sizing counts."""
    runner = kwargs.get("self", args[0] if args else None)
    model = getattr(runner, "model", None)
    try:
        if getattr(runner, "is_draft_worker", False) and model is not None:
            from .draft_fc_hooks import install_draft_fc

            install_draft_fc(model)
    except Exception:  # never stop SGLang; the configuration-time install runs as before
        log.exception("eagle3_ops: could not install the draft fc after the draft was loaded; it is installed "
                      "when SGLang configures the draft")
    return None


def _before_alloc_memory_pool(*args, **kwargs):
    """BEFORE ``ModelRunner.alloc_memory_pool``, where SGLang sizes the KV cache: a target runner's
    capture buffer is installed now, so it counts against ``--mem-fraction-static``."""
    runner = kwargs.get("self", args[0] if args else None)
    try:
        from .capture_hooks import install_before_kv_sizing

        install_before_kv_sizing(runner)
    except Exception:  # never stop SGLang; the configuration-time install runs as before
        log.exception("eagle3_ops: could not install the capture before KV sizing; it is installed when SGLang "
                      "configures the capture (outside the memory budget)")
    return None


def _static_input_hook(name: str):
    """A BEFORE hook from static_inputs.py that logs and steps aside on any error (never stops SGLang)."""
    def hook(*args, **kwargs):
        from . import static_inputs

        try:
            return getattr(static_inputs, name)(*args, **kwargs)
        except Exception:
            log.exception("eagle3_ops: %s failed; SGLang's own static buffer is used", name)
            return None

    hook.__name__ = hook.__qualname__ = f"_static_input_{name}"
    return hook


def _around_alloc_full_buffer(original, self, output, size, *args, **kwargs):
    """AROUND SGLang's BCG ``_alloc_full_buffer``: the aux states' leaf becomes the capture buffer."""
    try:
        from .static_inputs import bcg_output_slot

        slot = bcg_output_slot(output, size)
    except Exception:
        log.exception("eagle3_ops: could not decide the BCG output slot; SGLang allocates it")
        slot = None
    return slot if slot is not None else original(self, output, size, *args, **kwargs)


def _install_dump(model) -> None:
    """The engine-side STATES dump for ``doctor --replay`` (EAGLE3_OPS_DUMP_STATES; off by default).
    A bad EAGLE3_OPS_DUMP_* value is one ERROR line and the dump stays off (dump_states.install_dump)."""
    from .dump_states import install_dump

    install_dump(model)


def _start_wiring_check(model) -> None:
    """The live wiring check (wiring_check.py; on by default, EAGLE3_OPS_WIRING_CHECK=0 turns it off)."""
    from .wiring_check import start

    try:
        start(model)  # never raises for what a user's machine can do (it says the cause in one line)
    except Exception as e:  # a bug in eagle3_ops: one line, the traceback at DEBUG; never stop SGLang
        log.error("eagle3_ops: the live wiring check could not start (%s: %s: an internal error of eagle3_ops: "
                  "please report it; its traceback is logged at DEBUG level); serving is unaffected",
                  type(e).__name__, e)
        log.debug("eagle3_ops: the live wiring check could not start", exc_info=True)


def _around_can_run_graph(original, *args, **kwargs):
    from .dump_states import around_can_run_graph

    return around_can_run_graph(original, *args, **kwargs)


def _around_dummy_run(original, *args, **kwargs):
    from .dump_states import around_dummy_run

    return around_dummy_run(original, *args, **kwargs)


def _after_resolve_spec_tokens(result, *args, **kwargs):
    """AFTER SGLang's ``_resolve_spec_v2_tokens``: the live wiring check's and the speculation report's counts."""
    try:
        from .wiring_check import after_resolve_spec_tokens

        after_resolve_spec_tokens(result, *args, **kwargs)
    except Exception:  # a count only: never stop SGLang
        log.exception("eagle3_ops: the live wiring check could not count accepted tokens")
    try:
        from . import spec_report
        from .wiring_acceptance import correct_drafts

        spec_report.after_resolve_spec_tokens(correct_drafts(args, kwargs))
    except Exception:  # a count only: never stop SGLang
        log.exception("eagle3_ops: the speculation report could not count accepted tokens")
    return result


def _around_spec_cycle(original, *args, **kwargs):
    from .spec_report import around_cycle

    return around_cycle(original, *args, **kwargs)


def _around_spec_phase(phase: str):
    from .spec_report import around_phase

    hook = around_phase(phase)

    def around(original, *args, **kwargs):
        return hook(original, *args, **kwargs)

    return around


def _around_final_norm(original, *args, **kwargs):
    from .dump_states import final_norm_hook

    return final_norm_hook(original, *args, **kwargs)


def _after_graph_setup(result, *args, **kwargs):
    """AFTER hook on ModelRunner's graph setup: warn once if a patched model no longer routes
    through the plugin (its forward was replaced by something that does not call the class's)."""
    runner = kwargs.get("self", args[0] if args else None)
    model = getattr(runner, "model", None)
    try:
        if model is not None:
            from .capture_hooks import check_routing as check_target
            from .draft_fc_hooks import check_routing as check_draft

            check_target(model)
            check_draft(model)
    except Exception:  # a check only: never stop SGLang
        log.exception("eagle3_ops: could not check %s after graph setup", type(model).__name__)
    return None


def _around_list_capture(original, *args, **kwargs):
    from .capture_hooks import list_capture_hook

    return list_capture_hook(original, *args, **kwargs)


def _around_packer_append(original, *args, **kwargs):
    from .capture_hooks import packer_append_hook

    return packer_append_hook(original, *args, **kwargs)


def register() -> None:
    """Entry point called by SGLang's ``load_plugins`` (idempotent)."""
    global _registered, _warned_version
    if _registered or not plugin_enabled():
        return
    ok, reason = check_sglang_version()
    if not ok:
        if not _warned_version:
            _warned_version = True
            log.warning("eagle3_ops: %s; the SGLang plugin is inactive and SGLang is left unchanged", reason)
        return
    from .. import settings

    settings.report_problems(log)  # each bad or unknown EAGLE3_OPS_* variable: one line, at startup
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(INITIALIZE_TARGET, _after_initialize, HookType.AFTER)
        HookRegistry.register(ALLOC_MEMORY_POOL_TARGET, _before_alloc_memory_pool, HookType.BEFORE)
        HookRegistry.register(CONFIGURE_TARGET, _around_configure_aux_hidden_state_capture, HookType.AROUND)
        HookRegistry.register(CONFIGURE_TARGET, _on_configure_aux_hidden_state_capture, HookType.AFTER)
        HookRegistry.register(LIST_CAPTURE_TARGET, _around_list_capture, HookType.AROUND)
        HookRegistry.register(PACKER_APPEND_TARGET, _around_packer_append, HookType.AROUND)
        for target in GRAPHS_TARGETS:
            HookRegistry.register(target, _after_graph_setup, HookType.AFTER)
        HookRegistry.register(FINAL_NORM_TARGET, _around_final_norm, HookType.AROUND)
        from .dump_states import CAN_RUN_GRAPH_TARGET, DUMMY_RUN_TARGET
        from .wiring_acceptance import ACCEPTANCE_TARGET

        HookRegistry.register(CAN_RUN_GRAPH_TARGET, _around_can_run_graph, HookType.AROUND)
        HookRegistry.register(DUMMY_RUN_TARGET, _around_dummy_run, HookType.AROUND)
        HookRegistry.register(ACCEPTANCE_TARGET, _after_resolve_spec_tokens, HookType.AFTER)
        from . import spec_report

        HookRegistry.register(spec_report.CYCLE_TARGET, _around_spec_cycle, HookType.AROUND)
        for phase, target in spec_report.PHASE_TARGETS.items():
            HookRegistry.register(target, _around_spec_phase(phase), HookType.AROUND)
        for target in WEIGHT_UPDATE_TARGETS:
            HookRegistry.register(target, _after_weight_update, HookType.AFTER)
        from . import static_inputs as si

        HookRegistry.register(si.BCG_ALLOC_TARGET, _around_alloc_full_buffer, HookType.AROUND)
        for target, name in ((si.DRAFT_PREFILL_CAPTURE_TARGET, "before_draft_prefill_capture"),
                             (si.DRAFT_PREFILL_LOAD_TARGET, "before_draft_prefill_load_batch"),
                             (si.DRAFT_EXTEND_CAPTURE_TARGET, "before_draft_extend_capture"),
                             (si.DRAFT_EXTEND_EXECUTE_TARGET, "before_draft_extend_execute")):
            HookRegistry.register(target, _static_input_hook(name), HookType.BEFORE)
    except Exception:
        log.exception("eagle3_ops: could not register the SGLang hooks; SGLang is left unchanged")
        return
    _registered = True
    log.info("eagle3_ops: SGLang plugin registered (%s); EAGLE-3 capture and draft fc are patched per "
             "model when SGLang configures them (EAGLE3_OPS_SGLANG=0 turns this off)", reason)


def install() -> bool:
    """For use without SGLang's plugin loader (scripts, tests): register and apply the hooks now.
    Returns whether the plugin is active."""
    register()
    if not _registered:
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()
    return True


def is_registered() -> bool:
    """Whether :func:`register` has run in this process (SGLang's plugin loader calls it once)."""
    return _registered
