"""The qualification cache (eagle3_ops/qualify_cache.py, qualify._plan_from_cache) under hostile
state: every corrupt file or entry is ignored with ONE warning line and the plan measured again
(never a crash, never another shape's plan); concurrent writers (processes x threads) never lose
or corrupt an entry; an unusable cache location means no caching, with one line."""
from __future__ import annotations

import copy
import functools
import json
import logging
import multiprocessing
import os
import threading
from pathlib import Path

import pytest
import torch

from eagle3_ops import qualify, qualify_cache

CPU = torch.device("cpu")
FC = qualify.Shape("draft_fc", hidden=16, captures=3, out_features=24, dtype="bfloat16", chunk_norm=True, bias=True)
PLAIN = qualify.Shape("draft_fc", hidden=16, captures=3, out_features=24, dtype="bfloat16")
NORM = qualify.Shape("fused_add_rmsnorm_capture", hidden=32, captures=3, dtype="bfloat16")
BUCKETS = [1, 8]


class FakeTimer:
    """Stock (the closures named ``run``) 100 us, candidates 10 us: every correct candidate wins."""

    def __init__(self, *_args, **_kw):
        pass

    def __call__(self, fn):
        fn()
        return 100.0 if fn.__name__ == "run" else 10.0


@pytest.fixture(autouse=True)
def _cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    qualify_cache._noted.clear()
    yield
    qualify_cache._noted.clear()


@pytest.fixture
def fast_qualify(monkeypatch):
    """Real qualification (cached: no timer or run_candidate passed) with the reference as the only
    candidate and scripted timings: a fresh plan in milliseconds instead of the Triton interpreter's seconds."""
    real = qualify.candidates
    monkeypatch.setattr(qualify, "candidates", lambda op, device: [c for c in real(op, device) if c[0] == "reference"])
    monkeypatch.setattr(qualify, "Timer", FakeTimer)


@functools.lru_cache(maxsize=None)
def _plan_json(shape) -> str:
    plan = qualify.qualify(shape, CPU, BUCKETS, timer=FakeTimer(), use_cache=False)
    assert all(c.backend is not None for c in plan.choices)
    return json.dumps(plan.to_json())


def plan_value(shape=FC) -> dict:
    """A plan as qualify makes it (every candidate; scripted timings), made once per shape."""
    return json.loads(_plan_json(shape))


def entry_file() -> dict:
    return json.loads(qualify.cache_path().read_text())


def put(shape, value, made_for=None) -> str:
    """Store ``value`` as the entry for ``shape`` (or under ``made_for``'s key)."""
    made_for = made_for or qualify._plan_made_for(CPU, shape, BUCKETS, qualify.MARGIN)
    assert qualify_cache.store(made_for, value)
    return qualify_cache.key(made_for)


def load(shape=FC):
    return qualify._load_plan(CPU, shape, BUCKETS, qualify.MARGIN)


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "eagle3_ops" and r.levelno == logging.WARNING]


def test_a_valid_entry_round_trips():
    value = plan_value()
    put(FC, value)
    plan = load()
    assert plan is not None and plan.cached and plan.shape == FC
    assert plan.to_json()["choices"] == value["choices"] and plan.to_json()["rejected"] == value["rejected"]


# ---- one table of broken entries: each is ignored with one line, never a crash -------------------------
def _edit(path, new):
    def edit(v):
        obj = v
        for k in path[:-1]:
            obj = obj[k]
        if new is _DELETE:
            del obj[path[-1]]
        else:
            obj[path[-1]] = new
        return v
    return edit


_DELETE = object()


def _served(v):
    return next(i for i, c in enumerate(v["choices"]) if c["backend"] is not None)


BROKEN_VALUES = {
    "not an object": lambda v: [v],
    "a missing field": _edit(["seconds"], _DELETE),
    "an extra field": lambda v: {**v, "extra": 1},
    "choices not a list": _edit(["choices"], {"0": 1}),
    "a choice not an object": _edit(["choices", 0], "reference"),
    "a choice missing a field": _edit(["choices", 0, "stock_us"], _DELETE),
    "rows a string": _edit(["choices", 0, "rows"], "1"),
    "rows a bool": _edit(["choices", 0, "rows"], True),
    "rows a float": _edit(["choices", 0, "rows"], 1.0),
    "stock_us a string": _edit(["choices", 0, "stock_us"], "100"),
    "backend a number": _edit(["choices", 0, "backend"], 5),
    "folded a number": _edit(["choices", 0, "folded"], 1),
    "a huge integer": _edit(["choices", 0, "rows"], 10 ** 40),
    "negative time": _edit(["choices", 0, "stock_us"], -1.0),
    "rows not the buckets": _edit(["choices", 1, "rows"], 9),
    "one bucket missing": lambda v: {**v, "choices": v["choices"][:1]},
    "another op's choice": _edit(["choices", 0, "op"], "fused_add_rmsnorm_capture"),
    "a backend that cannot serve the cpu": lambda v: _edit(["choices", _served(v), "backend"], "cuda")(v),
    "a path the backend does not have": lambda v: _edit(["choices", _served(v)], {
        **v["choices"][_served(v)], "backend": "reference", "path": "skinny"})(v),
    "served with an error above tolerance": lambda v: _edit(["choices", _served(v), "max_rel_err"], 0.5)(v),
    "served without an error": lambda v: _edit(["choices", _served(v), "max_rel_err"], None)(v),
    "served but slower than stock": lambda v: _edit(["choices", _served(v), "median_us"], 99.0)(v),
    "stock with a path": lambda v: _edit(["choices", 0], {**v["choices"][0], "backend": None, "path": "skinny",
                                                          "median_us": None})(v),
    "another device": _edit(["device"], "NVIDIA H100 80GB HBM3"),
    "another shape in the value": _edit(["shape", "hidden"], 4096),
    "a rejection of another op": lambda v: {**v, "rejected": [{"op": "x", "rows": 1, "backend": "triton", "path": None,
                                                               "reason": "r", "folded": False}]},
    "a rejection not an object": lambda v: {**v, "rejected": ["triton"]},
}


@pytest.mark.parametrize("case", list(BROKEN_VALUES))
def test_a_broken_entry_is_ignored_with_one_line(case, caplog):
    key = put(FC, BROKEN_VALUES[case](copy.deepcopy(plan_value())))
    with caplog.at_level(logging.WARNING, logger="eagle3_ops"):
        assert load() is None
        assert load() is None  # asked again (the fc and the norm site read one file): still one line
    lines = warnings_of(caplog)
    assert len(lines) == 1, lines
    assert f"entry {key} (qualify.plan) ignored" in lines[0] and lines[0].endswith("measuring again")
    assert "\n" not in lines[0]


def test_nan_in_an_entry_is_refused(caplog):
    """JSON as Python writes it may hold NaN; a NaN error or time is not a measurement."""
    key = put(FC, plan_value())
    text = qualify.cache_path().read_text()
    data = json.loads(text)
    data[key]["value"]["choices"][0]["stock_us"] = float("nan")
    qualify.cache_path().write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="eagle3_ops"):
        assert load() is None
    assert len(warnings_of(caplog)) == 1


def test_another_shapes_plan_under_this_key_is_never_served(caplog):
    """The issue's case: an entry filed under the right key whose recorded shape is another shape."""
    other = qualify._plan_made_for(CPU, PLAIN, BUCKETS, qualify.MARGIN)
    mine = qualify._plan_made_for(CPU, FC, BUCKETS, qualify.MARGIN)
    put(PLAIN, plan_value(PLAIN), made_for=other)
    data = entry_file()
    data[qualify_cache.key(mine)] = data.pop(qualify_cache.key(other))  # moved under FC's key, made_for and all
    qualify.cache_path().write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="eagle3_ops"):
        assert load(FC) is None
    assert "made for something else" in warnings_of(caplog)[0]
    # the same with made_for rewritten to match: the plan's own shape still gives it away
    data[qualify_cache.key(mine)]["made_for"] = mine
    qualify.cache_path().write_text(json.dumps(data))
    qualify_cache._noted.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eagle3_ops"):
        assert load(FC) is None
    assert "a plan for the shape" in warnings_of(caplog)[0]


@pytest.mark.parametrize("field,value", [("rules_version", qualify.RULES_VERSION - 1), ("margin", 1.5),
                                         ("buckets", [1, 16]), ("device", "cpu|cuda none|torch 0.0|other")])
def test_an_entry_made_for_other_rules_or_versions_is_not_used(field, value):
    mine = qualify._plan_made_for(CPU, FC, BUCKETS, qualify.MARGIN)
    put(FC, plan_value(), made_for={**mine, field: value})
    data = entry_file()
    data[qualify_cache.key(mine)] = data.pop(qualify_cache.key({**mine, field: value}))
    qualify.cache_path().write_text(json.dumps(data))
    assert load() is None


def test_a_plan_qualified_with_other_kernels_is_measured_again(monkeypatch, fast_qualify):
    """The device key carries a digest of the built extension: after a rebuild (new kernels, the
    same version number) the cached plan is not served; the new kernels are measured."""
    monkeypatch.setattr(qualify, "_kernels_fingerprint", lambda: "kernels-before")
    assert not qualify.qualify(NORM, CPU, BUCKETS).cached and qualify.qualify(NORM, CPU, BUCKETS).cached
    monkeypatch.setattr(qualify, "_kernels_fingerprint", lambda: "kernels-after")
    assert "kernels kernels-after|" in qualify._device_key(CPU)
    assert not qualify.qualify(NORM, CPU, BUCKETS).cached


def test_the_kernels_fingerprint_is_a_digest_of_the_built_extension():
    from eagle3_ops import cuda_backend

    ext = cuda_backend.cuda_extension()
    got = qualify._kernels_fingerprint()
    if ext is None:
        assert got == "none"
    else:
        import hashlib

        assert got == hashlib.sha256(Path(ext.__file__).read_bytes()).hexdigest()[:16]


# ---- broken files -------------------------------------------------------------------------------------------
BROKEN_FILES = {
    "not JSON": b"{not json",
    "not UTF-8": b"\xff\xfe\x00garbage",
    "a JSON list": b"[1, 2, 3]",
    "a JSON string": b'"qualify"',
    "JSON null": b"null",
    "nested deeper than the parser goes": b"[" * 200_000 + b"]" * 200_000,
    "an entry that is a list": None,  # filled in below with the real key
}


@pytest.mark.parametrize("case", list(BROKEN_FILES))
def test_a_broken_file_is_ignored_with_one_line_and_replaced(case, caplog, fast_qualify):
    p = qualify.cache_path()
    p.parent.mkdir(parents=True)
    content = BROKEN_FILES[case]
    if content is None:
        content = json.dumps(
            {qualify_cache.key(qualify._plan_made_for(CPU, NORM, BUCKETS, qualify.MARGIN)): [1]}).encode()
    p.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="eagle3_ops"):
        plan = qualify.qualify(NORM, CPU, BUCKETS)
    assert not plan.cached and plan.choices
    lines = warnings_of(caplog)
    assert len(lines) == 1 and "qualification cache" in lines[0], lines
    assert qualify.qualify(NORM, CPU, BUCKETS).cached  # the file was replaced by a good one


def test_a_file_larger_than_any_cache_is_not_read(caplog, fast_qualify):
    p = qualify.cache_path()
    p.parent.mkdir(parents=True)
    with open(p, "wb") as f:  # sparse: no real disk used
        f.truncate(qualify_cache.FILE_LIMIT + 1)
    with caplog.at_level(logging.WARNING, logger="eagle3_ops"):
        assert not qualify.qualify(NORM, CPU, BUCKETS).cached
    assert len(warnings_of(caplog)) == 1 and "more than a cache of plans can" in warnings_of(caplog)[0]


def test_a_broken_entry_is_measured_again_and_replaced(caplog, fast_qualify):
    first = qualify.qualify(NORM, CPU, BUCKETS)
    assert not first.cached and qualify.qualify(NORM, CPU, BUCKETS).cached
    data = entry_file()
    (entry,) = data.values()
    entry["value"]["choices"][0]["rows"] = "1"
    qualify.cache_path().write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="eagle3_ops"):
        again = qualify.qualify(NORM, CPU, BUCKETS)
    assert not again.cached and len(warnings_of(caplog)) == 1
    assert qualify.qualify(NORM, CPU, BUCKETS).cached


# ---- unusable locations: no caching, one line -----------------------------------------------------------------
def _fifo(p):
    p.parent.mkdir(parents=True)
    os.mkfifo(p)


def _directory(p):
    p.mkdir(parents=True)


def _file_as_folder(p):
    p.parent.parent.mkdir(parents=True)
    p.parent.write_text("a file where the folder should be")


@pytest.mark.parametrize("make", [_fifo, _directory, _file_as_folder], ids=["fifo", "directory", "file-as-folder"])
def test_an_unusable_location_means_no_caching_with_one_line(make, caplog, fast_qualify):
    p = qualify.cache_path()
    make(p)
    with caplog.at_level(logging.WARNING, logger="eagle3_ops"):
        for _ in range(2):  # a FIFO must not block; nothing is ever cached
            assert not qualify.qualify(NORM, CPU, BUCKETS).cached
    lines = warnings_of(caplog)
    assert len(lines) == 1, lines
    assert ("is not a regular file; qualifying without a cache" in lines[0] if make is not _file_as_folder else
            "cannot use the qualification cache folder" in lines[0]), lines
    if p.parent.is_dir():
        assert not [f for f in os.listdir(p.parent) if f.endswith(".tmp")]


def test_a_full_disk_means_no_caching_with_one_line(caplog, monkeypatch, fast_qualify):
    import errno

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(qualify_cache.os, "fsync", full)  # the write got as far as the temporary file
    with caplog.at_level(logging.WARNING, logger="eagle3_ops"):
        assert not qualify.qualify(NORM, CPU, BUCKETS).cached
    lines = warnings_of(caplog)
    assert len(lines) == 1 and "No space left on device" in lines[0] and "uncached" in lines[0]
    assert sorted(os.listdir(qualify.cache_path().parent)) == ["qualify.json.lock"]  # no temporary left behind


# ---- concurrent writers -------------------------------------------------------------------------------------
PROCESSES, THREADS, WRITES = 3, 3, 8


def _made_for(p, t, i):
    return {"what": "test.concurrent", "writer": [p, t], "i": i}


def _writer(p: int, errors) -> None:
    def thread(t):
        try:
            for i in range(WRITES):
                assert qualify_cache.store(_made_for(p, t, i), {"p": p, "t": t, "i": i, "pad": "x" * 2000})
                assert qualify_cache.load(_made_for(p, t, i), lambda v: v)["i"] == i
        except BaseException as e:  # reported to the parent
            errors.append(f"{p}/{t}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=thread, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def _process(p: int, queue) -> None:
    errors: list = []
    _writer(p, errors)
    queue.put(errors)


def test_concurrent_processes_and_threads_never_lose_or_corrupt_an_entry(caplog):
    """3 processes x 3 threads, each storing (read-modify-write of one file) and reading back 8
    entries. The old cache (one temporary file per process id, no lock) lost and corrupted entries."""
    ctx = multiprocessing.get_context("fork")  # the children need no fresh interpreter (no torch import)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_process, args=(p, queue)) for p in range(PROCESSES)]
    with caplog.at_level(logging.WARNING, logger="eagle3_ops"):
        for pr in procs:
            pr.start()
        errors = [e for _ in procs for e in queue.get(timeout=600)]
        for pr in procs:
            pr.join(timeout=600)
    assert not errors, errors
    assert [pr.exitcode for pr in procs] == [0] * PROCESSES
    assert not warnings_of(caplog)
    data = entry_file()  # one valid JSON object holding every entry
    assert len(data) == PROCESSES * THREADS * WRITES
    for p in range(PROCESSES):
        for t in range(THREADS):
            for i in range(WRITES):
                assert qualify_cache.load(_made_for(p, t, i), lambda v: v) == {"p": p, "t": t, "i": i,
                                                                               "pad": "x" * 2000}
    assert not [f for f in os.listdir(qualify.cache_path().parent) if f.endswith(".tmp")]


def test_the_cache_keeps_a_bounded_number_of_entries(monkeypatch):
    monkeypatch.setattr(qualify_cache, "MAX_ENTRIES", 4)
    for i in range(6):
        qualify_cache.store({"what": "test.bound", "i": i}, i)
    assert ([qualify_cache.load({"what": "test.bound", "i": i}, lambda v: v) for i in range(6)]
            == [None, None, 2, 3, 4, 5])


# ---- the draft fc sharding decision (draft_fc_hooks), cached through the same functions ---------------------
def _decision(buckets=(1, 4)):
    from eagle3_ops.sglang.fc_sharding import ShardingPlan

    timings = [(100.0, 40.0, 30.0), (100.0, 60.0, 45.0)][:len(buckets)]
    sharded = [(s + g) * qualify.MARGIN < f for f, s, g in timings]
    return ShardingPlan(0, 2, list(buckets), sharded, timings).to_json()


BROKEN_DECISIONS = {
    "not an object": lambda d: [d],
    "another kind": lambda d: {**d, "kind": "qualify.plan"},
    "an extra field": lambda d: {**d, "x": 1},
    "other buckets": lambda d: {**d, "rows": [1, 8]},
    "a verdict not a bool": lambda d: {**d, "sharded": [1, 0]},
    "a timing a string": lambda d: {**d, "timings": [["100", 40.0, 30.0], d["timings"][1]]},
    "a negative timing": lambda d: {**d, "timings": [[100.0, -40.0, 30.0], d["timings"][1]]},
    "two timings": lambda d: {**d, "timings": [[100.0, 40.0], d["timings"][1]]},
    "a verdict its timings contradict": lambda d: {**d, "sharded": [not d["sharded"][0], d["sharded"][1]]},
}


def test_a_sharding_decision_round_trips_and_a_broken_one_is_one_line(caplog):
    from eagle3_ops.sglang.fc_sharding import sharding_from_json

    made_for = qualify.entry_made_for("draft_fc_sharding", "cpu", {"shape": [64, 192], "tp": 2, "buckets": [1, 4]})
    parse = lambda v: sharding_from_json(v, 0, 2, [1, 4])  # noqa: E731
    assert qualify_cache.store(made_for, _decision())
    got = qualify_cache.load(made_for, parse)
    assert got.cached and got.sharded == [True, False] and got.to_json()["timings"] == _decision()["timings"]
    for case, edit in BROKEN_DECISIONS.items():
        qualify_cache.store(made_for, edit(copy.deepcopy(_decision())))
        qualify_cache._noted.clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="eagle3_ops"):
            assert qualify_cache.load(made_for, parse) is None, case
        assert len(warnings_of(caplog)) == 1 and "(draft_fc_sharding) ignored" in warnings_of(caplog)[0], case
