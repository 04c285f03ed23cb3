"""Capture benchmarks: stock SGLang capture paths vs eagle3_ops, bf16, one row per (shape, backend).

* ``capture3_llama``: three captures of ``hidden + residual`` into a [T, 3H] draft input.
  stock = SGLang's list path as issue 3 states it: per capture an add (new tensor) and a clone into
  the list, then ``torch.cat`` of the three (torch eager: that IS SGLang's code for this path);
  ours = three ``eagle3_ops.capture(h, r, buffer, k)``. Bytes that must move: 3 x (read h, r; write
  slot) = 9*T*H*2.
* ``capture3_packer``: three captures of a ready value (``AuxHiddenStatePacker``: copy into the
  slot). stock = ``buffer[:, kH:(k+1)H].copy_(h)``; ours = ``eagle3_ops.capture(h, None, buffer, k)``.
  Bytes: 3 x (read h; write slot) = 6*T*H*2.
* ``fused_add_rmsnorm_capture``: one layer boundary. stock = ``fused_add_rmsnorm`` then a copy of
  the new residual into the slot; ours = ``eagle3_ops.fused_add_rmsnorm_capture``. Bytes: read input,
  residual (+ weight), write input, residual, slot = (5*T*H + H)*2. The stock kernel is SGLang's
  ``sgl_kernel.fused_add_rmsnorm`` or FlashInfer's when it imports AND passes a probe on this device;
  otherwise torch eager with SGLang's ``forward_native`` math. The row's ``stock_impl`` names which
  one ran and ``stock_note`` says why (the device image has no SGLang: there the baseline is torch
  eager, weaker than SGLang's real one-pass kernel, so the speedup over it overstates the gain).

Every capture row's floor is bytes / the COPY bandwidth measured in the same run (the ops read and
write); see conftest for the timing (eager, CUDA-graph replay, host overhead) and the L2 flush.

Inputs come from ``eagle3_ops.testing.capture_problem`` (the op tests' builder; here with unpadded,
aligned rows and a [T, K*H] buffer), and ours is checked against stock (bitwise for the captures,
``testing.rel_err`` for the normed output) before it is timed.

Shapes: H in {4096, 7168, 8192}, T in {1, 16, 64, 256, 2048, 8192} on a GPU
(``EAGLE3_BENCH_SET=quick`` or ``seed``: H in {4096, 7168}, T in {1, 64, 2048, 8192}); on the CPU only
T=1, H=4096 runs (smoke test of this file, reference backend, rows marked smoke).
"""
import functools
import os

import pytest
import torch

import eagle3_ops
import op_testing as testing

SMOKE = not torch.cuda.is_available()
QUICK = os.environ.get("EAGLE3_BENCH_SET", "full") in ("quick", "seed")  # seed: the device check's capture stage
DTYPE = torch.bfloat16
K = 3
EPS = 1e-6
if SMOKE:
    H_VALUES, T_VALUES = (4096,), (1,)
elif QUICK:
    H_VALUES, T_VALUES = (7168, 4096), (1, 64, 2048, 8192)
else:
    H_VALUES, T_VALUES = (7168, 4096, 8192), (1, 16, 64, 256, 2048, 8192)
OURS_BACKENDS = ("reference",) if SMOKE else ("cuda", "triton")
SHAPES = [(T, H) for H in H_VALUES for T in T_VALUES]
ELEM = torch.finfo(DTYPE).bits // 8

TORCH_EAGER_NOTE = ("torch eager: {why}. On the device image (no SGLang) this is the baseline; SGLang's "
                    "real fused_add_rmsnorm is one kernel moving 4*T*H elements, so a speedup over this "
                    "eager baseline overstates the gain over SGLang")


def _shape_id(T, H):
    return f"T={T},H={H}"


def _problems(T, H, device, key, fused=False):
    """K capture problems (the op tests' builder) with contiguous [T, H] inputs; the first one's
    [T, K*H] buffer (aligned rows, no padding) is the one every capture writes."""
    return [testing.capture_problem(T, H, K, DTYPE, device, key=(key, k), slot=k, fused=fused, extra_rows=0,
                                    buffer_pad=0) for k in range(K)]


@pytest.fixture
def ours_backend(request, monkeypatch, bench_device):
    """Force one eagle3_ops backend; a forced backend that cannot serve fails the benchmark."""
    name = request.param
    monkeypatch.setenv("EAGLE3_OPS_BACKEND", name)
    return name


def _native(x, r, w, eps):
    """SGLang ``RMSNorm.forward_native(x, residual)``, op for op (torch eager)."""
    s = x.float() + r.float()
    new_r = s.to(x.dtype)
    out = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)
    return out, new_r


def _probe(run, device) -> None:
    """Raises unless ``run`` (an in-place fused add-RMSNorm) computes SGLang's math on a small
    problem on ``device``: the new residual bitwise, the output within bf16 rounding."""
    gen = testing.generator(device, "stock-probe")
    x = testing.randn((5, 512), DTYPE, device, gen)
    r = testing.randn((5, 512), DTYPE, device, gen)
    w = testing.positive((512,), DTYPE, device, gen)
    want_out, want_r = _native(x, r, w, EPS)
    got_out, got_r = run(x.clone(), r.clone(), w, EPS)
    torch.cuda.synchronize(device)
    if not testing.same_bits(got_r, want_r):
        raise RuntimeError("new residual differs from forward_native")
    err = testing.rel_err(got_out, want_out.double())
    if not err <= 2 * testing.NORM_TOL[DTYPE] + 2.0 ** -8:
        raise RuntimeError(f"normed output differs from forward_native (rel err {err:.3g})")


@functools.lru_cache(maxsize=None)
def stock_fused_add_rmsnorm(device_type: str):
    """(impl, note, fn(x, r, w, eps) -> (out, new_residual)) of the best stock fused add-RMSNorm
    here: sgl_kernel's, then FlashInfer's, each only if it imports and passes :func:`_probe` on this
    device; else torch eager. ``note`` says why the others did not serve."""
    if device_type != "cuda":
        return "torch eager forward_native", "CPU smoke run: the CUDA kernels cannot run here", _native
    device = torch.device("cuda", torch.cuda.current_device())
    why = []
    try:
        from sgl_kernel import fused_add_rmsnorm as sgl_fused

        def run(x, r, w, eps):
            sgl_fused(x, r, w, eps)
            return x, r
        _probe(run, device)
        return "sgl_kernel.fused_add_rmsnorm", "SGLang's own kernel", run
    except Exception as e:
        why.append(f"sgl_kernel: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160])
    try:
        from flashinfer.norm import fused_add_rmsnorm as fi_fused

        def run(x, r, w, eps):
            fi_fused(x, r, w, eps)
            return x, r
        _probe(run, device)
        return "flashinfer.norm.fused_add_rmsnorm", "FlashInfer's kernel (sgl_kernel: %s)" % why[0], run
    except Exception as e:
        why.append(f"flashinfer: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160])
    return "torch eager forward_native", TORCH_EAGER_NOTE.format(why="; ".join(why)), _native


@pytest.mark.parametrize("ours_backend", OURS_BACKENDS, indirect=True)
@pytest.mark.parametrize("T,H", SHAPES, ids=[_shape_id(*s) for s in SHAPES])
def test_capture3_llama(T, H, ours_backend, bench_device, bench_record):
    problems = _problems(T, H, bench_device, "capture3_llama")
    hs, rs = [p.hidden for p in problems], [p.residual for p in problems]
    buffer = problems[0].buffer

    def stock():
        captured = []
        for h, r in zip(hs, rs):
            captured.append((h + r).clone())
        return torch.cat(captured, dim=-1)

    def ours():
        for k in range(K):
            eagle3_ops.capture(hs[k], rs[k], buffer, k)

    ours()
    assert testing.same_bits(buffer, stock()), "ours and stock disagree: not benchmarking the same thing"
    bench_record("capture3_llama", _shape_id(T, H), K * 3 * T * H * ELEM, ours_backend, ours, op="capture",
                 stock_name="add+clone+cat", stock_fn=stock, stock_key=("capture3_llama", T, H),
                 stock_impl="torch eager (SGLang's own code for the llama aux-state list)", dtype="bf16",
                 bw="copy", stock_bytes=K * (3 + 2 + 2) * T * H * ELEM)


@pytest.mark.parametrize("ours_backend", OURS_BACKENDS, indirect=True)
@pytest.mark.parametrize("T,H", SHAPES, ids=[_shape_id(*s) for s in SHAPES])
def test_capture3_packer(T, H, ours_backend, bench_device, bench_record):
    problems = _problems(T, H, bench_device, "capture3_packer")
    hs = [p.hidden for p in problems]
    buffer = problems[0].buffer
    stock_buffer = torch.empty_like(buffer)

    def stock():
        for k, h in enumerate(hs):
            stock_buffer[:, k * H:(k + 1) * H].copy_(h)

    def ours():
        for k in range(K):
            eagle3_ops.capture(hs[k], None, buffer, k)

    stock()
    ours()
    assert testing.same_bits(buffer, stock_buffer), "ours and stock disagree: not benchmarking the same thing"
    bench_record("capture3_packer", _shape_id(T, H), K * 2 * T * H * ELEM, ours_backend, ours, op="capture",
                 stock_name="slot.copy_", stock_fn=stock, stock_key=("capture3_packer", T, H),
                 stock_impl="torch copy_ (SGLang's own code: AuxHiddenStatePacker)", dtype="bf16", bw="copy",
                 stock_bytes=K * 2 * T * H * ELEM)


@pytest.mark.parametrize("ours_backend", OURS_BACKENDS, indirect=True)
@pytest.mark.parametrize("T,H", SHAPES, ids=[_shape_id(*s) for s in SHAPES])
def test_fused_add_rmsnorm_capture(T, H, ours_backend, bench_device, bench_record):
    p = _problems(T, H, bench_device, "fused", fused=True)[1]
    x, r, w, buffer = p.hidden, p.residual, p.weight, p.buffer
    stock_x, stock_r = x.clone(), r.clone()
    stock_buffer = torch.empty_like(buffer)
    stock_impl, stock_note, stock_fused = stock_fused_add_rmsnorm(bench_device.type)

    def stock():
        _, new_r = stock_fused(stock_x, stock_r, w, EPS)
        stock_buffer[:, H:2 * H].copy_(new_r)

    def ours():
        eagle3_ops.fused_add_rmsnorm_capture(x, r, w, EPS, buffer, 1)

    # Same math on the first call (the ops update their inputs in place, so only the first compares).
    stock_out, _ = stock_fused(stock_x.clone(), stock_r.clone(), w, EPS)
    stock()
    ours()
    assert testing.same_bits(buffer[:, H:2 * H], stock_buffer[:, H:2 * H]), "captured residuals differ"
    err = testing.rel_err(x, stock_out.double())
    assert err <= 2 * testing.NORM_TOL[DTYPE], f"normed outputs differ (rel err {err:.3g})"
    bench_record("fused_add_rmsnorm_capture", _shape_id(T, H), (5 * T * H + H) * ELEM, ours_backend, ours,
                 op="fused_add_rmsnorm_capture", stock_name=f"{stock_impl} + slot.copy_", stock_fn=stock,
                 stock_key=("fused_add_rmsnorm_capture", T, H), stock_impl=stock_impl, stock_note=stock_note,
                 dtype="bf16", bw="copy", stock_bytes=(4 * T * H + H + 2 * T * H) * ELEM)
