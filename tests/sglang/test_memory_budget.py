"""The capture buffer inside SGLang's memory budget: the plugin installs the target's capture
BEFORE ``ModelRunner.alloc_memory_pool`` (where SGLang sizes the KV cache from the free memory, so
a live buffer is subtracted), logs its size as INFO, and SGLang's later configuration call finds
it installed. The runner is SGLang's hook argument; here a stand-in with the attributes the hook
reads (a real ModelRunner needs a GPU), and SGLang's call order is checked in its source."""
import inspect
import logging
import types

import torch

LAYER_IDS = [0, 1, 2]


def _runner(model, ids=LAYER_IDS, draft=False, eagle=True):
    aux = types.SimpleNamespace(eagle_use_aux_hidden_state=eagle, eagle_aux_hidden_state_layer_ids=ids)
    return types.SimpleNamespace(model=model, is_draft_worker=draft, spec_aux_config=aux)


def _target(h):
    cfg = h.FAMILIES["llama"].make_config()
    return cfg, h.sglang_model("llama", cfg, torch.float32, seed=4)


def test_installed_before_kv_sizing_and_adopted_at_configuration(sglang_cpu, caplog):
    h = sglang_cpu
    from eagle3_ops.sglang import plugin
    from eagle3_ops.sglang.capture_hooks import capture_state

    cfg, model = _target(h)
    with caplog.at_level(logging.INFO, logger="eagle3_ops"):
        plugin._before_alloc_memory_pool(_runner(model))
        state = capture_state(model)
        assert state is not None
        buffer_ptr = state.buffer.buffer.data_ptr()
        h.configure_capture(model, LAYER_IDS)  # SGLang's own call, later: finds it installed
    assert capture_state(model) is state and state.buffer.buffer.data_ptr() == buffer_ptr and state.enabled
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("eagle3_ops")]
    size = [m for m in messages if "capture buffer" in m]
    assert len(size) == 1 and "inside --mem-fraction-static" in size[0]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("eagle3_ops")]
    kv = h.KVCache(cfg, torch.float32)
    out = h.run(model, h.extend_batch(kv, [h.Req(kv.new_req())], [[3, 1, 4, 1, 5]]), kv)
    assert out.hidden_states.data_ptr() == buffer_ptr and state.stats["buffer_forwards"] == 1


def test_draft_and_non_eagle_runners_are_left_alone(sglang_cpu):
    h = sglang_cpu
    from eagle3_ops.sglang import plugin
    from eagle3_ops.sglang.capture_hooks import capture_state

    for runner_kw in (dict(draft=True), dict(eagle=False)):
        _, model = _target(h)
        plugin._before_alloc_memory_pool(_runner(model, **runner_kw))
        assert capture_state(model) is None and model.model.layers_to_capture == []


def test_other_layers_at_configuration_fall_back_to_stock(sglang_cpu, caplog):
    h = sglang_cpu
    from eagle3_ops.sglang import plugin
    from eagle3_ops.sglang.capture_hooks import capture_state

    cfg, model = _target(h)
    plugin._before_alloc_memory_pool(_runner(model))
    state = capture_state(model)
    with caplog.at_level(logging.ERROR, logger="eagle3_ops"):
        h.configure_capture(model, [0, 2])  # not what the buffer was laid out for (cannot happen in SGLang)
    assert not state.enabled
    assert any("laid out for [1, 2, 3]" in r.getMessage() for r in caplog.records)
    kv = h.KVCache(cfg, torch.float32)
    out = h.run(model, h.extend_batch(kv, [h.Req(kv.new_req())], [[3, 1, 4]]), kv)
    assert out.hidden_states.shape == (3, 2 * cfg.hidden_size)
    assert out.hidden_states.data_ptr() != state.buffer.buffer.data_ptr()


def test_sglang_sizes_the_kv_cache_inside_alloc_memory_pool_before_configuring_capture():
    """The order this relies on (SGLang 0.5.23): the scheduler sizes the memory pools before it
    initialises the attention backends (which configure the aux capture), the KV cache is sized
    inside ModelRunner.alloc_memory_pool, from the free memory at that moment."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner import ModelRunner

    init = inspect.getsource(Scheduler.init_model_worker)
    assert init.index("self.init_memory_pools()") < init.index("self.init_all_attention_backends()")
    assert "self.kv_cache_configurator.configure(" in inspect.getsource(ModelRunner.alloc_memory_pool)
    assert "configure_aux_hidden_state_capture(" in inspect.getsource(ModelRunner.init_attention_backends)
    profile = inspect.getsource(KVCacheConfigurator._profile_available_bytes)
    assert "get_available_gpu_memory(" in profile


def test_draft_fc_installed_and_sharded_before_kv_sizing(sglang_cpu, monkeypatch, caplog):
    """AFTER ModelRunner.initialize of the draft runner (SGLang loads the draft before it sizes the
    KV cache): the fused fc is installed and, under TP > 1, sharded there, so the released weight
    is free memory when the target's alloc_memory_pool measures; the target's buffer line then
    says how much sharding released next to what the buffer costs."""
    import weakref

    import sglang.srt.distributed.parallel_state as ps

    from eagle3_ops.sglang import draft_fc_hooks, fc_sharding, plugin
    from eagle3_ops.sglang.capture_hooks import capture_state

    h = sglang_cpu
    cfg, target = _target(h)
    dcfg = h.eagle3_draft_config(cfg, layer_ids=LAYER_IDS)
    draft = h.eagle3_draft(dcfg, torch.float32)

    class Group:
        world_size, rank_in_group, device_group = 2, 0, object()

    group = Group()
    monkeypatch.setattr(ps, "get_tp_group", lambda: group)
    monkeypatch.setattr(draft.model.layers[0].self_attn.qkv_proj, "tp_group", group)
    monkeypatch.setattr(fc_sharding, "_sharded_states", weakref.WeakSet())
    from eagle3_ops.sglang import lockstep

    monkeypatch.setattr(lockstep, "all_ranks_agree", lambda ok, group: ok)  # one process plays one rank
    monkeypatch.setattr(lockstep, "same_on_all_ranks", lambda text, group: True)
    plugin._after_initialize(None, types.SimpleNamespace(model=target, is_draft_worker=False))
    assert draft_fc_hooks.draft_fc_state(target) is None  # a target runner: nothing here
    plugin._after_initialize(None, types.SimpleNamespace(model=draft, is_draft_worker=True))
    state = draft_fc_hooks.draft_fc_state(draft)
    assert state is not None and state.sharding["released"]
    freed = state.sharding["bytes_before"] - state.sharding["bytes_after"]
    assert freed == 64 * 192 * 4 // 2
    with caplog.at_level(logging.INFO, logger="eagle3_ops"):
        plugin._before_alloc_memory_pool(_runner(target))
        h.configure_capture(draft, None, eagle=False)  # SGLang's later call finds the draft installed
    assert draft_fc_hooks.draft_fc_state(draft) is state
    line = [r.getMessage() for r in caplog.records if "capture buffer" in r.getMessage()]
    assert capture_state(target) is not None and len(line) == 1
    assert f"the draft fc sharding released {freed / 2**20:.1f} MiB on this rank, less than this buffer" in line[0]


def test_buffer_rows_come_from_sglangs_own_graph_settings(monkeypatch):
    """Without EAGLE3_OPS_SGLANG_MAX_TOKENS the buffer holds what one target forward of this server can
    capture: SGLang's chunked_prefill_size, and at least the largest decode/verify CUDA-graph batch (SGLang
    0.5.23 keeps it in cuda_graph_config.decode: its captured sizes ``bs`` and ``max_bs``) or the most
    running requests, times the draft tokens per request. Read from SGLang's own config classes."""
    import sglang.srt.runtime_context as rc
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig

    from eagle3_ops.sglang.serving import default_max_tokens

    def serve(**kw):
        args = dict(chunked_prefill_size=512, max_prefill_tokens=16384, speculative_num_draft_tokens=4,
                    max_running_requests=None, cuda_graph_config=CudaGraphConfig())
        args.update(kw)
        monkeypatch.setattr(rc, "get_server_args", lambda: types.SimpleNamespace(**args))
        monkeypatch.setattr(rc, "get_exec", lambda: (_ for _ in ()).throw(ValueError("not published")))
        return default_max_tokens()

    # DP-attention-sized verify batches: 256 requests x 4 draft tokens > the 512-token chunk
    assert serve(cuda_graph_config=CudaGraphConfig(decode=PhaseConfig(backend="full", max_bs=256))) == 1024
    assert serve(cuda_graph_config=CudaGraphConfig(decode=PhaseConfig(backend="full", bs=[1, 8, 160]))) == 640
    assert serve(max_running_requests=300) == 1200
    assert serve() == 512  # no graph sizes known: the chunk
    assert serve(chunked_prefill_size=-1) == 16384  # chunked prefill off: max_prefill_tokens
    # the resolved config SGLang publishes in its exec namespace wins over the raw server args
    exec_ns = types.SimpleNamespace(graph=types.SimpleNamespace(
        cuda_graph_config=CudaGraphConfig(decode=PhaseConfig(backend="full", bs=[2, 4, 320]))))
    monkeypatch.setattr(rc, "get_exec", lambda: exec_ns)
    monkeypatch.setattr(rc, "get_server_args", lambda: types.SimpleNamespace(
        chunked_prefill_size=512, max_prefill_tokens=16384, speculative_num_draft_tokens=4,
        max_running_requests=None, cuda_graph_config=None))
    assert default_max_tokens() == 1280
