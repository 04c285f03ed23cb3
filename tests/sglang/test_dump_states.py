"""The engine-side STATES dump (EAGLE3_OPS_DUMP_STATES) on SGLang's own model classes (CPU).

- what it records are the engine's own captures: at the configured boundaries, bitwise the aux
  states SGLang hands the draft; every boundary equals Hugging Face's ``output_hidden_states``
  (boundary L: the last layer's output before the final norm); next tokens = HF's greedy argmax;
- served outputs (logits and aux states) are bitwise unchanged by recording;
- only prefill tokens of sequences that start at position 0 are kept, up to the token budget;
- end to end: the tiny target served mis-wired, dumped, and ``doctor --replay`` on the dump finds
  the wiring the draft was trained on.
"""
import json
import os
import stat
import threading

import pytest
import torch

from eagle3_ops.doctor.states import needed_boundaries, read_states
from eagle3_ops.sglang.dump_states import wait_all  # the file is written off the forward's thread

PROMPTS = [[5, 17, 3, 99, 42, 8], [7, 1, 64, 23, 88, 120, 11]]


@pytest.fixture
def dump_env(monkeypatch, tmp_path):
    from eagle3_ops.sglang import dump_states

    monkeypatch.setattr(dump_states, "_recorders", [])  # recordings other tests left unfinished
    def set_env(tokens=None, boundaries=None):
        path = tmp_path / "states.safetensors"
        monkeypatch.setenv("EAGLE3_OPS_DUMP_STATES", str(path))
        if tokens is not None:
            monkeypatch.setenv("EAGLE3_OPS_DUMP_TOKENS", str(tokens))
        if boundaries is not None:
            monkeypatch.setenv("EAGLE3_OPS_DUMP_BOUNDARIES", boundaries)
        return path
    return set_env


def _extend(h, model, cfg, dtype, prompts):
    kv = h.KVCache(cfg, dtype)
    reqs = [h.Req(kv.new_req()) for _ in prompts]
    out = h.run(model, h.extend_batch(kv, reqs, prompts), kv)
    return out, out.hidden_states.clone(), out.next_token_logits.clone(), kv, reqs


def _hf_reference(hf, prompts):
    """Per prompt: HF boundaries 0..L-1, the last layer's pre-norm output (boundary L), greedy next tokens."""
    grabbed = {}
    hook = hf.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: grabbed.__setitem__("last", out[0] if isinstance(out, tuple) else out))
    refs = []
    try:
        with torch.no_grad():
            for p in prompts:
                o = hf(torch.tensor(p)[None], output_hidden_states=True)
                hs = [t[0] for t in o.hidden_states]
                refs.append({"hidden": hs[:-1] + [grabbed["last"][0]], "next": o.logits[0].argmax(-1)})
    finally:
        hook.remove()
    return refs


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_dump_records_engine_captures_and_changes_nothing(sglang_cpu, dump_env, family):
    h = sglang_cpu
    dtype = torch.float32
    cfg = h.FAMILIES[family].make_config()
    hf = h.hf_model(family, cfg, dtype)
    model = h.sglang_from_hf(family, cfg, dtype, hf)
    L = cfg.num_hidden_layers

    model.set_eagle3_layers_to_capture([0, 1])  # stock: SGLang captures boundaries [1, 2]
    _, stock_aux, stock_logits, _, _ = _extend(h, model, cfg, dtype, PROMPTS)

    budget = len(PROMPTS[0]) + 4  # the second prompt is cut at 4 tokens
    path = dump_env(tokens=budget)
    h.configure_capture(model, [0, 1])  # the plugin installs capture and the dump here
    from eagle3_ops.sglang.dump_states import dump_state

    rec = dump_state(model)
    assert rec is not None and rec.boundaries == needed_boundaries([1, 2], L) == list(range(L + 1))
    _, aux, logits, _, _ = _extend(h, model, cfg, dtype, PROMPTS)
    # the forward that fills the budget hands the file to a thread (serving goes on), one the interpreter
    # finishes before it exits (not a daemon)
    assert rec.writer is not None and rec.writer is not threading.current_thread() and not rec.writer.daemon
    rec.wait()
    assert rec.done and path.is_file(), "the file is written when the budget is full"
    assert torch.equal(aux, stock_aux) and torch.equal(logits, stock_logits), "recording changed served outputs"

    states = read_states(path, num_layers=L, hidden_size=cfg.hidden_size)
    assert states.boundaries == list(range(L + 1))
    assert [p["input_ids"].tolist() for p in states.prompts] == [PROMPTS[0], PROMPTS[1][:4]]
    # the configured boundaries are bitwise what SGLang packed for the draft
    H = cfg.hidden_size
    first = states.prompts[0]["boundaries"]
    T0 = len(PROMPTS[0])
    for k, b in enumerate([1, 2]):
        assert torch.equal(first[b], stock_aux[:T0, k * H:(k + 1) * H].float()), f"boundary {b}"
    # every boundary is the hidden state HF calls by that index; next tokens are the target's greedy ones
    refs = _hf_reference(hf, PROMPTS)
    for p, ref in zip(states.prompts, refs):
        T = p["input_ids"].numel()
        for b in range(L + 1):
            torch.testing.assert_close(p["boundaries"][b], ref["hidden"][b][:T].float(), **h.tolerances(dtype),
                                       msg=f"boundary {b}")
        assert torch.equal(p["next_token"], ref["next"][:T])

    # once written, the recorder is inert: later forwards are stock and nothing is rewritten
    mtime = path.stat().st_mtime_ns
    _, aux2, logits2, _, _ = _extend(h, model, cfg, dtype, PROMPTS)
    assert torch.equal(aux2, stock_aux) and torch.equal(logits2, stock_logits)
    assert path.stat().st_mtime_ns == mtime


def test_dump_deepseek_packer_path(sglang_cpu, dump_env):
    """DeepSeek/Kimi layers take ``captured_last_layer_outputs`` accumulators: the dump records through
    the same argument; the configured boundaries are bitwise the packed aux states."""
    h = sglang_cpu
    dtype = torch.float32
    cfg = h.FAMILIES["deepseek_v2"].make_config()
    model = h.sglang_model("deepseek_v2", cfg, dtype, seed=3)
    L = cfg.num_hidden_layers
    path = dump_env(tokens=sum(map(len, PROMPTS)))
    h.configure_capture(model, [1, 2])  # deepseek rule: first id is 1 -> boundaries [2, 3]
    assert list(model.model.layers_to_capture) == [2, 3]
    _, aux, _, _, _ = _extend(h, model, cfg, dtype, PROMPTS)
    wait_all()
    states = read_states(path, num_layers=L, hidden_size=cfg.hidden_size)
    assert states.boundaries == needed_boundaries([2, 3], L)
    H = cfg.hidden_size
    got = torch.cat([p["boundaries"][2] for p in states.prompts])
    assert torch.equal(got, aux[:, :H].float())
    got = torch.cat([p["boundaries"][3] for p in states.prompts])
    assert torch.equal(got, aux[:, H:2 * H].float())


def test_dump_skips_verify_decode_and_cached_prefixes(sglang_cpu, dump_env):
    h = sglang_cpu
    dtype = torch.float32
    cfg = h.FAMILIES["llama"].make_config()
    model = h.sglang_model("llama", cfg, dtype, seed=5)
    path = dump_env(tokens=1000, boundaries="all")
    h.configure_capture(model, [0, 1])
    from eagle3_ops.sglang.dump_states import dump_state

    rec = dump_state(model)
    kv = h.KVCache(cfg, dtype)
    reqs = [h.Req(kv.new_req()) for _ in PROMPTS]
    h.run(model, h.extend_batch(kv, reqs, PROMPTS), kv)
    h.run(model, h.extend_batch(kv, reqs, [[3, 4, 5], [6, 7, 8]], mode="TARGET_VERIFY"), kv)
    h.run(model, h.extend_batch(kv, reqs, [[9, 10], [11, 12]]), kv)   # continuation: cached prefix
    h.run(model, h.decode_batch(kv, reqs, [13, 14]), kv)
    assert [p["input_ids"].tolist() for p in rec.prompts] == PROMPTS
    assert not path.exists()  # budget not full: written at exit
    assert rec.write() == str(path)
    states = read_states(path, num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size)
    assert states.boundaries == list(range(cfg.num_hidden_layers + 1))


@pytest.mark.parametrize("env,needle", [
    ({"EAGLE3_OPS_DUMP_TOKENS": "abc"}, "EAGLE3_OPS_DUMP_TOKENS='abc'"),
    ({"EAGLE3_OPS_DUMP_TOKENS": "0"}, "a whole number of prefill tokens from 1 to 1048576"),
    ({"EAGLE3_OPS_DUMP_BOUNDARIES": "some"}, "EAGLE3_OPS_DUMP_BOUNDARIES='some'"),
])
def test_bad_dump_settings_are_named_and_leave_the_dump_off(sglang_cpu, dump_env, monkeypatch, caplog, env,
                                                           needle):
    h = sglang_cpu
    dump_env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = h.FAMILIES["llama"].make_config()
    model = h.sglang_model("llama", cfg, torch.float32, seed=5)
    with caplog.at_level("ERROR", logger="eagle3_ops.sglang"):
        h.configure_capture(model, [0, 1])
    from eagle3_ops.sglang.dump_states import dump_state

    assert dump_state(model) is None
    assert any(needle in r.getMessage() and "dump is off" in r.getMessage() for r in caplog.records)


def test_replay_on_engine_dump_finds_the_trained_wiring(sglang_cpu, dump_env, tmp_path):
    """The tiny target (trained draft: ids [2, 4, 6] -> boundaries [3, 5, 7]) served by SGLang's llama with the
    ids edited to [1, 3, 5]; the engine-side dump lets replay find the trained wiring."""
    from doctor_fixtures import copy_draft_with_ids, run_doctor
    from eagle3_ops.doctor.tiny import build_tiny_pair
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    pair = build_tiny_pair(tmp_path.parent.parent / "doctor_tiny_pair")
    h = sglang_cpu
    cfg = LlamaConfig.from_pretrained(pair.target_dir)
    weights = load_file(str(pair.target_dir / "model.safetensors"))
    model = h.sglang_model("llama", cfg, torch.float32, weights=weights.items())
    prompts = json.loads(pair.prompts_file.read_text())
    path = dump_env(tokens=sum(map(len, prompts)))
    h.configure_capture(model, [1, 3, 5])  # mis-wired: SGLang captures boundaries [2, 4, 6]
    kv = h.KVCache(cfg, torch.float32, size=sum(map(len, prompts)) + 8, max_reqs=len(prompts) + 1)
    for s in range(0, len(prompts), 16):
        chunk = prompts[s:s + 16]
        reqs = [h.Req(kv.new_req()) for _ in chunk]
        h.run(model, h.extend_batch(kv, reqs, chunk), kv)
    wait_all()
    assert path.is_file()
    draft = copy_draft_with_ids(pair, tmp_path / "miswired", nested=[1, 3, 5])
    rc, rep, err = run_doctor("--draft", draft, "--target", pair.target_dir, "--replay", path)
    assert rc == 1, err
    assert rep["replay"]["configured"]["boundaries"] == [2, 4, 6]
    assert rep["replay"]["best"]["boundaries"] == [3, 5, 7] and rep["replay"]["best"]["ids"] == [2, 4, 6]
    assert any(f["code"] == "E_REPLAY_BETTER_WIRING" for f in rep["findings"])


# ---- settings checked at start-up for what they are used for (eagle3_ops.settings.output_file_problem) -----
def _error_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= 40 and r.name.startswith("eagle3_ops")]


def test_a_dump_path_that_cannot_take_the_file_is_refused_at_start_up(sglang_cpu, dump_env, monkeypatch, caplog,
                                                                     tmp_path):
    """/dev/full (a device: the old dump accepted it and lost the recording at exit, or as root
    replaced the device node), a FIFO, a directory, a folder where no file can be created: one
    ERROR line each at configuration time, the dump off, the path untouched."""
    from eagle3_ops import settings
    from eagle3_ops.sglang.dump_states import dump_state

    h = sglang_cpu
    model = h.sglang_model("llama", h.FAMILIES["llama"].make_config(), torch.float32, seed=5)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    unwritable = "/sys" if os.geteuid() == 0 else str(tmp_path / "ro")  # root writes through mode bits
    if os.geteuid() != 0:
        os.mkdir(unwritable, 0o555)
    for path, needle in (("/dev/full", "/dev/full is a character device, not a regular file (it is never replaced)"),
                         (str(fifo), "is a FIFO"), (str(tmp_path), "is a directory"),
                         (os.path.join(unwritable, "s.safetensors"), "cannot create a file in")):
        monkeypatch.setenv("EAGLE3_OPS_DUMP_STATES", path)
        settings._reported.clear()
        caplog.clear()
        with caplog.at_level("ERROR", logger="eagle3_ops"):
            h.configure_capture(model, [0, 1])
        assert dump_state(model) is None, path
        lines = _error_lines(caplog)
        assert len(lines) == 1 and f"EAGLE3_OPS_DUMP_STATES={path!r} is not usable" in lines[0], lines
        assert needle in lines[0] and lines[0].endswith("the states dump is off (nothing is recorded; serving is "
                                                        "unaffected)"), lines
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_a_recording_too_large_for_memory_or_disk_is_refused_at_start_up(sglang_cpu, dump_env, monkeypatch, caplog):
    from eagle3_ops.sglang import dump_states

    h = sglang_cpu
    cfg = h.FAMILIES["llama"].make_config()
    model = h.sglang_model("llama", cfg, torch.float32, seed=5)
    path = dump_env(tokens=1_000_000, boundaries="all")  # 1e6 x 5 boundaries x 64 x 4 bytes: about 1.2 GiB
    for room, needle in (((2**20, None), "of host memory and 1.0 MiB is available (lower EAGLE3_OPS_DUMP_TOKENS or "
                                         "leave EAGLE3_OPS_DUMP_BOUNDARIES at auto)"),
                         ((None, 2**20), f"of disk and {path.parent} has 1.0 MiB free")):
        monkeypatch.setattr(dump_states, "_available_bytes", lambda folder, room=room: room)
        caplog.clear()
        with caplog.at_level("ERROR", logger="eagle3_ops"):
            h.configure_capture(model, [0, 1])
        assert dump_states.dump_state(model) is None
        lines = _error_lines(caplog)
        assert len(lines) == 1 and "recording up to 1000000 prefill tokens needs up to" in lines[0], lines
        assert needle in lines[0] and lines[0].endswith("the states dump is off"), lines
        assert all(not layer._forward_pre_hooks for layer in model.model.layers)  # nothing left behind


def test_a_symlink_is_written_through_and_stays(sglang_cpu, dump_env, monkeypatch, caplog, tmp_path):
    h = sglang_cpu
    cfg = h.FAMILIES["llama"].make_config()
    model = h.sglang_model("llama", cfg, torch.float32, seed=5)
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "states.safetensors"
    target.write_bytes(b"an older recording")
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    dump_env(tokens=sum(map(len, PROMPTS)))
    monkeypatch.setenv("EAGLE3_OPS_DUMP_STATES", str(link))
    with caplog.at_level("INFO", logger="eagle3_ops.sglang"):
        h.configure_capture(model, [0, 1])
        _extend(h, model, cfg, torch.float32, PROMPTS)
        wait_all()
    assert any(f"(a symlink: the file written is {target})" in r.getMessage() for r in caplog.records)
    assert link.is_symlink() and os.readlink(link) == str(target)
    states = read_states(link, num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size)
    assert [p["input_ids"].tolist() for p in states.prompts] == PROMPTS
    assert sorted(os.listdir(target.parent)) == ["states.safetensors"]  # no temporary left


def test_the_target_is_checked_again_when_written(sglang_cpu, dump_env, monkeypatch, caplog):
    """Between start-up and the write at exit the path became a FIFO: refused, the FIFO untouched;
    a write that fails part-way (a full disk) leaves the old file and no temporary."""
    import safetensors.torch
    from safetensors import SafetensorError

    from eagle3_ops.sglang.dump_states import dump_state

    h = sglang_cpu
    cfg = h.FAMILIES["llama"].make_config()
    path = dump_env(tokens=1000)
    for case in ("fifo", "disk full"):
        model = h.sglang_model("llama", cfg, torch.float32, seed=5)
        h.configure_capture(model, [0, 1])
        rec = dump_state(model)
        _extend(h, model, cfg, torch.float32, PROMPTS)  # under the budget: written at exit
        if case == "fifo":
            os.mkfifo(path)
        else:
            path.write_bytes(b"an older recording")

            def full_disk(tensors, filename, metadata=None):
                open(filename, "wb").write(b"\0" * 64)
                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

            monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
        caplog.clear()
        with caplog.at_level("ERROR", logger="eagle3_ops.sglang"):
            assert rec.write() is None
        (line,) = _error_lines(caplog)
        assert f"could not write {path}" in line
        assert ("is a FIFO, not a regular file (it is never replaced)" if case == "fifo" else
                "No space left on device") in line, line
        if case == "fifo":
            assert stat.S_ISFIFO(os.stat(path).st_mode)
            path.unlink()
        else:
            assert path.read_bytes() == b"an older recording"
        assert sorted(os.listdir(path.parent)) == ([] if case == "fifo" else ["states.safetensors"])


def test_the_demo_finishes_its_stock_half_when_the_plugin_refuses_a_setting(sglang_cpu, monkeypatch, capsys, caplog):
    """`EAGLE3_OPS_SGLANG_MAX_TOKENS=abc python -m eagle3_ops demo`: the message once, then the target
    compared stock against stock (and said so), the draft's fc still patched; no AttributeError."""
    from eagle3_ops.demos.sglang_demo import run_sglang_demo

    monkeypatch.setenv("EAGLE3_OPS_SGLANG_MAX_TOKENS", "abc")
    with caplog.at_level("ERROR", logger="eagle3_ops"):
        rows = run_sglang_demo(hidden_size=64, prompt_len=8, batch=2, draft_tokens=2)
    lines = _error_lines(caplog)
    assert len(lines) == 1 and "EAGLE3_OPS_SGLANG_MAX_TOKENS='abc' is not valid" in lines[0], lines
    assert [r["plugin does"] for r in rows] == ["nothing: left stock (see the log above)"] * 2 + [
        "fc block -> eagle3::draft_fc", "unchanged (no fc)"]
    assert all(r["outputs match"] == "yes" for r in rows)
    assert "capture buffer: none (the plugin left the target stock)" in capsys.readouterr().out


def test_the_dump_takes_the_prefills_it_records_off_the_prefill_graph(sglang_cpu, dump_env):
    """SGLang's default flags keep prefill CUDA graphs on (a replay runs no Python): a prefill the dump
    wants runs eagerly, every other forward is SGLang's decision, and after the file is written all are."""
    from eagle3_ops.sglang import dump_states

    h = sglang_cpu
    cfg = h.FAMILIES["llama"].make_config()
    model = h.sglang_model("llama", cfg, torch.float32, seed=5)
    path = dump_env(tokens=len(PROMPTS[0]))
    h.configure_capture(model, [0, 1])
    rec = dump_states.dump_state(model)
    kv = h.KVCache(cfg, torch.float32)
    reqs = [h.Req(kv.new_req()) for _ in PROMPTS]
    wanted = h.extend_batch(kv, reqs[:1], [PROMPTS[0]])
    verify = h.extend_batch(kv, reqs[1:], [[3, 4, 5]], mode="TARGET_VERIFY")
    graph = lambda self, fb: True  # noqa: E731  (what SGLang's runner would answer)
    assert dump_states.around_can_run_graph(graph, None, wanted) is False
    assert dump_states.around_can_run_graph(graph, None, verify) is True
    h.run(model, wanted, kv)
    rec.wait()
    assert rec.done and path.is_file()
    assert dump_states.around_can_run_graph(graph, None, h.extend_batch(kv, reqs[1:], [PROMPTS[1]])) is True
