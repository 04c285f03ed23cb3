"""The live wiring check meets real users' folders and disks (issue 34), on SGLang's own LlamaForCausalLM (CPU)
serving the tiny pair of ``eagle3_ops.doctor.tiny``, plugin defaults. Every case is one line naming the true
cause (the OS error's name, the path) with advice for the live check's own settings (EAGLE3_OPS_WIRING_CHECK,
XDG_CACHE_HOME; never the states dump's EAGLE3_OPS_DUMP_*), no traceback in the log, and served outputs
bitwise the same as stock (the check off).

The cases run before any replay process where the path is reached before it (start-up; a recording that
cannot be written; a draft changed on disk before the replay), so only one test starts the replay: the draft
config edited after start-up, whose verdict must be about the config the server read then.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from doctor_fixtures import copy_draft_with_ids
from hostile_os import assert_no_traceback, disk_full_at_save, file_size_limit, lines, permission_bits_apply

SERVED = [2, 4, 6]  # the tiny draft's trained ids: SGLang feeds boundaries [3, 5, 7]
DUMP_VARS = ("EAGLE3_OPS_DUMP_TOKENS", "EAGLE3_OPS_DUMP_STATES", "EAGLE3_OPS_DUMP_BOUNDARIES")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from eagle3_ops.doctor.tiny import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.getbasetemp() / "doctor_tiny_pair")


@pytest.fixture(scope="module")
def prompts(pair):
    return json.loads(pair.prompts_file.read_text())[:10]  # 320 tokens: past CLOSE_AFTER_TOKENS (256)


def _target(h, pair):
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    cfg = LlamaConfig.from_pretrained(pair.target_dir)
    model = h.sglang_model("llama", cfg, torch.float32,
                           weights=load_file(str(pair.target_dir / "model.safetensors")).items())
    return cfg, model


@pytest.fixture(scope="module")
def stock(sglang_cpu, pair, prompts):
    """What a server without the check serves for ``prompts`` (the plugin on, EAGLE3_OPS_WIRING_CHECK=0)."""
    from eagle3_ops.sglang import wiring_check

    mp = pytest.MonkeyPatch()
    mp.setenv("EAGLE3_OPS_WIRING_CHECK", "0")
    try:
        cfg, model = _target(sglang_cpu, pair)
        sglang_cpu.configure_capture(model, SERVED)
        assert wiring_check.start(model, draft_path=str(pair.draft_dir), target_config=cfg) is None
        return sglang_cpu.serve_prompts(model, cfg, prompts)
    finally:
        mp.undo()


def assert_served_as_stock(outs, stock):
    assert len(outs) == len(stock) > 0
    for (aux, logits), (aux0, logits0) in zip(outs, stock):
        assert torch.equal(aux, aux0) and torch.equal(logits, logits0), "the check changed what was served"


def assert_own_advice(text: str):
    for var in DUMP_VARS:
        assert var not in text, f"advice of another feature ({var}): {text}"


# ------------------------------------------------------------------------------------------ at start-up
def _draft(pair, tmp_path):
    return copy_draft_with_ids(pair, tmp_path / "draft", nested=SERVED)


def _shard(d: Path) -> Path:
    from safetensors.torch import load_file, save_file

    t = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(t)
    wm = {}
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        f = f"model-0000{k + 1}-of-00002.safetensors"
        save_file({n: t[n].contiguous() for n in part}, str(d / f))
        wm.update({n: f for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return d


def _small_disk(free: int):
    """shutil.disk_usage (statvfs) of the cache folder: ``free`` bytes left."""
    real = shutil.disk_usage
    usage = namedtuple("usage", "total used free")

    def disk_usage(path):
        if "cache" in str(path):
            return usage(100 * 2**30, 100 * 2**30 - free, free)
        return real(path)

    return disk_usage


@contextlib.contextmanager
def _nothing():
    yield


def case_small_disk(pair, tmp_path, mp):
    mp.setattr(shutil, "disk_usage", _small_disk(2**20))
    return pair.draft_dir, _nothing()


def case_file_size_limit(pair, tmp_path, mp):
    return pair.draft_dir, file_size_limit(64 * 1024)


def case_cache_behind_a_file(pair, tmp_path, mp):
    (tmp_path / "not-a-folder").write_text("x")
    mp.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-folder" / "cache"))
    return pair.draft_dir, _nothing()


def case_unlistable_draft(pair, tmp_path, mp):
    d = _draft(pair, tmp_path)
    d.chmod(0o311)

    @contextlib.contextmanager
    def denied():
        try:
            with permission_bits_apply():
                with pytest.raises(PermissionError):
                    os.listdir(d)  # the condition is real
                yield
        finally:
            d.chmod(0o755)

    return d, denied()


def case_draft_is_a_dangling_symlink(pair, tmp_path, mp):
    (tmp_path / "draft").symlink_to(tmp_path / "gone")
    return tmp_path / "draft", _nothing()


def case_draft_is_a_symlink_loop(pair, tmp_path, mp):
    (tmp_path / "draft").symlink_to(tmp_path / "draft")
    return tmp_path / "draft", _nothing()


def case_draft_behind_a_file(pair, tmp_path, mp):
    (tmp_path / "file").write_text("x")
    return tmp_path / "file" / "draft", _nothing()


def case_dangling_bin_beside(pair, tmp_path, mp):
    d = _draft(pair, tmp_path)
    (d / "pytorch_model.bin").symlink_to(tmp_path / "gone.bin")
    return d, _nothing()


def case_stale_shard_beside_an_index(pair, tmp_path, mp):
    d = _shard(_draft(pair, tmp_path))
    (d / "model-00003-of-00003.safetensors").write_bytes(b"\xff" * 64)  # an older download's, not named
    (d / "pytorch_model.bin").symlink_to(tmp_path / "gone.bin")
    return d, _nothing()


def case_needed_shard_dangling(pair, tmp_path, mp):
    d = _shard(_draft(pair, tmp_path))
    (d / "model-00002-of-00002.safetensors").unlink()
    (d / "model-00002-of-00002.safetensors").symlink_to(tmp_path / "gone.safetensors")
    return d, _nothing()


def case_a_bug(pair, tmp_path, mp):
    from eagle3_ops.sglang import wiring_startup

    def broken(*a, **k):
        raise TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'")

    mp.setattr(wiring_startup, "cannot_replay", broken)  # a step of the start with no handler of its own
    return pair.draft_dir, _nothing()


# (setup(pair, tmp_path, monkeypatch) -> (draft path, context the start runs in), whether the check starts,
#  phrases of its one line; {d} = the draft path, {t} = tmp_path)
START = {
    "cache disk too small": (case_small_disk, False, [
        "the live check cannot run: recording up to 1024 prefill tokens needs up to",
        "MiB of disk and {t}/cache/eagle3_ops/wiring/LlamaForCausalLM-", "has 1.0 MiB free (free space in",
        "or set XDG_CACHE_HOME to a folder on a disk with room (now XDG_CACHE_HOME={t}/cache)",
        "or EAGLE3_OPS_WIRING_CHECK=0 turns the check off)"]),
    "a file-size limit": (case_file_size_limit, False, [
        "the live check cannot run: recording up to 1024 prefill tokens needs up to",
        "in one file and this process's file-size limit (ulimit -f, RLIMIT_FSIZE) is 0.1 MiB: writing it would fail "
        "with EFBIG (raise the server's file-size limit (ulimit -f), or EAGLE3_OPS_WIRING_CHECK=0"]),
    "a cache folder behind a file": (case_cache_behind_a_file, True, [
        "the live check will replay the draft", "; recording in /",
        "the cache folder {t}/not-a-folder/cache/eagle3_ops/wiring cannot be used: Not a directory (ENOTDIR)",
        "XDG_CACHE_HOME moves it"]),
    "a draft folder that can be entered but not listed": (case_unlistable_draft, False, [
        "the live check cannot run: the doctor could not read the configs and weights: draft: cannot list the folder "
        "{d}: permission denied (EACCES)", "read permission"]),
    "a draft path that is a dangling symlink": (case_draft_is_a_dangling_symlink, False, [
        "cannot run: the draft checkpoint {d} is a dangling symlink (-> {t}/gone): what it points to does not exist "
        "(ENOENT)"]),
    "a draft path that is a symlink loop": (case_draft_is_a_symlink_loop, False, [
        "cannot run: the draft checkpoint {d} cannot be reached: Too many levels of symbolic links (ELOOP)"]),
    "a draft path behind a file": (case_draft_behind_a_file, False, [
        "cannot run: the draft checkpoint {d} cannot be reached: Not a directory (ENOTDIR)"]),
    "a dangling pytorch_model.bin beside model.safetensors": (case_dangling_bin_beside, True, [
        "the live check will replay the draft ({d})",
        "the draft's weights: model.safetensors (every *.safetensors file in the folder: it has no "
        "model.safetensors.index.json); not read: pytorch_model.bin"]),
    "a stale shard beside an index": (case_stale_shard_beside_an_index, True, [
        "the live check will replay the draft ({d})",
        "the draft's weights: model-00001-of-00002.safetensors, model-00002-of-00002.safetensors (the 2 shard(s) "
        "model.safetensors.index.json names)"]),
    "a shard the index names is a dangling symlink": (case_needed_shard_dangling, False, [
        "cannot run: the doctor could not read the configs and weights: draft: {d}/model-00002-of-00002.safetensors "
        "is a dangling symlink (-> {t}/gone.safetensors)"]),
    "a bug of eagle3_ops": (case_a_bug, False, [
        "cannot run: TypeError: unsupported operand type(s) for +: 'int' and 'NoneType' (an internal error of "
        "eagle3_ops: please report it; its traceback is logged at DEBUG level)"]),
}


@pytest.mark.parametrize("case", list(START))
def test_at_start_up_one_line_names_the_cause(sglang_cpu, wc, pair, prompts, stock, tmp_path, monkeypatch, caplog,
                                              case):
    h = sglang_cpu
    setup, starts, phrases = START[case]
    cfg, model = _target(h, pair)
    h.configure_capture(model, SERVED)
    draft, context = setup(pair, tmp_path, monkeypatch)
    with caplog.at_level(logging.DEBUG, logger="eagle3_ops.sglang"):
        with context:
            check = wc.start(model, draft_path=str(draft), target_config=cfg)
    said = lines(caplog, "live wiring check")
    assert len(said) == 1, caplog.text
    for p in phrases:
        assert p.format(d=draft, t=tmp_path) in said[0], (p.format(d=draft, t=tmp_path), said[0])
    assert_own_advice(said[0])
    assert_no_traceback(caplog)
    if case == "a bug of eagle3_ops":  # the traceback is there, at DEBUG level
        assert any(r.exc_info and r.levelno == logging.DEBUG for r in caplog.records)
    assert (check is not None) == starts, caplog.text
    if starts:
        assert check.memory_limit(pair.prompts_file) > 8 * 2**30  # the checkpoint's own files, as read at start-up
        if check.workdir_note:
            shutil.rmtree(check.workdir, ignore_errors=True)
        check.recorder.done = True  # the recording is not what this test is about
        for handle in check.recorder.handles:
            handle.remove()
    assert_served_as_stock(h.serve_prompts(model, cfg, prompts), stock)


# ------------------------------------------------------------------------- the recording cannot be written
def _full_disk(mp):
    written = []
    disk_full_at_save(mp, written)
    return _nothing(), written


def _size_limit(mp):
    return file_size_limit(64 * 1024), None


# (fault while serving, phrases of the one line; {w} = the check's folder)
MID_WAY = {
    "the cache disk fills up": (_full_disk, [
        "could not be checked: could not write {w}/states.safetensors: No space left on device (ENOSPC); "
        "free space in {w}, or set XDG_CACHE_HOME to a folder on a disk with room", "EAGLE3_OPS_WIRING_CHECK=0"]),
    "a file-size limit": (_size_limit, [
        "could not be checked: could not write {w}/states.safetensors: File too large (EFBIG); raise the server's "
        "file-size limit (ulimit -f), or EAGLE3_OPS_WIRING_CHECK=0 turns the check off; serving is unaffected"]),
}


@pytest.mark.parametrize("case", list(MID_WAY))
def test_a_recording_that_cannot_be_written_names_the_write_error(sglang_cpu, wc, pair, prompts, stock, monkeypatch,
                                                                  caplog, case):
    h = sglang_cpu
    fault, phrases = MID_WAY[case]
    cfg, model = _target(h, pair)
    h.configure_capture(model, SERVED)
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        check = wc.start(model, draft_path=str(pair.draft_dir), target_config=cfg)
        assert check is not None, caplog.text
        context, written = fault(monkeypatch)
        with context:
            outs = h.serve_prompts(model, cfg, prompts)
            check.wait()
    assert check.phase == "failed" and check.recorder.done
    said = lines(caplog, "could not be checked")
    assert len(said) == 1, caplog.text
    for p in phrases:
        assert p.format(w=check.workdir) in said[0], (p.format(w=check.workdir), said[0])
    assert "nothing was recorded" not in said[0] and "no prefill qualified" not in said[0]
    assert_own_advice(caplog.text)
    assert_no_traceback(caplog)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "one line, the check's"
    assert json.loads(wc.result_path("LlamaForCausalLM").read_text())["verdict"] == "not checked"
    assert sorted(p.name for p in check.workdir.iterdir()) == ["owner.json"], "no partial file left"
    assert check.thread is None, "no replay started"
    assert_served_as_stock(outs, stock)


# ------------------------------------------------------------------- the draft changed on disk since start-up
def _replace(d):
    f = d / "model.safetensors"
    (d / "new.tmp").write_bytes(f.read_bytes())
    os.replace(d / "new.tmp", f)


def _touch_in_place(d):
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    time.sleep(0.01)
    with open(f, "r+b") as fh:
        fh.write(bytes(data))


def _new_index(d):
    _shard(d)  # model.safetensors gone, two shards and an index in its place


CHANGED = {
    "weights replaced": (_replace, "{d}/model.safetensors was replaced by another file"),
    "weights rewritten in place": (_touch_in_place, "{d}/model.safetensors was modified at"),
    "weights re-sharded": (_new_index, "{d}/model.safetensors is gone"),
}


@pytest.mark.parametrize("case", list(CHANGED))
def test_a_draft_changed_since_start_up_is_said_not_scored(sglang_cpu, wc, pair, prompts, stock, tmp_path, caplog,
                                                           case):
    h = sglang_cpu
    edit, phrase = CHANGED[case]
    d = _draft(pair, tmp_path)
    cfg, model = _target(h, pair)
    h.configure_capture(model, SERVED)
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        check = wc.start(model, draft_path=str(d), target_config=cfg)
        assert check is not None, caplog.text
        edit(d)  # after start-up, before the first prompts
        outs = h.serve_prompts(model, cfg, prompts)
        check.wait()
    assert check.phase == "failed"
    said = lines(caplog, "could not be checked")
    assert len(said) == 1, caplog.text
    assert f"the draft in {d} changed since the server started: {phrase.format(d=d)}" in said[0], said[0]
    assert "restart to check it" in said[0]
    assert_no_traceback(caplog)
    assert check.verdict is None and not (check.workdir / "draft-snapshot.json").exists(), "nothing scored"
    assert (check.workdir / "states.safetensors").is_file(), "the recording is kept for the offline command"
    assert_served_as_stock(outs, stock)


@pytest.mark.parametrize("case", ["changed while read", "another input error", "killed"])
def test_a_draft_changed_while_the_replay_reads_it_is_told_by_the_exit_status_and_the_snapshot(wc, pair, tmp_path,
                                                                                               monkeypatch, caplog,
                                                                                               case):
    """The replay child stops with the doctor's exit status for input it cannot use (2) when the draft changes
    while it reads it; the check then reads its snapshot of the draft again and says what changed (the line of the
    case above), never matching the child's stderr. Another failure, or a draft unchanged, is the child's own last
    line."""
    from eagle3_ops.doctor.configs import draft_snapshot
    from eagle3_ops.sglang import wiring_replay_process

    d = _draft(pair, tmp_path)
    check = wc.WiringCheck("LlamaForCausalLM", d, {}, SERVED, 8, 0, 1)
    check.snapshot = draft_snapshot(d)
    states = tmp_path / "states.safetensors"
    states.write_bytes(b"recorded")

    def run(cmd, **kw):  # the child, as it ends
        if case != "another input error":
            _replace(d)  # the weights replaced while it reads them
        code = -9 if case == "killed" else 2
        return wiring_replay_process.ReplayRun(None, f"the replay stopped (exit {code}): error: its own words", code,
                                               0.1)

    monkeypatch.setattr(wiring_replay_process, "run", run)
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        check._replay(states)
    assert check.phase == "failed"
    (said,) = lines(caplog, "could not be checked")
    if case == "changed while read":
        assert f"the draft in {d} changed since the server started: {d}/model.safetensors was replaced by another " \
               f"file" in said and "restart to check it" in said, said
        assert "its own words" not in said, said
    else:
        assert "error: its own words" in said and "changed since" not in said, said
    assert_no_traceback(caplog)


def test_a_config_edited_after_start_up_is_not_scored_as_the_served_one(sglang_cpu, wc, pair, prompts, stock,
                                                                         tmp_path, caplog):
    """The issue's case: served mis-wired ([1, 3, 5]: SGLang feeds [2, 4, 6]), the config then edited to the trained
    [2, 4, 6] before the first prompts. The replay scores what the server serves (the config read at start-up,
    passed to it as the draft snapshot), so the verdict is the WARNING about [2, 4, 6] served, and the fix says the
    file already holds it: restart. (Reading the edited file, the replay would call [3, 5, 7] served: OK.)"""
    h = sglang_cpu
    d = copy_draft_with_ids(pair, tmp_path / "miswired", nested=[1, 3, 5])
    cfg, model = _target(h, pair)
    h.configure_capture(model, [1, 3, 5])
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        check = wc.start(model, draft_path=str(d), target_config=cfg)
        assert check is not None, caplog.text
        copy_draft_with_ids(pair, tmp_path / "edited", nested=SERVED)
        time.sleep(0.01)
        (d / "config.json").write_text((tmp_path / "edited" / "config.json").read_text())
        outs = h.serve_prompts(model, cfg, prompts)
        check.wait()
    assert check.phase == "done", caplog.text
    v = check.verdict
    assert v["verdict"] == "WARNING" and v["configured"]["boundaries"] == [2, 4, 6], v
    assert v["best"]["boundaries"] == [3, 5, 7] and v["fix"]["ids"] == SERVED
    (warn,) = lines(caplog, "live wiring check: WARNING")
    assert f"To serve it, restart: {d}/config.json was edited to eagle_config.eagle_aux_hidden_state_layer_ids = " \
           f"[2, 4, 6] after the server started (it serves [1, 3, 5], read at start-up)" in warn, warn
    # the line stays short (issue 37): what changed since start-up, in full, is in the JSON result
    assert f"{d}/config.json changed since the server started (it now holds " \
           f"eagle_config.eagle_aux_hidden_state_layer_ids = [2, 4, 6]); this verdict is about the config the server " \
           f"read at start-up (ids [1, 3, 5])" in v["draft_config_changed"], v
    assert "--draft-snapshot" not in v["replay_command"], "the offline command reads the draft as it is then"
    assert json.loads((check.workdir / "draft-snapshot.json").read_text())["config"]["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert_no_traceback(caplog)
    # the served outputs with the check on are those of the same server with it off
    mp = pytest.MonkeyPatch()
    mp.setenv("EAGLE3_OPS_WIRING_CHECK", "0")
    try:
        cfg0, model0 = _target(h, pair)
        h.configure_capture(model0, [1, 3, 5])
        assert_served_as_stock(outs, h.serve_prompts(model0, cfg0, prompts))
    finally:
        mp.undo()


# --------------------------------------------------------------------- two servers sharing one cache folder
def test_two_servers_sharing_one_cache_folder(sglang_cpu, wc, pair, prompts, stock, monkeypatch, caplog):
    """Each server records into its own folder; starting the second prunes old recordings of servers that are
    gone, never the first's (its owner runs, however old the folder); both recordings are whole, both verdicts
    are written whole (here: the time bound, so no replay runs), each naming its own recording."""
    h = sglang_cpu
    monkeypatch.setattr(wc, "TIME_LIMIT_S", 0.01)
    base = wc.result_path().parent / "wiring"
    base.mkdir(parents=True)
    old = time.time() - 10 * 3600
    gone = []
    for k in range(wc.KEEP_RECORDINGS + 1):  # recordings of earlier servers, long gone (a pid that cannot exist)
        d = base / f"LlamaForCausalLM-2000010{k}-000000-old{k}"
        d.mkdir()
        (d / "owner.json").write_text(json.dumps({"pid": 2**22 + 7, "host": os.uname().nodename}))
        os.utime(d, (old + k, old + k))
        gone.append(d)
    servers = []
    with caplog.at_level(logging.INFO, logger="eagle3_ops.sglang"):
        for n in range(2):
            cfg, model = _target(h, pair)
            h.configure_capture(model, SERVED)
            check = wc.start(model, draft_path=str(pair.draft_dir), target_config=cfg)
            assert check is not None, caplog.text
            servers.append((check, model, cfg))
            if n == 0:
                os.utime(check.workdir, (old - 3600, old - 3600))  # the oldest folder of all: its server runs
        assert servers[0][0].workdir != servers[1][0].workdir
        assert servers[0][0].workdir.is_dir(), "the running server's recording folder was pruned"
        # the first start kept the newest KEEP_RECORDINGS - 1 of the gone servers' folders; the second would have
        # pruned the first server's (the oldest now) but for its owner
        assert [d.exists() for d in gone] == [False, False, True, True]
        outs = [h.serve_prompts(model, cfg, prompts) for _, model, cfg in servers]
        for check, _, _ in servers:
            check.wait()
    from eagle3_ops.doctor.states import read_states

    for (check, _, _), out in zip(servers, outs):
        assert check.phase == "failed"
        states = read_states(check.workdir / "states.safetensors", num_layers=8, hidden_size=64)
        assert sum(p["input_ids"].numel() for p in states.prompts) >= wc.CLOSE_AFTER_TOKENS
        assert_served_as_stock(out, stock)
    said = lines(caplog, "could not be checked")
    assert len(said) == 2 and all("the time bound" in s for s in said), caplog.text
    for check, _, _ in servers:  # each line names its own recording
        assert sum(f"--replay {check.workdir}/states.safetensors" in s for s in said) == 1, said
    assert json.loads(wc.result_path("LlamaForCausalLM").read_text())["verdict"] == "not checked"
    assert not [p for p in wc.result_path().parent.iterdir() if p.name.startswith(".")], "no temporary left"
    assert_no_traceback(caplog)


def test_the_errno_names_are_the_systems():
    from eagle3_ops.files import os_error_text, os_error_words

    e = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/x/states.safetensors")
    assert os_error_words(e) == "No space left on device (ENOSPC)"
    assert os_error_text(e) == "ENOSPC (No space left on device) on /x/states.safetensors"


def test_a_bug_at_start_is_one_line_and_the_traceback_only_at_debug(monkeypatch, caplog):
    """plugin._start_wiring_check around a start() that raises (an eagle3_ops bug; start() itself never raises
    for what a machine can do): one ERROR line naming the error, no traceback above DEBUG, serving unaffected."""
    import logging

    from eagle3_ops.sglang import plugin, wiring_check

    def broken(model):
        raise TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'")

    monkeypatch.setattr(wiring_check, "start", broken)
    with caplog.at_level(logging.DEBUG, logger="eagle3_ops"):
        plugin._start_wiring_check(object())
    errors = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(errors) == 1 and errors[0].levelno == logging.ERROR and errors[0].exc_info is None
    assert "TypeError: unsupported operand" in errors[0].getMessage() and "internal error" in errors[0].getMessage()
    assert [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info], "the traceback goes to DEBUG"
