"""Work-arounds for two bf16 bugs of the Triton interpreter, and nothing else (docs/design.md §13.2).

Under ``TRITON_INTERPRET=1``, Triton 3.8 stores bfloat16 tensors as numpy ``uint16``, and

1. its ``tl.dot`` multiplies those raw bit patterns as integers, so a bf16 ``tl.dot`` returns
   garbage on the CPU (fp16 and fp32 are real numpy floats there and come out right);
2. its fp32 -> bf16 conversion *truncates*, where a GPU rounds to nearest even, so an interpreted
   kernel would be up to one bf16 ulp off instead of half an ulp, and CPU tests would check
   different numerics than the GPU runs.

Kernels take one constexpr, ``INTERPRETER_BF16 = interpreter_bf16(kernel, dtype)``: True only when
the kernel object is an interpreted one *and* the data are bf16. With it, :func:`dot` converts both
operands to fp32 first (exact: every bf16 value is an fp32 value) and :func:`cast` rounds to
nearest even by hand. On a GPU the flag is False, the branches are removed at compile time and the
kernels are exactly ``tl.dot(a, b, acc)`` and ``v.to(dtype)``.

``tests/ops/test_backend_internals.py`` proves each half: the raw interpreter results are wrong, the
shimmed ones are right, and the shim is inactive for a compiled (non-interpreted) kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def interpreted(kernel) -> bool:
    """True when ``kernel`` (a ``@triton.jit`` object) runs in the Triton interpreter.

    Triton decides this when the kernel is decorated (``TRITON_INTERPRET`` at import time), so the
    kernel object, not the current environment, is the reliable witness.
    """
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a Triton without the interpreter cannot be interpreting
        return False
    return isinstance(kernel, InterpretedFunction)


def interpreter_bf16(kernel, dtype: torch.dtype) -> bool:
    """The ``INTERPRETER_BF16`` constexpr for ``kernel`` working on ``dtype`` data."""
    return dtype == torch.bfloat16 and interpreted(kernel)


@triton.jit
def dot(a, b, acc, INTERPRETER_BF16: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """``acc + a @ b``; bf16 operands are upcast only under the interpreter (see module doc)."""
    if INTERPRETER_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def cast(v, dtype: tl.constexpr, INTERPRETER_BF16: tl.constexpr):
    """fp32 ``v`` -> ``dtype``, rounded to nearest even. Under the interpreter (bf16 only) the
    rounding is done on the bits, since the interpreter truncates; NaN stays a (quiet) NaN."""
    if INTERPRETER_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(v != v, (bits >> 16) | 0x40, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return v.to(dtype)
