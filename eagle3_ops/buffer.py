"""The preallocated capture buffer: one [max_tokens, K*hidden] tensor that every capture writes into.

Slot k of a token row holds capture k (columns k*H:(k+1)*H), so ``view(T)`` is the draft's fc input
as is: no clone, no cat. Allocate it once, outside any CUDA-graph memory pool, and share it by all
graph batch sizes: every forward overwrites rows [0, T) before the draft reads them.
"""
from __future__ import annotations

from typing import Optional

import torch

from .validation import SUPPORTED_DTYPES


class AuxCaptureBuffer:
    """A zeroed ``[max_tokens, num_captures*hidden_size]`` tensor of ``dtype`` on ``device``, allocated once
    (ValueError for a dtype the ops do not take or a bad size): the capture ops write slot k of rows [0, T),
    and ``view(T)`` is the draft's fc input."""

    def __init__(self, max_tokens: int, hidden_size: int, num_captures: int,
                 dtype: torch.dtype = torch.bfloat16, device: Optional[torch.device] = None):
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"AuxCaptureBuffer: dtype must be one of bfloat16, float16, float32 (the ops' "
                             f"dtypes), got {dtype}")
        if max_tokens < 0 or hidden_size <= 0 or num_captures <= 0:
            raise ValueError(f"AuxCaptureBuffer: need max_tokens >= 0, hidden_size > 0, num_captures > 0; got "
                             f"{max_tokens}, {hidden_size}, {num_captures}")
        self.max_tokens = max_tokens
        self.hidden_size = hidden_size
        self.num_captures = num_captures
        # zeros, once: SGLang's CUDA-graph runners may read rows no forward has written yet as padding
        # (their own static buffers are torch.zeros; random bits could be NaN/Inf)
        self.buffer = torch.zeros((max_tokens, num_captures * hidden_size), dtype=dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        """The buffer's dtype (bf16, fp16 or fp32)."""
        return self.buffer.dtype

    @property
    def device(self) -> torch.device:
        """The device the buffer lives on."""
        return self.buffer.device

    def view(self, num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` rows, [T, K*H]: the fc input for this forward."""
        if not 0 <= num_tokens <= self.max_tokens:
            raise ValueError(f"AuxCaptureBuffer.view: num_tokens={num_tokens} outside [0, {self.max_tokens}]")
        return self.buffer[:num_tokens]

    def slot(self, k: int, num_tokens: int) -> torch.Tensor:
        """Slot ``k`` of the first ``num_tokens`` rows, [T, H] (a strided view) for in-place producers."""
        if not 0 <= k < self.num_captures:
            raise ValueError(f"AuxCaptureBuffer.slot: k={k} outside [0, {self.num_captures})")
        H = self.hidden_size
        return self.view(num_tokens)[:, k * H:(k + 1) * H]

    def __repr__(self) -> str:
        return (f"AuxCaptureBuffer(max_tokens={self.max_tokens}, hidden_size={self.hidden_size}, "
                f"num_captures={self.num_captures}, dtype={self.dtype}, device={self.device})")
