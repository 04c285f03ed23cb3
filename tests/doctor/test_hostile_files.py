"""Hostile files, round 3 (issue 34), for the doctor and capture-states (no SGLang import: ``--engine-code
table``): every file they read is checked against its own format before use, and a fault is one line (exit 2,
no traceback) naming the file, the tensor or field, and what was expected.

- STATES files (``doctor --replay``): tensor names, prompt index sets, shapes, lengths (next_token against
  input_ids), dtypes, token ids, metadata;
- target configs (``capture-states``): layer counts and sizes, against the checkpoint's own tensors, refused
  before any model is built;
- draft folders: only the files the checkpoint consists of are opened (the index's shards; without an index
  every *.safetensors, as SGLang loads them), so a stale shard or a dangling pytorch_model.bin beside them does
  not matter, and a broken file it needs is named; a folder that can be entered but not listed is a permission
  problem (a real EACCES, also as root: tests/hostile_os.py);
- the draft snapshot the live wiring check takes at start-up (``doctor --draft-snapshot``): a draft changed on
  disk since is named, never scored as the served one; its config is the one read at start-up.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from doctor_fixtures import run_doctor, write_draft, write_target
from eagle3_ops.doctor import cli, configs
from hostile_os import permission_bits_apply

L, H, V, T = 32, 16, 128, 8  # the hand-written pair: target layers, hidden size, vocabulary; tokens per prompt
TABLE = ("--engine-code", "table")  # SGLang's rules from the pinned table: no SGLang import here


def one_line_exit_2(rc, err, *phrases):
    assert rc == 2, (rc, err)
    assert "Traceback" not in err
    assert len([x for x in err.splitlines() if x.strip()]) == 1, err
    for p in phrases:
        assert p in err, (p, err)


def doctor(capsys, *args):
    capsys.readouterr()
    rc = cli.main([str(a) for a in args])
    return rc, capsys.readouterr().err


@pytest.fixture
def pair(tmp_path):
    return write_target(tmp_path / "target", num_layers=L, hidden=H, vocab=V), \
        write_draft(tmp_path / "draft", ids=[1, 15, 28])


# ------------------------------------------------------------------------------------------ STATES files
def good_states(prompts: int = 2) -> dict:
    """Format /2 tensors for the hand-written target: every boundary the replay's candidates name."""
    g = torch.Generator().manual_seed(0)
    t = {}
    for i in range(prompts):
        t[f"prompt.{i}.input_ids"] = torch.randint(0, V, (T,), generator=g)
        t[f"prompt.{i}.next_token"] = torch.randint(0, V, (T,), generator=g)
        for b in range(L + 1):
            t[f"prompt.{i}.boundary.{b}"] = torch.randn(T, H, generator=g)
    return t


def good_meta(prompts: int = 2) -> dict:
    return {"format": "eagle3_ops.doctor.states/2", "num_layers": str(L), "hidden_size": str(H),
            "boundaries": ",".join(map(str, range(L + 1))), "num_prompts": str(prompts)}


def _rename(old, new):
    def edit(t, m):
        t[new] = t.pop(old)
    return edit


def _set(key, value):
    def edit(t, m):
        t[key] = value
    return edit


def _drop(*keys):
    def edit(t, m):
        for k in keys:
            t.pop(k)
    return edit


def _meta(key, value):
    def edit(t, m):
        m[key] = value
    return edit


def _both(*edits):
    def edit(t, m):
        for e in edits:
            e(t, m)
    return edit


# (edit of a good file, phrases the one line holds beside the file's path); each names the tensor or field
MALFORMED_STATES = {
    "next_token shorter than input_ids": (_set("prompt.1.next_token", torch.zeros(T - 1, dtype=torch.long)),
                                          ["tensor prompt.1.next_token has shape [7], expected [8]",
                                           "the target's next token after each of the 8 tokens of prompt.1.input_ids"]),
    "next_token longer": (_set("prompt.0.next_token", torch.zeros(T + 3, dtype=torch.long)),
                          ["tensor prompt.0.next_token has shape [11], expected [8]"]),
    "a prompt index that is not a number": (_rename("prompt.1.input_ids", "prompt.x.input_ids"),
                                            ["tensor 'prompt.x.input_ids': the prompt index 'x' is not a "
                                             "whole number"]),
    "a prompt index in another script's digits": (_rename("prompt.1.input_ids", "prompt.\u0661.input_ids"),
                                                  ["the prompt index '\u0661' is not a whole number"]),
    "a prompt index with a leading zero": (_rename("prompt.1.input_ids", "prompt.01.input_ids"),
                                           ["the prompt index '01' is not a whole number"]),
    "a boundary that is not a number": (_rename("prompt.0.boundary.3", "prompt.0.boundary.three"),
                                        ["tensor 'prompt.0.boundary.three': the boundary 'three' is not a whole number",
                                         "expected prompt.N.boundary.B"]),
    "a negative boundary": (_rename("prompt.0.boundary.3", "prompt.0.boundary.-3"),
                            ["the boundary '-3' is not a whole number"]),
    "a boundary past the last layer": (_set("prompt.0.boundary.40", torch.zeros(T, H)),
                                       ["tensor prompt.0.boundary.40: boundary 40 does not exist (expected 0..32"]),
    "a tensor of another format": (_set("extra", torch.zeros(1)),
                                   ["tensor 'extra' is not a STATES tensor (expected prompt.N.input_ids"]),
    "an unknown field": (_set("prompt.0.logits", torch.zeros(T, V)),
                         ["tensor 'prompt.0.logits' is not a STATES tensor"]),
    "a gap in the prompt indices": (_both(_rename("prompt.1.input_ids", "prompt.2.input_ids"),
                                          _rename("prompt.1.next_token", "prompt.2.next_token"),
                                          *[_rename(f"prompt.1.boundary.{b}", f"prompt.2.boundary.{b}")
                                            for b in range(L + 1)]),
                                    ["the prompt indices are [0, 2], expected 0..1 (missing prompt.1.input_ids)"]),
    "a prompt without input_ids": (_drop("prompt.1.input_ids"), ["prompt 1 has tensors", "but no prompt.1.input_ids"]),
    "hidden states of another width": (_set("prompt.0.boundary.5", torch.zeros(T, H + 1)),
                                       ["tensor prompt.0.boundary.5 has shape [8, 17], expected [8, 16]"]),
    "hidden states of another length": (_set("prompt.1.boundary.0", torch.zeros(T - 2, H)),
                                        ["tensor prompt.1.boundary.0 has shape [6, 16], expected [8, 16]"]),
    "token ids as floats": (_set("prompt.0.input_ids", torch.zeros(T)),
                            ["tensor prompt.0.input_ids has dtype float32, expected integer token ids"]),
    "hidden states as integers": (_set("prompt.0.boundary.2", torch.zeros(T, H, dtype=torch.int32)),
                                  ["tensor prompt.0.boundary.2 has dtype int32, expected floating-point "
                                   "hidden states"]),
    "input_ids of two dimensions": (_set("prompt.0.input_ids", torch.zeros(1, T, dtype=torch.long)),
                                    ["tensor prompt.0.input_ids has shape [1, 8], expected [T] with T >= 1"]),
    "an empty prompt": (_set("prompt.0.input_ids", torch.zeros(0, dtype=torch.long)),
                        ["tensor prompt.0.input_ids has shape [0], expected [T] with T >= 1"]),
    "a negative token id": (_set("prompt.1.input_ids", torch.full((T,), -3, dtype=torch.long)),
                            ["tensor prompt.1.input_ids holds token id -3, expected ids >= 0"]),
    "a token id past the vocabulary": (_set("prompt.0.next_token", torch.full((T,), V + 5, dtype=torch.long)),
                                       [f"tensor prompt.0.next_token holds token id {V + 5}, expected ids below the "
                                        f"target's vocabulary size {V}"]),
    "num_prompts that disagrees": (_meta("num_prompts", "3"),
                                   ["metadata num_prompts=3, but the file holds 2 prompts"]),
    "num_layers that is not a number": (_meta("num_layers", "thirty-two"),
                                        ["metadata num_layers='thirty-two' is not a whole number"]),
    "a listed boundary a prompt lacks": (_drop("prompt.1.boundary.7"),
                                         ["prompt 1 has no prompt.1.boundary.7, which the metadata boundaries="]),
    "listed boundaries that are not boundaries": (_meta("boundaries", "0,1,x"),
                                                  ["metadata boundaries='0,1,x': 'x' is not a boundary 0..32"]),
}


@pytest.mark.parametrize("case", list(MALFORMED_STATES))
def test_a_malformed_states_file_is_named_with_its_tensor(pair, tmp_path, capsys, case):
    t, d = pair
    edit, phrases = MALFORMED_STATES[case]
    tensors, meta = good_states(), good_meta()
    edit(tensors, meta)
    states = tmp_path / "states.safetensors"
    save_file(tensors, str(states), metadata=meta)
    rc, err = doctor(capsys, "--draft", d, "--target", t, "--replay", states, *TABLE, "--replay-draft", "plain")
    one_line_exit_2(rc, err, f"replay: {states}: ", *phrases)


def test_a_huge_prompt_index_is_refused_without_allocating_for_it(pair, tmp_path):
    """Every index in a file is untrusted: a STATES file holding only prompt.999999999999.input_ids once made the
    replay build a set of every index below it (~23 GB before the OS killed it). In a child with a 4 GiB address
    space the doctor now answers in one line (exit 2), naming the missing prompt.0."""
    import resource
    import subprocess
    import sys

    t, d = pair
    states = tmp_path / "states.safetensors"
    save_file({"prompt.999999999999.input_ids": torch.zeros(T, dtype=torch.long)}, str(states),
              metadata=good_meta())

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    proc = subprocess.run([sys.executable, "-m", "eagle3_ops", "doctor", "--draft", str(d), "--target", str(t),
                           "--replay", str(states), *TABLE, "--replay-draft", "plain"], capture_output=True,
                          text=True, preexec_fn=limit, timeout=600)
    one_line_exit_2(proc.returncode, proc.stderr, f"replay: {states}: ", "the prompt indices are [999999999999]",
                    "missing prompt.0.input_ids")


def test_the_good_states_file_of_the_table_is_replayed(pair, tmp_path, capsys):
    """The table's starting point is a valid file: the replay runs on it (so each fault above is the edit's)."""
    t, d = pair
    states = tmp_path / "states.safetensors"
    save_file(good_states(), str(states), metadata=good_meta())
    rc, err = doctor(capsys, "--draft", d, "--target", t, "--replay", states, *TABLE, "--replay-draft", "plain")
    assert rc in (0, 1), err


# ----------------------------------------------------------------------------------- target configs
def write_llama(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("llama") / "m")


# (config edit, phrases of the one line)
ABSURD_TARGETS = {
    "no layers": ({"num_hidden_layers": 0}, ["num_hidden_layers in", "must be a positive integer, found 0"]),
    "-1 layers": ({"num_hidden_layers": -1}, ["num_hidden_layers in", "must be a positive integer, found -1"]),
    "layers as text": ({"num_hidden_layers": "2"}, ["must be a positive integer, found '2'"]),
    "layers as a switch": ({"num_hidden_layers": True}, ["must be a positive integer, found True"]),
    "layers as a fraction": ({"num_hidden_layers": 1.5}, ["must be a positive integer, found 1.5"]),
    "far more layers than the checkpoint": ({"num_hidden_layers": 100_000},
                                            ["num_hidden_layers = 100000 in", "but the checkpoint (model.safetensors) "
                                             "holds layers 0..1 only (2 layers): expected at most 2"]),
    "one layer more": ({"num_hidden_layers": 3}, ["num_hidden_layers = 3 in", "expected at most 2"]),
    "a hidden size the checkpoint is not": ({"hidden_size": 1_000_000},
                                            ["hidden_size = 1000000 in",
                                             "model.embed_tokens.weight (model.safetensors) "
                                             "is [64, 16]: expected 16"]),
    "a vocabulary the checkpoint is not": ({"vocab_size": 10**9}, ["vocab_size = 1000000000 in", "expected 64"]),
    "a negative head count": ({"num_attention_heads": -2}, ["num_attention_heads in", "found -2"]),
}


@pytest.mark.parametrize("case", list(ABSURD_TARGETS))
def test_an_absurd_target_config_is_refused_before_building(llama, tmp_path, capsys, case):
    import shutil

    m = tmp_path / "m"
    shutil.copytree(llama, m)
    cfg = json.loads((m / "config.json").read_text())
    edit, phrases = ABSURD_TARGETS[case]
    cfg.update(edit)
    (m / "config.json").write_text(json.dumps(cfg))
    prompts = tmp_path / "p.json"
    prompts.write_text("[[1, 2, 3, 4]]")
    out = tmp_path / "s.safetensors"
    capsys.readouterr()
    t0 = time.process_time()
    rc = cli.capture_states_main(["--model", str(m), "--prompts", str(prompts), "--out", str(out)])
    err = capsys.readouterr().err
    one_line_exit_2(rc, err, "capture-states: ", str(m / "config.json"), *phrases)
    assert time.process_time() - t0 < 30, "refused before a model was built"
    assert not out.exists()


def test_the_unedited_target_is_captured(llama, tmp_path, capsys):
    prompts = tmp_path / "p.json"
    prompts.write_text("[[1, 2, 3, 4]]")
    rc = cli.capture_states_main(["--model", str(llama), "--prompts", str(prompts), "--out",
                                  str(tmp_path / "s.safetensors")])
    assert rc == 0, capsys.readouterr().err


# ------------------------------------------------------------------------------------- draft folders
def shard(d: Path) -> Path:
    """The draft's model.safetensors as two shards and model.safetensors.index.json (what large drafts ship)."""
    t = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(t)
    parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for f, keys in parts.items():
        save_file({k: t[k].contiguous() for k in keys}, str(d / f))
        weight_map.update({k: f for k in keys})
    (d / configs.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def _garbage(d, name):
    (d / name).write_bytes(b"\xff" * 64)


def _dangling(d, name):
    (d / name).symlink_to(d / "gone" / name)


def _loop(d, name):
    (d / name).symlink_to(d / name)


# (sharded?, setup(draft dir), None = the doctor runs, else phrases of the one exit-2 line); {d} = the draft folder
BESIDE = {
    "a stale shard the index does not name": (True, lambda d: _garbage(d, "model-00003-of-00003.safetensors"), None),
    "a dangling pytorch_model.bin beside the shards": (True, lambda d: _dangling(d, "pytorch_model.bin"), None),
    "a dangling pytorch_model.bin beside model.safetensors": (False, lambda d: _dangling(d, "pytorch_model.bin"), None),
    "a symlink loop named like a stale shard beside an index": (True, lambda d: _loop(d, "old.safetensors"), None),
    "a FIFO beside an index": (True, lambda d: os.mkfifo(d / "stale.safetensors"), None),
    "a dangling *.safetensors without an index (SGLang loads every one)": (
        False, lambda d: _dangling(d, "extra.safetensors"),
        ["draft: {d}/extra.safetensors is a dangling symlink (-> {d}/gone/extra.safetensors): the file it points to "
         "does not exist (ENOENT)"]),
    "a shard the index names is a dangling symlink": (
        True, lambda d: ((d / "model-00002-of-00002.safetensors").unlink(),
                         _dangling(d, "model-00002-of-00002.safetensors")),
        ["{d}/model-00002-of-00002.safetensors is a dangling symlink"]),
    "a shard the index names is a symlink loop": (
        True, lambda d: ((d / "model-00001-of-00002.safetensors").unlink(),
                         _loop(d, "model-00001-of-00002.safetensors")),
        ["cannot read {d}/model-00001-of-00002.safetensors: too many levels of symbolic links (ELOOP)"]),
    "an index naming a file outside the folder": (
        True, lambda d: (d / configs.INDEX_NAME).write_text(
            json.dumps({"weight_map": {"fc.weight": "../x.safetensors"}})),
        ["names files outside its folder: '../x.safetensors'"]),
}


@pytest.mark.parametrize("case", list(BESIDE))
def test_only_the_checkpoints_own_files_are_opened(pair, capsys, case):
    t, d = pair
    sharded, setup, phrases = BESIDE[case]
    if sharded:
        shard(d)
    setup(d)
    rc, err = doctor(capsys, "--draft", d, "--target", t, *TABLE)
    if phrases is None:
        assert rc in (0, 1) and not err.strip(), err
    else:
        one_line_exit_2(rc, err, *[p.format(d=d) for p in phrases])


def test_without_an_index_the_checkpoint_is_said(pair):
    t, d = pair
    _dangling(d, "pytorch_model.bin")
    (d / "training_args.bin").write_bytes(b"x")
    chosen = configs.checkpoint_files(d)
    assert chosen.files == [str(d / "model.safetensors")] and chosen.index is None
    assert chosen.describe() == ("model.safetensors (every *.safetensors file in the folder: it has no "
                                 "model.safetensors.index.json); not read: pytorch_model.bin, training_args.bin")
    shard(d)
    chosen = configs.checkpoint_files(d)
    assert [Path(f).name for f in chosen.files] == ["model-00001-of-00002.safetensors",
                                                   "model-00002-of-00002.safetensors"]
    assert "the 2 shard(s) model.safetensors.index.json names" in chosen.describe()


@pytest.mark.parametrize("index", [False, True], ids=["no index", "index"])
def test_a_folder_that_can_be_entered_but_not_listed(pair, capsys, index):
    """chmod 0311: without an index the checkpoint is every *.safetensors in the folder, so it must be listed:
    a permission problem, said as one (not "no weights"); with an index nothing needs listing."""
    t, d = pair
    if index:
        shard(d)
    d.chmod(0o311)
    try:
        with permission_bits_apply():
            with pytest.raises(PermissionError):
                os.listdir(d)  # the condition is real
            rc, err = doctor(capsys, "--draft", d, "--target", t, *TABLE)
    finally:
        d.chmod(0o755)
    if index:
        assert rc in (0, 1) and not err.strip(), err
    else:
        one_line_exit_2(rc, err, f"draft: cannot list the folder {d}: permission denied (EACCES)",
                        "read permission")
        assert "no weights" not in err


def test_a_folder_that_cannot_be_entered(pair, capsys):
    t, d = pair
    d.chmod(0o600)
    try:
        with permission_bits_apply():
            rc, err = doctor(capsys, "--draft", d, "--target", t, *TABLE)
    finally:
        d.chmod(0o755)
    one_line_exit_2(rc, err, f"draft: cannot read {d}/config.json: permission denied (EACCES)")
    assert "no config.json" not in err


# ------------------------------------------------------------------------------------- draft snapshots
def _rewrite_same_size(d):
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    time.sleep(0.01)
    with open(f, "r+b") as fh:  # in place: the same inode and size, a new mtime
        fh.write(bytes(data))


def _replace(d):
    f = d / "model.safetensors"
    tmp = d / "new.tmp"
    tmp.write_bytes(f.read_bytes())
    os.replace(tmp, f)  # another file under the same name (what a re-download or `cp` then `mv` does)


def _truncate(d):
    with open(d / "model.safetensors", "r+b") as fh:
        fh.truncate(100)


def _repoint(d):
    """model.safetensors is a symlink into a blob store beside the folder (as in the Hugging Face cache); a new
    download points it at another blob."""
    blobs = d.parent / "blobs"
    other = blobs / "bbb"
    other.write_bytes((blobs / "aaa").read_bytes())
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to(other)


# (edit after the snapshot, phrase naming the change of model.safetensors)
EDITS = {
    "rewritten in place": (_rewrite_same_size, "model.safetensors was modified at"),
    "replaced by another file": (_replace, "model.safetensors was replaced by another file"),
    "truncated": (_truncate, "model.safetensors changed size ("),
    "deleted": (lambda d: (d / "model.safetensors").unlink(), "model.safetensors is gone"),
    "a symlink to another file now": (_repoint, "model.safetensors now leads to"),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_a_draft_changed_since_the_snapshot_is_named_never_scored(pair, tmp_path, capsys, case):
    t, d = pair
    if case == "a symlink to another file now":  # a symlink into a blob store at start-up too
        (d.parent / "blobs").mkdir()
        os.replace(d / "model.safetensors", d.parent / "blobs" / "aaa")
        (d / "model.safetensors").symlink_to(d.parent / "blobs" / "aaa")
    snap = configs.draft_snapshot(d)
    snap_file = tmp_path / "draft-snapshot.json"
    snap_file.write_text(json.dumps(snap))
    rc, err = doctor(capsys, "--draft", d, "--target", t, "--draft-snapshot", snap_file, *TABLE)
    assert rc in (0, 1), err  # unchanged: it runs
    edit, phrase = EDITS[case]
    edit(d)
    changes = configs.snapshot_changes(snap, roles=("weights",))
    assert len(changes) == 1 and phrase in changes[0], changes
    rc, err = doctor(capsys, "--draft", d, "--target", t, "--draft-snapshot", snap_file, *TABLE)
    one_line_exit_2(rc, err, f"the draft in {d} changed since the server started: {d}/", phrase, "restart to check it")


def test_the_snapshots_config_is_the_one_read_at_start_up(pair, tmp_path):
    """The config edited after the snapshot: the doctor reads the snapshot's (what the server serves), and the
    change is known (a verdict says it); the same content written again is no change."""
    t, d = pair
    snap = configs.draft_snapshot(d)
    snap_file = tmp_path / "draft-snapshot.json"
    snap_file.write_text(json.dumps(snap))
    text = (d / "config.json").read_text()
    cfg = json.loads(text)
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 16, 29]
    (d / "config.json").write_text(json.dumps(cfg))
    assert configs.snapshot_changes(snap, roles=("weights", "index")) == []
    (change,) = configs.snapshot_changes(snap, roles=("config",))
    assert f"{d}/config.json was modified at" in change
    _, rep, err = run_doctor("--draft", d, "--target", t, "--draft-snapshot", snap_file, *TABLE)
    assert rep["engine"]["ids"] == [1, 15, 28], err  # the config as read at start-up
    _, rep, _ = run_doctor("--draft", d, "--target", t, *TABLE)
    assert rep["engine"]["ids"] == [2, 16, 29]  # without the snapshot: the file as it is now
    time.sleep(0.01)
    (d / "config.json").write_text(text)  # back to what it was: the same content
    assert configs.snapshot_changes(snap) == []


@pytest.mark.parametrize("bad", [{"format": "x"}, {"format": configs.SNAPSHOT_FORMAT}, [1, 2], "not json"])
def test_a_snapshot_file_is_checked_against_its_format(pair, tmp_path, capsys, bad):
    t, d = pair
    f = tmp_path / "snap.json"
    f.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    rc, err = doctor(capsys, "--draft", d, "--target", t, "--draft-snapshot", f, *TABLE)
    one_line_exit_2(rc, err, f"draft-snapshot: {f}")
