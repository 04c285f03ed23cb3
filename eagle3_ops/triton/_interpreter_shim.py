"""Work-around for one Triton interpreter bug, and nothing else (DESIGN.md §6).

Under ``TRITON_INTERPRET=1``, Triton 3.8 stores bfloat16 tensors as numpy ``uint16`` and its
``tl.dot`` multiplies those raw bit patterns as integers, so a bf16 ``tl.dot`` returns garbage on
the CPU. (fp16 and fp32 are real numpy floats there and come out right.) Kernels therefore call
:func:`dot` below with ``UPCAST_BF16=upcast_bf16_dot(kernel, dtype)``: it is True only when the
kernel object is an interpreted one *and* the operands are bf16, and then both operands are
converted to fp32 before the product (exact: every bf16 value is an fp32 value). On a GPU the flag
is False, the branch is removed at compile time and the kernel is exactly ``tl.dot(a, b, acc)``.

Not shimmed, so that results stay honest about it: the interpreter also *truncates* fp32 -> bf16
conversions (a GPU rounds to nearest), so interpreted bf16 outputs are within one bf16 ulp of the
exact value instead of half an ulp; the CPU tests' bf16 tolerances allow for that.

``tests/test_draft_fc_triton.py`` proves both halves: a raw bf16 ``tl.dot`` under the interpreter
is wrong, and the shim is inactive for a compiled (non-interpreted) kernel.
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


def upcast_bf16_dot(kernel, dtype: torch.dtype) -> bool:
    """The ``UPCAST_BF16`` constexpr for ``kernel`` multiplying ``dtype`` operands."""
    return dtype == torch.bfloat16 and interpreted(kernel)


@triton.jit
def dot(a, b, acc, UPCAST_BF16: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """``acc + a @ b``; the bf16 upcast happens only under the interpreter (see module doc)."""
    if UPCAST_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
