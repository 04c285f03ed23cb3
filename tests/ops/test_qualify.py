"""Qualification (eagle3_ops/qualify.py) on the CPU: the same code the plugin runs on a GPU, with the
reference and the Triton interpreter as candidates: every choice is correct, a corrupted candidate
is rejected with its error and never chosen, stock stays where nothing beats it, results are
cached, and ``python -m eagle3_ops qualify --json`` has the documented shape."""
import json

import pytest
import torch

import machine
import spawn
from eagle3_ops import qualify
from machine import needs_sglang

FC = qualify.Shape("draft_fc", hidden=16, captures=3, out_features=24, dtype="bfloat16", chunk_norm=True, bias=True)
NORM = qualify.Shape("fused_add_rmsnorm_capture", hidden=32, captures=3, dtype="bfloat16")


class FakeTimer:
    """Stock calls (the closures named ``run``) take ``stock_us``; candidates take ``cand_us``."""

    def __init__(self, stock_us, cand_us):
        self.stock_us, self.cand_us = stock_us, cand_us

    def __call__(self, fn):
        fn()
        return self.stock_us if fn.__name__ == "run" else self.cand_us


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))


def test_candidates_on_the_cpu_are_the_reference_and_every_triton_path():
    assert qualify.candidates("draft_fc", torch.device("cpu")) == [
        ("triton", "skinny"), ("triton", "tiled"), ("triton", "cublas"), ("reference", None)]
    assert qualify.candidates("fused_add_rmsnorm_capture", torch.device("cpu")) == [("triton", None),
                                                                                  ("reference", None)]


@pytest.mark.parametrize("shape", [FC, NORM], ids=["draft_fc", "fused_norm"])
def test_every_correct_candidate_can_win_and_stock_stays_when_none_beats_it(shape):
    fast = qualify.qualify(shape, buckets=(1, 20), timer=FakeTimer(100.0, 10.0), use_cache=False)
    assert [c.rows for c in fast.choices] == [1, 20] and not fast.rejected
    for c in fast.choices:
        assert c.backend is not None and c.max_rel_err <= 2e-2 and c.median_us == 10.0 and c.stock_us == 100.0
    slow = qualify.qualify(shape, buckets=(1, 20), timer=FakeTimer(100.0, 99.0), use_cache=False)  # < 5% margin
    assert all(c.backend is None for c in slow.choices)
    assert "stock" in slow.table()


def test_a_corrupted_candidate_is_rejected_and_never_chosen():
    def corrupt_triton(backend, run, *args, **kw):
        run(*args, **kw)
        if backend == "triton":
            args[-1][0, 0] += 1.0  # one wrong element

    plan = qualify.qualify(FC, buckets=(4,), timer=FakeTimer(100.0, 10.0), use_cache=False,
                           run_candidate=corrupt_triton)
    rejected = {(r.backend, r.path, r.folded) for r in plan.rejected}
    # FC has a chunk norm: every path also runs on the folded weight, and is rejected there too
    assert rejected == {("triton", p, f) for p in ("skinny", "tiled", "cublas") for f in (False, True)}
    assert all("max rel err" in r.reason for r in plan.rejected)
    assert plan.choices[0].backend == "reference"


def test_folded_candidates_run_on_the_folded_weight_and_can_serve():
    """With only the folded form correct (the unfolded calls are corrupted), the choice is a folded
    one, checked against the UNFOLDED float64 truth; a site without norms has no folded candidate."""
    seen = []

    def corrupt_unfolded(backend, run, *args, norm_folded=False):
        seen.append((backend, norm_folded, args[1].data_ptr()))
        run(*args, norm_folded=norm_folded)
        if not norm_folded:
            args[-1][0, 0] += 1.0

    plan = qualify.qualify(FC, buckets=(4,), timer=FakeTimer(100.0, 10.0), use_cache=False,
                           run_candidate=corrupt_unfolded)
    choice = plan.choices[0]
    assert choice.folded and choice.backend is not None and choice.max_rel_err <= 2e-2
    assert {r.folded for r in plan.rejected} == {False}
    assert len({w for _, folded, w in seen if folded}) == 1  # one folded weight, prepared once
    assert "+folded" in plan.table()
    plain = qualify.Shape("draft_fc", hidden=16, captures=3, out_features=24, dtype="bfloat16")
    seen.clear()
    qualify.qualify(plain, buckets=(4,), timer=FakeTimer(100.0, 10.0), use_cache=False, run_candidate=corrupt_unfolded)
    assert seen and not any(folded for _, folded, _ in seen)


def test_a_crashing_candidate_is_rejected():
    def crash(backend, run, *args):
        if backend == "reference":
            raise RuntimeError("illegal memory access (simulated)")
        run(*args)

    plan = qualify.qualify(NORM, buckets=(4,), timer=FakeTimer(100.0, 10.0), use_cache=False, run_candidate=crash)
    assert [(r.backend, r.reason) for r in plan.rejected] == [
        ("reference", "RuntimeError: illegal memory access (simulated)")]
    assert plan.choices[0].backend == "triton"


@pytest.mark.parametrize("which,name", [(0, "normed output"), (1, "residual")])
def test_target_norm_candidates_must_match_stock_bitwise(which, name):
    """A candidate whose normed output or new residual is off by one ulp (inside the float64 tolerance)
    is rejected: the target's attention, its next layer and the draft read them, and the target's
    tokens are not ours to change, so all three outputs must be stock's bits."""
    def one_ulp_off(backend, run, *args):
        run(*args)
        if backend == "triton":
            args[which].view(torch.int16)[0, 0] += 1  # the next bf16 value

    plan = qualify.qualify(NORM, buckets=(4,), timer=FakeTimer(100.0, 10.0), use_cache=False,
                           run_candidate=one_ulp_off)
    assert [(r.backend, r.reason) for r in plan.rejected] == [
        ("triton", f"{name} not bitwise equal to stock (torch eager add + RMSNorm + slot copy (no sgl_kernel here))")]
    assert plan.choices[0].backend == "reference"


@needs_sglang
def test_target_norm_stock_is_the_sites_own_norm_module():
    """The plugin passes the site's norm module: its own forward is the stock every candidate must match
    bit for bit, with the module's weight and eps (SGLang's RMSNorm, its native path on the CPU)."""
    from sglang.srt.layers.layernorm import RMSNorm

    norm = RMSNorm(NORM.hidden, eps=1e-5).to(NORM.torch_dtype)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * torch.randn(NORM.hidden, generator=torch.Generator().manual_seed(2)))
    plan = qualify.qualify(NORM, buckets=(4,), timer=FakeTimer(100.0, 10.0), use_cache=False, stock_norm=norm)
    assert plan.choices[0].stock.startswith("the site's RMSNorm.forward")
    assert plan.choices[0].backend is not None, plan.table()  # the reference is bitwise SGLang's native norm


def test_results_are_cached_per_device_and_shape():
    first = qualify.qualify(FC, buckets=(2,), reps=1)
    assert not first.cached and qualify.cache_path().is_file()
    again = qualify.qualify(FC, buckets=(2,), reps=1)
    assert again.cached and again.to_json()["choices"] == first.to_json()["choices"]
    other = qualify.qualify(FC, buckets=(3,), reps=1)
    assert not other.cached


def test_plans_cached_under_older_rules_are_measured_again(monkeypatch):
    first = qualify.qualify(FC, buckets=(2,), reps=1)
    assert not first.cached and qualify.qualify(FC, buckets=(2,), reps=1).cached
    monkeypatch.setattr(qualify, "RULES_VERSION", qualify.RULES_VERSION + 1)
    assert not qualify.qualify(FC, buckets=(2,), reps=1).cached


def test_choice_for_rows():
    plan = qualify.qualify(FC, buckets=(4, 64), timer=FakeTimer(100.0, 10.0), use_cache=False)
    assert plan.choice_for(1).rows == 4 and plan.choice_for(5).rows == 64 and plan.choice_for(1000).rows == 64


def test_cli_json_shape(tmp_path):
    r = spawn.run(["qualify", "--hidden", "16", "--captures", "3", "--out-features", "32", "--tp", "2", "--rows", "1,8",
                   "--reps", "1", "--json"], env=dict(spawn.base_env(), XDG_CACHE_HOME=str(tmp_path)),
                  timeout=machine.timeout(600))
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data) == {"device", "choices", "rejected"} and data["device"] == "cpu"
    assert {c["op"] for c in data["choices"]} == {"draft_fc", "fused_add_rmsnorm_capture"}
    for c in data["choices"]:
        assert {"op", "rows", "backend", "path", "max_rel_err", "median_us", "stock_us", "folded"} <= set(c)
    assert [c["rows"] for c in data["choices"] if c["op"] == "draft_fc"] == [1, 8]


@pytest.mark.parametrize("argv,message", [
    (["--hidden", "16", "--captures", "3", "--rows", "0,4"], "error: --rows='0,4'"),
    (["--hidden", "16", "--captures", "3", "--rows", "4,\u00b2"], "error: --rows="),
    (["--hidden", "16", "--captures", "3", "--out-features", "30", "--tp", "4"], "does not split evenly"),
    (["--hidden", "0", "--captures", "3"], "argument --hidden: expected a whole number from 1 to 2147483648, got '0'"),
    (["--hidden", "1" * 30, "--captures", "3"], "argument --hidden: expected a whole number"),
    (["--hidden", "\u00b9\u2076", "--captures", "3"], "argument --hidden: expected a whole number"),
    (["--hidden", "16", "--captures", "3", "--reps", "1e3"], "argument --reps: expected a whole number")])
def test_cli_bad_arguments_exit_2(argv, message, capsys):
    from eagle3_ops.__main__ import main

    assert main(["qualify", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_a_problem_too_large_for_memory_is_one_line_exit_3(capsys):
    """The issue's `qualify --hidden 1000000000`: refused before anything is allocated."""
    from eagle3_ops.__main__ import main

    assert main(["qualify", "--hidden", "1000000000", "--captures", "3"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: qualifying at --hidden 1000000000")
    assert "GiB of cpu memory" in err and "GiB is available" in err
