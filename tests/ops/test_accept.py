"""``eagle3_ops.accept``: the face's fast acceptance is a sufficient condition of the contract.

For every generated call (views carved at random from one shared storage, so overlaps of every
kind occur, and mutations of good calls: dtypes, devices, layouts, grads, scalars), accepted
implies that the full check in ``validation.py`` passes. And the calls SGLang makes are accepted
(else the fast path would be dead code and the host path back at its old cost).
"""
from __future__ import annotations

import random

import pytest
import torch

from eagle3_ops import accept, validation
import op_testing as testing
from machine import needs_sglang

DT = torch.bfloat16
CPU = torch.device("cpu")
_COMPILED = accept.compiled_twins()


class Twin:
    """One implementation of the three acceptance tests: the Python one, or the C++ one of csrc/accept.cpp."""

    def __init__(self, capture, fused, draft_fc):
        self.capture, self.fused, self.draft_fc = capture, fused, draft_fc


@pytest.fixture(params=["python", "c++"])
def twin(request):
    if request.param == "python":
        return Twin(accept.python_capture_accepted, accept.python_fused_add_rmsnorm_capture_accepted,
                    accept.python_draft_fc_accepted)
    if _COMPILED is None:
        pytest.skip("eagle3_ops._C is not built here (no nvcc): the Python twin above is the one the faces use")
    return Twin(*_COMPILED)


def test_the_faces_use_the_compiled_twin_where_it_is_built():
    if _COMPILED is None:
        assert accept.IMPLEMENTATION == "Python" and accept.capture_accepted is accept.python_capture_accepted
    else:
        assert (accept.capture_accepted, accept.fused_add_rmsnorm_capture_accepted,
                accept.draft_fc_accepted) == _COMPILED


def test_a_module_built_from_an_older_accept_cpp_is_not_used(monkeypatch):
    """Twins that do not answer for the modes (before accept_version 2) would let a traced or moded call
    skip the op: such a module's twins are not used (the Python ones serve)."""
    import types

    from eagle3_ops import cuda_backend

    twins = {n: (lambda *a: True) for n in ("accept_capture", "accept_fused_add_rmsnorm_capture", "accept_draft_fc")}
    for version in (None, 1, accept.ACCEPT_VERSION):
        module = types.SimpleNamespace(**twins, **({} if version is None else {"accept_version": version}))
        monkeypatch.setattr(cuda_backend, "cuda_extension", lambda module=module: module)
        found = accept.compiled_twins()
        assert (found is not None) == (version == accept.ACCEPT_VERSION), version


def _full_passes(fn, *args, **kwargs) -> bool:
    try:
        fn(*args, **kwargs)
    except validation.Eagle3ArgumentError:
        return False
    return True


def _capture_full(hidden, residual, buffer, slot):
    validation.check_int("capture", "slot", slot)
    validation.check_capture(hidden, residual, buffer, slot)


def _fused_full(input, residual, weight, eps, buffer, slot):
    validation.check_int("fused_add_rmsnorm_capture", "slot", slot)
    validation.check_eps("fused_add_rmsnorm_capture", eps)
    validation.check_fused_add_rmsnorm_capture(input, residual, weight, eps, buffer, slot)


def _fc_full(x, weight, bias, rows, cnw, inw, eps, out, workspace, norm_folded):
    validation.check_eps("draft_fc_out", eps)
    if isinstance(norm_folded, bool) is False:
        raise validation.Eagle3ArgumentError("norm_folded")
    validation.check_draft_fc(x, weight, bias, rows, cnw, inw, eps, out, op="draft_fc_out", workspace=workspace,
                              norm_folded=norm_folded)


# ---- the calls SGLang makes are accepted --------------------------------------------------------
def test_common_calls_are_accepted(twin):
    gen = testing.generator(CPU, "accept-common")
    T, H, K = 5, 32, 3
    hidden, residual = testing.randn((T, H), DT, CPU, gen), testing.randn((T, H), DT, CPU, gen)
    buffer = torch.zeros(16, K * H, dtype=DT)
    for slot in range(K):
        assert twin.capture(hidden, residual, buffer, slot)
        assert twin.capture(hidden, None, buffer, slot)
        # another slot of the same buffer: the rows interleave in memory, so only the full check (by
        # rows and columns) can tell they are apart; the fast test leaves it to it
        other = buffer[:T, :H]
        assert not twin.capture(other, None, buffer, 1) and _full_passes(_capture_full, other, None,
                                                                                   buffer, 1)
    weight = testing.positive((H,), DT, CPU, gen)
    assert twin.fused(hidden, residual, weight, 1e-6, buffer, 2)
    for bias in (False, True):
        for rows in (None, torch.int32, torch.int64):
            for chunk, inorm, folded in ((False, False, False), (True, False, False), (False, True, False),
                                         (True, True, False), (True, False, True), (True, True, True)):
                R, N = 7, 24
                x = testing.randn((R, K * H), DT, CPU, gen)
                w = testing.randn((N, K * H), DT, CPU, gen)
                args = (x, w, testing.randn((N,), DT, CPU, gen) if bias else None,
                        None if rows is None else torch.tensor([3, 0, 6], dtype=rows),
                        testing.positive((K, H), DT, CPU, gen) if chunk else None,
                        testing.positive((K * H,), DT, CPU, gen) if inorm else None, 1e-5)
                M = R if rows is None else 3
                out = torch.empty(M, N, dtype=DT)
                ws = torch.empty(256, dtype=torch.uint8)
                assert twin.draft_fc(*args, None, None, folded) == M
                assert twin.draft_fc(*args, out, ws, folded) == M
                assert _full_passes(_fc_full, *args, out, ws, folded)


# ---- accepted => the full check passes ----------------------------------------------------------
def _carve(storage: torch.Tensor, rng: random.Random, shape, *, dtype=DT):
    """A view of ``storage`` (a flat tensor) with ``shape``'s rank, at a random offset, with random
    (sometimes overlapping, zero, or transposed) strides; sizes mostly ``shape``, sometimes off by one."""
    sizes = [s if rng.random() < 0.93 else max(0, s + rng.choice((-1, 1))) for s in shape]
    if len(sizes) == 2:
        c = sizes[1]
        good = [(c, 1), (c + rng.randrange(1, 9), 1)]
        odd = [(rng.randrange(0, c + 1), 1), (1, sizes[0]), (0, 1), (c, 2)]
        strides = rng.choice(good if rng.random() < 0.85 else odd)
    else:
        strides = (1,) if rng.random() < 0.9 else (rng.choice((0, 2)),)
    extent = sum((s - 1) * st for s, st in zip(sizes, strides) if s > 0) + 1
    if extent >= storage.numel():
        return torch.zeros(*sizes, dtype=dtype)
    offset = rng.randrange(0, storage.numel() - extent)
    return storage.as_strided(sizes, strides, offset)


def _mutate(t, rng: random.Random):
    """Sometimes another dtype, a meta tensor, one that requires grad, or a Parameter."""
    if t is None:
        return None
    r = rng.random()
    if r < 0.015:
        return t.to(torch.float16 if t.dtype != torch.float16 else torch.float32)
    if r < 0.025:
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    if r < 0.035 and t.dtype.is_floating_point:
        return t.detach().clone().requires_grad_(True)
    if r < 0.04 and t.dtype.is_floating_point:
        return torch.nn.Parameter(t.detach().clone(), requires_grad=False)
    if r < 0.045:
        return t.to(torch.int64)
    if r < 0.05 and t.dtype.is_floating_point:  # a pending negation bit: other values than the memory holds
        return torch._neg_view(t)
    return t


def _scalar(rng, good):
    if rng.random() < 0.9:
        return good
    return rng.choice([True, 1, float("nan"), float("inf"), -1e-6, 0.0, 2 ** 70, 1.5, -1])


@pytest.mark.parametrize("seed", range(4))
def test_capture_accepted_implies_the_contract(seed, twin):
    rng = random.Random(seed)
    storage = torch.randn(16384).to(DT)
    accepted = 0
    for _ in range(1500):
        T, H, K = rng.randrange(1, 6), rng.choice((1, 4, 8)), rng.randrange(1, 4)
        buffer = _mutate(_carve(storage, rng, (T + rng.randrange(0, 3), K * H)), rng)
        hidden = _mutate(_carve(storage, rng, (T, H)), rng)
        residual = None if rng.random() < 0.3 else _mutate(_carve(storage, rng, (T, H)), rng)
        if rng.random() < 0.05:
            residual = hidden
        slot = _scalar(rng, rng.randrange(0, K + 1))
        if twin.capture(hidden, residual, buffer, slot):
            accepted += 1
            assert _full_passes(_capture_full, hidden, residual, buffer, slot), \
                (hidden.shape, hidden.stride(), buffer.shape, buffer.stride(), slot)
    assert accepted > 20, "the generator must reach accepted calls, else this test checks nothing"


@pytest.mark.parametrize("seed", range(4))
def test_fused_accepted_implies_the_contract(seed, twin):
    rng = random.Random(100 + seed)
    storage = torch.randn(16384).to(DT)
    accepted = 0
    for _ in range(1500):
        T, H, K = rng.randrange(1, 6), rng.choice((1, 4, 8)), rng.randrange(1, 4)
        input = _mutate(_carve(storage, rng, (T, H)), rng)
        residual = input if rng.random() < 0.05 else _mutate(_carve(storage, rng, (T, H)), rng)
        weight = _mutate(_carve(storage, rng, (H,)), rng)
        buffer = _mutate(_carve(storage, rng, (T + rng.randrange(0, 3), K * H)), rng)
        eps, slot = _scalar(rng, 1e-6), _scalar(rng, rng.randrange(0, K + 1))
        if twin.fused(input, residual, weight, eps, buffer, slot):
            accepted += 1
            assert _full_passes(_fused_full, input, residual, weight, eps, buffer, slot)
    assert accepted > 20


@pytest.mark.parametrize("seed", range(4))
def test_draft_fc_accepted_implies_the_contract(seed, twin):
    rng = random.Random(200 + seed)
    storage = torch.randn(16384).to(DT)
    istorage = torch.arange(64, dtype=torch.int64)
    wstorage = torch.zeros(4096, dtype=torch.uint8)
    accepted = 0
    for _ in range(1500):
        R, K, H, N = rng.randrange(1, 6), rng.randrange(1, 4), rng.choice((1, 4, 8)), rng.choice((1, 3, 8))
        x = _mutate(_carve(storage, rng, (R, K * H)), rng)
        weight = _mutate(_carve(storage, rng, (N, K * H)), rng)
        bias = None if rng.random() < 0.5 else _mutate(_carve(storage, rng, (N,)), rng)
        rows = None
        if rng.random() < 0.5:
            rows = _carve(istorage, rng, (rng.randrange(1, 4),), dtype=torch.int64) % max(R, 1)
            if rng.random() < 0.1:  # out of range: the face must not take these past the range check
                rows = rows + rng.choice((-R - 1, R, 64))
            rows = rows.to(torch.int32) if rng.random() < 0.3 else rows
            rows = _mutate(rows, rng) if rng.random() < 0.2 else rows
        cnw = None if rng.random() < 0.5 else _mutate(_carve(storage, rng, (K, H)), rng)
        inw = None if rng.random() < 0.6 else _mutate(_carve(storage, rng, (K * H,)), rng)
        M = x.shape[0] if rows is None else rows.shape[0]
        out = None if rng.random() < 0.2 else _mutate(_carve(storage, rng, (M, N)), rng)
        if out is not None and rng.random() < 0.05:
            out = x
        workspace = None
        if rng.random() < 0.6:
            n = rng.randrange(0, 64)
            off = rng.choice((0, 0, 0, 16, 1, 8))
            workspace = wstorage[off:off + n]
            if rng.random() < 0.1:
                workspace = storage.view(torch.uint8)[off:off + n]  # inside the tensors' bytes
        eps = _scalar(rng, 1e-6)
        folded = rng.random() < 0.2
        got = twin.draft_fc(x, weight, bias, rows, cnw, inw, eps, out, workspace, folded)
        if got >= 0:
            accepted += 1
            assert got == M
            assert _full_passes(validation.check_host_rows_in_range, x, rows), "accepted rows out of range"
            if out is not None:
                assert _full_passes(_fc_full, x, weight, bias, rows, cnw, inw, eps, out, workspace, folded)
            else:  # the functional op: the face allocates out
                assert _full_passes(validation.check_draft_fc, x, weight, bias, rows, cnw, inw, eps,
                                    workspace=workspace, norm_folded=folded)
    assert accepted > 20


@needs_sglang
def test_parameters_are_plain_and_wrappers_are_not(twin):
    """SGLang's weights are nn.Parameter (and its BasevLLMParameter family): the fast path takes them.
    A subclass with a __torch_function__ of its own, and functional wrappers (address 0), go the full way."""
    gen = testing.generator(CPU, "accept-params")
    T, H = 3, 16
    x, r = testing.randn((T, H), DT, CPU, gen), testing.randn((T, H), DT, CPU, gen)
    buffer = torch.zeros(T, 2 * H, dtype=DT)
    weight = torch.nn.Parameter(testing.positive((H,), DT, CPU, gen), requires_grad=False)
    assert twin.fused(x, r, weight, 1e-6, buffer, 1)
    from sglang.srt.layers.parameter import ModelWeightParameter

    assert accept.plain_tensor_type(ModelWeightParameter)
    fc_w = ModelWeightParameter(data=testing.randn((8, H), DT, CPU, gen), input_dim=1, output_dim=0,
                                weight_loader=lambda *a: None)
    fc_w.requires_grad_(False)
    assert twin.draft_fc(x, fc_w, None, None, None, None, 1e-6, None, None, False) == T

    class Traced(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    assert not accept.plain_tensor_type(Traced)

    # a plain subclass of nn.Parameter whose instance (or __getattribute__) answers with an override:
    # torch's own check reads the instance, so the fast test must too (found by a review)
    def refuse(*args, **kwargs):
        raise validation.Eagle3ArgumentError("refused by __torch_function__")

    class Sub(torch.nn.Parameter):
        pass

    sub = Sub(x.clone(), requires_grad=False)
    assert twin.capture(sub, None, buffer, 1)
    sub.__torch_function__ = refuse.__get__(sub)
    assert torch.overrides.has_torch_function((sub,))
    assert not twin.capture(sub, None, buffer, 1)

    class Answers(torch.nn.Parameter):
        def __getattribute__(self, name):
            return refuse if name == "__torch_function__" else super().__getattribute__(name)

    assert not twin.capture(Answers(x.clone(), requires_grad=False), None, buffer, 1)
    assert not twin.capture(x.as_subclass(Traced), None, buffer, 1)
    assert not twin.fused(x, r, torch.nn.Parameter(weight.detach()), 1e-6, buffer, 1), \
        "a Parameter that requires grad"

    seen = []

    def functional(h, b):
        seen.append(twin.capture(h, None, b, 1))
        return b.clone()

    torch.func.functionalize(functional)(x, buffer)
    assert seen == [False]


def test_tracing_and_modes_take_the_full_path(twin):
    """Under a Python dispatch mode (FakeTensorMode, a plain TorchDispatchMode), a torch-function mode or
    a torch.func transform, each twin refuses calls it accepts in plain eager mode (the face then takes
    the op, which the mode sees)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    x, r, buffer = torch.randn(3, 8, dtype=DT), torch.randn(3, 8, dtype=DT), torch.zeros(3, 16, dtype=DT)
    weight = torch.ones(8, dtype=DT)
    fc_x, fc_w, fc_out = torch.randn(3, 16, dtype=DT), torch.randn(5, 16, dtype=DT), torch.empty(3, 5, dtype=DT)

    def answers():
        return (twin.capture(x, r, buffer, 1), twin.fused(x, r, weight, 1e-6, buffer, 0),
                twin.draft_fc(fc_x, fc_w, None, None, None, None, 1e-6, fc_out, None, False))

    assert accept.plain_eager()
    assert answers() == (True, True, 3)
    modes = {"FakeTensorMode": FakeTensorMode, "TorchDispatchMode": TorchDispatchMode,
             "TorchFunctionMode": torch.overrides.TorchFunctionMode}
    for name, mode in modes.items():
        with mode():
            assert not accept.plain_eager(), name
            assert answers() == (False, False, -1), name
    seen = []
    torch.func.vmap(lambda a: seen.append(answers()) or a)(torch.ones(2))
    assert seen == [(False, False, -1)]
    assert answers() == (True, True, 3)  # and back once they are gone


# ---- the face: fast path and full path give the same outcome ---------------------------------------
def _outcome(fn):
    """('ok', outputs) or (error type, message) of ``fn()``."""
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - the outcome is what is compared
        return type(e).__name__, str(e)


def _same(a, b):
    if a[0] != b[0]:
        return False
    if a[0] != "ok":
        return a[1] == b[1]
    return all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def test_the_face_gives_what_the_full_path_gives(monkeypatch):
    """Every face call, once with the fast test and once forced through the full checks
    (every acceptance answering "not accepted"): the same outputs bit for bit, or the same error and message.
    Including layouts without strides or storage (sparse, mkldnn), torch.func transforms, grad."""
    import eagle3_ops

    gen = testing.generator(CPU, "accept-face")
    T, H, K = 3, 8, 2

    def fresh():
        return (testing.randn((T, H), DT, CPU, gen), testing.randn((T, H), DT, CPU, gen),
                torch.zeros(T + 1, K * H, dtype=DT), testing.positive((H,), DT, CPU, gen))

    def capture(h, r, b, slot=1):
        eagle3_ops.capture(h, r, b, slot)
        return (b,)

    def fused(x, r, w, b, slot=0):
        eagle3_ops.fused_add_rmsnorm_capture(x, r, w, 1e-6, b, slot)
        return (x, r, b)

    def fc(x, rows=None, ws=None, bias=None):
        w = torch.nn.Parameter(testing.randn((5, x.shape[1]), DT, CPU, gen), requires_grad=False)
        return (eagle3_ops.draft_fc(x, w, bias, rows, None, None, 1e-6, ws),)

    cases = []
    for variant in range(12):
        def make(variant=variant):
            h, r, b, w = fresh()
            x = testing.randn((4, K * H), DT, CPU, gen)
            return {
                0: lambda: capture(h, r, b),
                1: lambda: capture(h, r.to_sparse(), b),
                2: lambda: capture(h, None, b, slot=K),
                3: lambda: fused(h, r, w, b),
                4: lambda: fused(h, h, w, b),
                5: lambda: fc(x),
                6: lambda: fc(x, rows=torch.tensor([0, 7])),                     # host rows out of range
                7: lambda: fc(x, rows=torch.tensor([3, 0]), ws=torch.empty(16, dtype=torch.uint8)),
                8: lambda: fc(x, rows=torch.tensor([0, 9]), ws=torch.empty(16, dtype=torch.uint8)),
                9: lambda: fc(x, bias=testing.randn((5,), DT, CPU, gen).to_sparse()),
                10: lambda: torch.func.jvp(lambda a: capture(a, None, torch.zeros(T, K * H, dtype=DT))[0],
                                           (h,), (torch.ones_like(h),)),
                11: lambda: torch.func.grad(lambda a: capture(a, None, torch.zeros(T, K * H, dtype=DT))[0].sum())(
                    h.float()),
            }[variant]
        cases.append(make)
    for i, make in enumerate(cases):
        torch.manual_seed(i)
        gen.manual_seed(1000 + i)
        fast = _outcome(make())
        gen.manual_seed(1000 + i)
        with monkeypatch.context() as m:
            for name, no in (("capture_accepted", False), ("fused_add_rmsnorm_capture_accepted", False),
                             ("draft_fc_accepted", -1)):
                m.setattr(accept, name, lambda *args, no=no: no)
            full = _outcome(make())
        if fast[0] == "ok" and isinstance(fast[1], tuple) and fast[1] and isinstance(fast[1][0], tuple):
            fast, full = ("ok", fast[1][0]), ("ok", full[1][0])  # jvp: (primal, tangent)
        assert _same(fast, full), (i, fast[0], full[0], fast[1] if fast[0] != "ok" else "",
                                   full[1] if full[0] != "ok" else "")


def test_the_faces_skip_the_full_checks_only_for_accepted_calls(monkeypatch):
    """Accepted calls never reach validation (the fast path exists); a call under a mode, or one the
    acceptance refuses, does."""
    import eagle3_ops

    reached = []
    for name in ("check_capture", "check_fused_add_rmsnorm_capture", "check_draft_fc"):
        real = getattr(validation, name)
        monkeypatch.setattr(validation, name,
                            lambda *a, name=name, real=real, **k: reached.append(name) or real(*a, **k))
    x, r, buffer = torch.randn(3, 8, dtype=DT), torch.randn(3, 8, dtype=DT), torch.zeros(3, 16, dtype=DT)
    fc_x, fc_w, fc_out = torch.randn(3, 16, dtype=DT), torch.randn(5, 16, dtype=DT), torch.empty(2, 5, dtype=DT)
    rows = torch.tensor([2, 0], dtype=torch.int32)

    def calls():
        eagle3_ops.capture(x, r, buffer, 1)
        eagle3_ops.fused_add_rmsnorm_capture(x, r, torch.ones(8, dtype=DT), 1e-6, buffer, 0)
        eagle3_ops.draft_fc_out(fc_x, fc_w, None, rows, None, None, 1e-6, fc_out)
        eagle3_ops.draft_fc(fc_x, fc_w, None, rows)

    class PassThrough(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    calls()
    assert reached == []
    with PassThrough():
        calls()
    assert reached == ["check_capture", "check_fused_add_rmsnorm_capture", "check_draft_fc", "check_draft_fc"]
    reached.clear()
    with pytest.raises(validation.Eagle3ArgumentError):
        eagle3_ops.capture(x, r, buffer, 2)  # slot out of range: refused, then the full check says why
    assert reached == ["check_capture"]
