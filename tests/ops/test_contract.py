"""The op contract beyond shapes (docs/design.md §5, eagle3_ops/validation.py), identical on every
backend: aliasing and self-overlapping outputs, forward-only autograd (eager and torch.compile),
int/eps arguments, caller-owned workspace, threads, the backend table, and the CLI on an unusable
EAGLE3_OPS_BACKEND. Each probe is what issue 11 reproduced; each must raise ValueError naming the
argument before anything is written."""
import dataclasses
import sys
import threading

import pytest
import torch

import eagle3_ops
import machine
import spawn
from eagle3_ops import dispatch, ops, registry, validation

CPU_BACKENDS = ["reference", "triton"]  # triton: the interpreter on CPU (tests/conftest.py sets it)


@pytest.fixture(params=CPU_BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", request.param)
    return request.param


def _fc_args(gen, R=9, K=2, H=8, N=16, dtype=torch.float32):
    x = torch.randn(R, K * H, generator=gen, dtype=dtype)
    w = torch.randn(N, K * H, generator=gen, dtype=dtype) / (K * H) ** 0.5
    return x, w


def _unchanged(*tensors):
    return [t.clone() for t in tensors]


# ---- aliasing ---------------------------------------------------------------------------------------
def test_draft_fc_out_overlapping_x_is_refused(backend):
    gen = torch.Generator().manual_seed(0)
    x, w = _fc_args(gen, R=16, N=16)
    before = _unchanged(x)
    for path in ("skinny", "tiled", "cublas"):
        with eagle3_ops.plans.forced_path(path), pytest.raises(ValueError, match="out overlaps x"):
            eagle3_ops.draft_fc_out(x, w, None, None, None, None, 1e-6, x[:, :16])
    assert torch.equal(x, before[0])


def test_expanded_out_is_refused(backend):
    gen = torch.Generator().manual_seed(1)
    x, w = _fc_args(gen)
    out = torch.zeros(1, 16).expand(9, 16)
    with pytest.raises(ValueError, match="out has overlapping elements"):
        eagle3_ops.draft_fc_out(x, w, None, None, None, None, 1e-6, out)


def test_fused_input_inside_the_buffer_slot_is_refused(backend):
    gen = torch.Generator().manual_seed(2)
    T, H, K = 5, 8, 3
    buf = torch.randn(T, K * H, generator=gen)
    residual = torch.randn(T, H, generator=gen)
    weight = torch.rand(H, generator=gen) + 0.5
    before = _unchanged(buf, residual)
    with pytest.raises(ValueError, match="input overlaps buffer|buffer overlaps input"):
        eagle3_ops.fused_add_rmsnorm_capture(buf[:, H:2 * H], residual, weight, 1e-6, buf, 1)
    with pytest.raises(ValueError, match="input and residual are the same tensor"):
        eagle3_ops.fused_add_rmsnorm_capture(residual, residual, weight, 1e-6, buf, 0)
    assert all(torch.equal(a, b) for a, b in zip((buf, residual), before))


def test_capture_from_another_slot_of_the_same_buffer_is_allowed(backend):
    """Two slots of one buffer are disjoint memory (the overlap test works on the matrix, not on
    byte ranges): copying slot 0 into slot 2 is legal and exact."""
    gen = torch.Generator().manual_seed(3)
    buf = torch.randn(6, 3 * 8, generator=gen)
    want = buf[:, :8].clone()
    eagle3_ops.capture(buf[:, :8], None, buf, 2)
    assert torch.equal(buf[:, 16:], want)


def test_overlap_rule():
    m = torch.zeros(10, 12)
    assert not validation.overlaps(m[:, :6], m[:, 6:])          # two column blocks
    assert not validation.overlaps(m[:4], m[4:8])               # adjacent row blocks
    assert validation.overlaps(m[:4], m[2:6])
    assert validation.overlaps(m[:, 2:8], m[:, 6:])
    assert validation.overlaps(m.view(-1)[3:20], m[1:3])        # not a matrix view: byte ranges decide
    assert not validation.overlaps(m, torch.zeros(10, 12))
    # two storages over one buffer (torch.frombuffer): decided by address, not by storage identity
    buf = bytearray(256)
    a = torch.frombuffer(buf, dtype=torch.float32, count=16)
    assert validation.overlaps(a, torch.frombuffer(buf, dtype=torch.float32, count=16, offset=32))
    assert not validation.overlaps(a, torch.frombuffer(buf, dtype=torch.float32, count=16, offset=64))
    x = torch.frombuffer(buf, dtype=torch.float32, count=24).view(4, 6)
    out = torch.frombuffer(buf, dtype=torch.float32, count=8, offset=64).view(4, 2)  # x's last rows
    with pytest.raises(validation.Eagle3ArgumentError, match="out overlaps x"):
        validation.check_draft_fc(x, torch.zeros(2, 6), None, None, None, None, 1e-6, out, op="draft_fc_out")


# ---- autograd: forward-only, the same error everywhere --------------------------------------------
FORWARD_ONLY = "requires grad, but eagle3 ops are forward-only"


def test_inputs_requiring_grad_are_refused(backend):
    gen = torch.Generator().manual_seed(4)
    x, w = _fc_args(gen)
    with pytest.raises(ValueError, match=f"x {FORWARD_ONLY}"):
        eagle3_ops.draft_fc(x.requires_grad_(), w)
    with pytest.raises(ValueError, match=f"weight {FORWARD_ONLY}"):
        eagle3_ops.draft_fc(x.detach(), w.requires_grad_())
    with torch.no_grad():  # no grad mode: nothing to refuse
        assert eagle3_ops.draft_fc(x, w).shape == (9, 16)
    h = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match=f"hidden {FORWARD_ONLY}"):
        eagle3_ops.capture(h, None, torch.zeros(4, 16), 0)


def test_written_tensor_requiring_grad_is_refused(backend):
    gen = torch.Generator().manual_seed(5)
    x, w = _fc_args(gen)
    out = torch.zeros(9, 16, requires_grad=True)
    with torch.no_grad(), pytest.raises(ValueError, match="out requires grad"):
        eagle3_ops.draft_fc_out(x, w, None, None, None, None, 1e-6, out)
    buf = torch.zeros(4, 16, requires_grad=True)
    with torch.no_grad(), pytest.raises(ValueError, match="buffer requires grad"):
        eagle3_ops.capture(torch.randn(4, 8), None, buf, 0)


def test_torch_compile_gives_the_same_error():
    gen = torch.Generator().manual_seed(6)
    x, w = _fc_args(gen)
    fn = torch.compile(lambda a, b: eagle3_ops.draft_fc(a, b), backend="aot_eager")
    with pytest.raises(Exception, match=f"x {FORWARD_ONLY}"):
        fn(x.requires_grad_(), w)
    assert torch.equal(fn(x.detach(), w), eagle3_ops.draft_fc(x.detach(), w))


def test_opcheck_autograd_registration():
    """torch.library.opcheck's checks pass (autograd registration included); with an input that
    requires grad every check reports the forward-only error rather than a missing gradient."""
    gen = torch.Generator().manual_seed(7)
    x, w = _fc_args(gen)
    args = (x, w, None, None, None, None, 1e-6)
    assert set(torch.library.opcheck(torch.ops.eagle3.draft_fc.default, args).values()) == {"SUCCESS"}
    report = torch.library.opcheck(torch.ops.eagle3.draft_fc.default, (x.clone().requires_grad_(),) + args[1:],
                                   raise_exception=False)
    assert report["test_autograd_registration"] == "SUCCESS"
    assert FORWARD_ONLY in str(report["test_faketensor"])


# ---- int and float arguments -----------------------------------------------------------------------
@pytest.mark.parametrize("slot", [1.5, 2 ** 70, True, "1"])
def test_slot_must_be_an_int64(slot):
    with pytest.raises(ValueError, match="slot"):
        eagle3_ops.capture(torch.randn(4, 8), None, torch.zeros(4, 16), slot)
    with pytest.raises(ValueError, match="slot"):
        eagle3_ops.fused_add_rmsnorm_capture(torch.randn(4, 8), torch.randn(4, 8), torch.ones(8), 1e-6,
                                             torch.zeros(4, 16), slot)


@pytest.mark.parametrize("eps", [float("inf"), float("nan"), 0.0, -1e-6])
def test_eps_must_be_finite_and_positive(eps):
    gen = torch.Generator().manual_seed(8)
    x, w = _fc_args(gen)
    with pytest.raises(ValueError, match="eps must be a finite float > 0"):
        eagle3_ops.draft_fc(x, w, eps=eps)
    with pytest.raises(ValueError, match="eps must be a finite float > 0"):
        eagle3_ops.fused_add_rmsnorm_capture(torch.randn(4, 8), torch.randn(4, 8), torch.ones(8), eps,
                                             torch.zeros(4, 16), 0)


def test_capture_buffer_dtype_must_be_an_op_dtype():
    with pytest.raises(ValueError, match="dtype must be one of bfloat16, float16, float32"):
        eagle3_ops.AuxCaptureBuffer(4, 8, 3, dtype=torch.int32)


# ---- workspace: caller-owned or the face's -----------------------------------------------------------
def test_caller_workspace(backend):
    gen = torch.Generator().manual_seed(9)
    x, w = _fc_args(gen, R=40)
    cn = torch.rand(2, 8, generator=gen) + 0.5
    rows = torch.tensor([3, 0, 39, 7])
    need = eagle3_ops.draft_fc_workspace_bytes(x, w, None, rows, cn, None)
    if backend == "reference":
        assert need == 0
    ws = torch.empty(need, dtype=torch.uint8)
    got = eagle3_ops.draft_fc(x, w, None, rows, cn, None, 1e-6, workspace=ws)
    torch.testing.assert_close(got, eagle3_ops.draft_fc(x, w, None, rows, cn, None, 1e-6))
    if need:
        with pytest.raises(ValueError, match=f"workspace has {need - 1} bytes, this call needs {need}"):
            eagle3_ops.draft_fc(x, w, None, rows, cn, None, 1e-6, workspace=ws[:need - 1])
    with pytest.raises(ValueError, match="workspace must be a contiguous 1-D uint8 tensor"):
        eagle3_ops.draft_fc(x, w, workspace=torch.empty(64, dtype=torch.float32))
    with pytest.raises(ValueError, match="workspace overlaps x"):
        eagle3_ops.draft_fc(x, w, workspace=x.view(torch.uint8).view(-1))
    with pytest.raises(ValueError, match="workspace must start on a 16-byte boundary"):
        eagle3_ops.draft_fc(x, w, workspace=torch.empty(need + 64, dtype=torch.uint8)[1:])


# ---- threads ------------------------------------------------------------------------------------------
def test_threads_with_different_m_do_not_share_scratch(monkeypatch):
    """Three threads calling the Triton draft_fc at once with different M (issue 11 saw relative
    errors up to 0.4 from one shared scratch, and a concurrent first use failing verification)."""
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", "triton")
    dispatch.reset_verification()
    gen = torch.Generator().manual_seed(10)
    x, w = _fc_args(gen, R=64, K=2, H=16, N=32)
    cn = torch.rand(2, 16, generator=gen) + 0.5
    from eagle3_ops import reference

    results, errors = {}, []
    barrier = threading.Barrier(3)

    def work(m):
        try:
            rows = torch.arange(m) % 64
            barrier.wait()
            for _ in range(3):
                results[m] = eagle3_ops.draft_fc(x, w, None, rows, cn, None, 1e-6)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(m,)) for m in (3, 17, 40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for m, got in results.items():
        want = reference.draft_fc_ref(x, w, None, torch.arange(m) % 64, cn, None, 1e-6, acc_dtype=torch.float64)
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-5, (m, err)
    assert eagle3_ops.backends(torch.device("cpu"))["draft_fc"] == "triton"


# ---- the backend table ----------------------------------------------------------------------------------
def test_every_backend_implements_every_op():
    for backend in registry.BACKENDS:
        fns = dispatch.resolve(backend)
        for name, spec in registry.OPS.items():
            assert callable(fns[spec.function])
            if spec.planned:
                assert callable(fns[f"{spec.function}_plan"]) and callable(fns[f"{spec.function}_workspace_bytes"])
            assert set(spec.backends) == set(registry.BACKENDS), name
    # every op of the registry is defined with torch and has its impl, fake and autograd kernel
    for name, spec in registry.OPS.items():
        overload = getattr(torch.ops.eagle3, name).default
        assert str(overload._schema).endswith(spec.schema.split("(", 1)[1]), (name, str(overload._schema))
        for key in ("CPU", "CUDA", "Autograd", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), key), (name, key)


def test_a_missing_backend_function_is_an_import_error(monkeypatch):
    import types

    fake = types.ModuleType("eagle3_ops_fake_backend")
    fake.capture = lambda *a: None
    monkeypatch.setitem(sys.modules, "eagle3_ops_fake_backend", fake)
    for name, spec in registry.OPS.items():
        monkeypatch.setitem(registry.OPS, name, dataclasses.replace(
            spec, backends={**spec.backends, "reference": "eagle3_ops_fake_backend"}))
    with pytest.raises(ImportError, match="eagle3_ops_fake_backend.fused_add_rmsnorm_capture"):
        dispatch.resolve("reference")


# ---- the CLI with an unusable EAGLE3_OPS_BACKEND ----------------------------------------------------------
@pytest.mark.parametrize("value,message", [("foo", "EAGLE3_OPS_BACKEND='foo' is not valid"),
                                           ("cuda", "EAGLE3_OPS_BACKEND=cuda cannot serve device cpu")])
@pytest.mark.parametrize("command", ["info", "demo"])
def test_cli_one_line_exit_2(value, message, command):
    if torch.cuda.is_available() and value == "cuda":
        pytest.skip("a GPU machine can serve EAGLE3_OPS_BACKEND=cuda")
    r = spawn.run([command], env=dict(spawn.base_env(), EAGLE3_OPS_BACKEND=value), timeout=machine.timeout(300))
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_switches_are_read_through_settings(monkeypatch):
    monkeypatch.setenv("EAGLE3_OPS_VERIFY", "false")
    assert not dispatch.verification_enabled()
    monkeypatch.setenv("EAGLE3_OPS_VERIFY", "on")
    assert dispatch.verification_enabled()
    monkeypatch.setenv("EAGLE3_OPS_DEBUG", "true")
    assert ops._debug()
