"""Triton kernels, one module per kernel family (capture.py, draft_fc.py). They assume validated
arguments (eagle3_ops.validation runs first) and run on GPUs, or on CPU tensors under the Triton
interpreter (TRITON_INTERPRET=1), which is how CI tests them."""
