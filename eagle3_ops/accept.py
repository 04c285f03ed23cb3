"""Fast acceptance: the eager face's common case decided in about a microsecond. Derived from the contract
in ``validation.py`` and held equal to it by ``tests/ops/test_accept.py``.

Each ``*_accepted`` function here is a *sufficient* condition of the op's contract in
``validation.py`` in plain eager mode (:func:`plain_eager`): when it returns True (or M >= 0 for
draft_fc), no tracing or mode is active and the full check would pass with the same arguments, so
the face may skip it and run the backend itself. When it returns False / -1, nothing is decided: the
face runs the full check, which raises with its message or passes (the fast test is conservative:
empty inputs, zero-stride or unusual layouts, a subclass that overrides torch's dispatch (nn.Parameter
and its plain subclasses are accepted), meta, fake, functional, sparse or mkldnn tensors, torch.func
transforms, a tensor that requires grad, overlap it cannot rule out by address ranges alone, all go the full way).

Why it is cheap: the full check compares storages (``untyped_storage()`` allocates a Python
object per tensor) and builds dicts of names for its messages; here two views are independent
when their byte ranges ``[data_ptr, data_ptr + extent)`` are disjoint, which needs only
``data_ptr()`` and the strides, and no message is built until something fails.

``tests/ops/test_accept.py`` holds the invariant (accepted => the full check passes) over
generated arguments, good and bad, and that the common SGLang calls are accepted, for this Python
twin and for the C++ one (``csrc/accept.cpp``), which serves the faces where the extension is built
(:data:`IMPLEMENTATION`).
"""
from __future__ import annotations

import math

import torch

from .validation import ROW_INDEX_DTYPES, SUPPORTED_DTYPES

_Tensor = torch.Tensor
_INF = math.inf
# Tensor types that behave as torch.Tensor in eager: nn.Parameter (SGLang's weights, also its
# BasevLLMParameter family) and any subclass that overrides neither __torch_function__ nor
# __torch_dispatch__ (checked per call by plain_tensor_type). FakeTensor, FunctionalTensor and other
# wrappers are not.
_PLAIN_TYPES = {torch.Tensor, torch.nn.Parameter}
_WORKSPACE_DTYPES = (torch.uint8,)


def plain_eager() -> bool:
    """No torch.compile trace, Python dispatch mode, torch-function mode or torch.func transform is
    active (fake tensors, functionalization, vmap/grad/jvp wrappers, ...): the face may run the
    implementation itself."""
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
                or torch._C._is_torch_function_mode_enabled() or torch._C._are_functorch_transforms_active())


def plain_tensor_type(tp) -> bool:
    """Whether tensors of type ``tp`` behave as torch.Tensor in eager (see :data:`_PLAIN_TYPES`).
    Subclasses are looked at on every call (three attribute reads), so a ``__torch_function__``
    assigned to a class later is seen."""
    if tp in _PLAIN_TYPES:
        return True
    return (isinstance(tp, type) and issubclass(tp, torch.nn.Parameter)
            and tp.__torch_function__ is torch.nn.Parameter.__torch_function__
            and tp.__torch_dispatch__ is torch.Tensor.__torch_dispatch__)


def _plain_instance(t) -> bool:
    """A tensor of a :func:`plain_tensor_type` subclass whose ``__torch_function__`` / ``__torch_dispatch__``,
    read from the instance as torch's override check reads them, are still nn.Parameter's and torch.Tensor's
    (an attribute set on the instance, or a ``__getattribute__`` that answers for it, is an override)."""
    if not plain_tensor_type(type(t)):
        return False
    try:
        return (t.__torch_function__ is torch.nn.Parameter.__torch_function__
                and t.__torch_dispatch__ is torch.Tensor.__torch_dispatch__)
    except Exception:  # noqa: BLE001 - an attribute that raises: not plain
        return False


def _matrix(t, dtype, device):
    """(rows, cols, row stride, address) of a plain, non-empty 2-D view with a unit last stride on
    ``device`` in ``dtype`` that does not require grad; None otherwise."""
    if type(t) not in _PLAIN_TYPES and not _plain_instance(t) or t.dtype is not dtype or t.requires_grad \
            or t.device != device or t.is_neg():  # a pending negation: the memory holds other values
        return None
    try:
        r, c = t.shape
        s0, s1 = t.stride()
        p = t.data_ptr()
    except (ValueError, RuntimeError):  # not 2-D; sparse, mkldnn or another layout without strides or storage
        return None
    if r == 0 or c == 0 or s1 != 1 or p == 0:  # address 0: a functional wrapper (no storage of its own)
        return None
    return r, c, s0, p


def _flat(t, dtypes, device):
    """(elements, address) of a plain, non-empty 1-D view with unit stride on ``device``, its dtype one of
    ``dtypes``, not requiring grad; None otherwise."""
    if type(t) not in _PLAIN_TYPES and not _plain_instance(t) or t.dtype not in dtypes or t.requires_grad \
            or t.device != device or t.is_neg():
        return None
    try:
        (size,), (stride,) = t.shape, t.stride()
        p = t.data_ptr()
    except (ValueError, RuntimeError):  # not 1-D; a layout without strides or storage
        return None
    return (size, p) if size > 0 and stride == 1 and p != 0 else None


def _vector(t, dtype, device, n):
    """The address of a :func:`_flat` view of exactly ``n`` elements of ``dtype``; None otherwise."""
    f = _flat(t, (dtype,), device)
    return f[1] if f is not None and f[0] == n else None


def _served(t) -> bool:
    """A plain CPU or CUDA tensor of a dtype the ops serve."""
    return (type(t) in _PLAIN_TYPES or _plain_instance(t)) and t.dtype in SUPPORTED_DTYPES and (t.is_cuda or t.is_cpu)


def _disjoint(lo, hi, spans) -> bool:
    for a, b in spans:
        if a < hi and lo < b:
            return False
    return True


def _apart(writes, reads) -> bool:
    """Every written byte range disjoint from every read range and from the other written ones."""
    for i, (lo, hi) in enumerate(writes):
        if not _disjoint(lo, hi, reads) or not _disjoint(lo, hi, writes[i + 1:]):
            return False
    return True


def _host_rows_in_range(rows, M, R) -> bool:
    """Host-side row indices all in [0, R) (the range check the face would otherwise run after)."""
    if M <= 256:
        values = rows.tolist()
        return min(values) >= 0 and max(values) < R
    lo, hi = (int(v) for v in torch.aminmax(rows))
    return lo >= 0 and hi < R


def capture_accepted(hidden, residual, buffer, slot) -> bool:
    if not plain_eager() or type(slot) is not int or not _served(hidden):
        return False
    dtype, device = hidden.dtype, hidden.device
    m, b = _matrix(hidden, dtype, device), _matrix(buffer, dtype, device)
    if m is None or b is None:
        return False
    T, H, hs, h0 = m
    R, W, bs, b0 = b
    if W % H or not 0 <= slot < W // H or R < T or (T > 1 and bs < W):
        return False
    es = hidden.element_size()
    lo = b0 + slot * H * es
    hi = lo + ((T - 1) * bs + H) * es
    if lo < h0 + ((T - 1) * hs + H) * es and h0 < hi:
        return False
    if residual is None:
        return True
    r = _matrix(residual, dtype, device)
    if r is None or r[0] != T or r[1] != H:
        return False
    r0 = r[3]
    return not (lo < r0 + ((T - 1) * r[2] + H) * es and r0 < hi)


def fused_add_rmsnorm_capture_accepted(input, residual, weight, eps, buffer, slot) -> bool:
    if not plain_eager() or type(slot) is not int or type(eps) is not float or not 0.0 < eps < _INF \
            or not _served(input):
        return False
    dtype, device = input.dtype, input.device
    m, r, b = _matrix(input, dtype, device), _matrix(residual, dtype, device), _matrix(buffer, dtype, device)
    if m is None or r is None or b is None:
        return False
    T, H, xs, x0 = m
    R, W, bs, b0 = b
    w0 = _vector(weight, dtype, device, H)
    if w0 is None or r[0] != T or r[1] != H or W % H or not 0 <= slot < W // H or R < T:
        return False
    if T > 1 and (xs < H or r[2] < H or bs < W):  # a written view must not overlap itself
        return False
    es = input.element_size()
    r0, s0 = r[3], b0 + slot * H * es
    x1, r1, s1, w1 = x0 + ((T - 1) * xs + H) * es, r0 + ((T - 1) * r[2] + H) * es, s0 + ((T - 1) * bs + H) * es, \
        w0 + H * es
    # input, residual and the buffer slot are written: apart from each other and from weight
    return not (x0 < r1 and r0 < x1 or x0 < s1 and s0 < x1 or r0 < s1 and s0 < r1
                or x0 < w1 and w0 < x1 or r0 < w1 and w0 < r1 or s0 < w1 and w0 < s1)


def draft_fc_accepted(x, weight, bias, rows, chunk_norm_weight, input_norm_weight, eps, out, workspace,
                      norm_folded) -> int:
    """M (the output rows, > 0) when the arguments are accepted, else -1. ``out`` None: the functional
    op (the face allocates it). Host-side (CPU) rows are range-checked too: accepted means the face
    needs no other check before the backend runs."""
    if not plain_eager() or type(eps) is not float or not 0.0 < eps < _INF or type(norm_folded) is not bool:
        return -1
    if not _served(x):
        return -1
    dtype, device = x.dtype, x.device
    m, w = _matrix(x, dtype, device), _matrix(weight, dtype, device)
    if m is None or w is None or w[1] != m[1]:
        return -1
    R, KH, xs, x0 = m
    N, _, ws, w0 = w
    es = x.element_size()
    reads = [(x0, x0 + ((R - 1) * xs + KH) * es), (w0, w0 + ((N - 1) * ws + KH) * es)]
    if bias is not None:
        b0 = _vector(bias, dtype, device, N)
        if b0 is None:
            return -1
        reads.append((b0, b0 + N * es))
    if chunk_norm_weight is not None:
        c = _matrix(chunk_norm_weight, dtype, device)
        if c is None or c[0] * c[1] != KH or (c[0] > 1 and c[2] != c[1]):  # [K, hidden], contiguous
            return -1
        reads.append((c[3], c[3] + KH * es))
    if input_norm_weight is not None:
        i0 = _vector(input_norm_weight, dtype, device, KH)
        if i0 is None:
            return -1
        reads.append((i0, i0 + KH * es))
    if norm_folded and (chunk_norm_weight is None and input_norm_weight is None
                        or dtype is torch.float16 and input_norm_weight is not None):
        return -1
    if rows is None:
        M = R
    else:
        f = _flat(rows, ROW_INDEX_DTYPES, device)
        if f is None:
            return -1
        M, r0 = f
        reads.append((r0, r0 + M * rows.element_size()))
        if device.type == "cpu" and not _host_rows_in_range(rows, M, R):
            return -1
    writes = []
    if out is not None:
        o = _matrix(out, dtype, device)
        if o is None or o[0] != M or o[1] != N or (M > 1 and o[2] < N):
            return -1
        o0 = o[3]
        writes.append((o0, o0 + ((M - 1) * o[2] + N) * es))
    if workspace is not None:
        f = _flat(workspace, _WORKSPACE_DTYPES, device)
        if f is None or f[1] % 16:  # the kernels' vector loads need 16-byte alignment
            return -1
        n, p = f
        writes.append((p, p + n))
    return M if _apart(writes, reads) else -1


# ---- the C++ twins --------------------------------------------------------------------------------
# csrc/accept.cpp implements the three tests above (the same conditions) at ~0.1-0.3 us instead of ~2-5 us. Where the
# extension is built they serve the faces; the Python twins stay under these names for builds without it and for
# tests/ops/test_accept.py, which holds both to the contract.
python_capture_accepted = capture_accepted
python_fused_add_rmsnorm_capture_accepted = fused_add_rmsnorm_capture_accepted
python_draft_fc_accepted = draft_fc_accepted


# What the compiled twins must answer for: version 2 also refuses every call while a mode or a
# torch.func transform is active (the faces rely on it and no longer call plain_eager themselves).
ACCEPT_VERSION = 2


def compiled_twins():
    """(capture, fused_add_rmsnorm_capture, draft_fc) acceptance from eagle3_ops._C, or None when the
    extension is not built (or was built from an older accept.cpp: ``accept_version`` below
    :data:`ACCEPT_VERSION`; such a module's twins would not see the modes)."""
    from .cuda_backend import cuda_extension

    ext = cuda_extension()
    names = ("accept_capture", "accept_fused_add_rmsnorm_capture", "accept_draft_fc")
    if ext is None or getattr(ext, "accept_version", 0) != ACCEPT_VERSION or not all(hasattr(ext, n) for n in names):
        return None
    return tuple(getattr(ext, n) for n in names)


_compiled = compiled_twins()
if _compiled is not None:
    capture_accepted, fused_add_rmsnorm_capture_accepted, draft_fc_accepted = _compiled
IMPLEMENTATION = "C++ (eagle3_ops._C)" if _compiled is not None else "Python"
