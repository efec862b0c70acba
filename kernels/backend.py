"""Which implementation of a kernel runs: one choice shared by every kernel family.

``reference``: the plain PyTorch definition of what is correct (loops, slow).
``torch``: vectorized PyTorch, the path used for CPU tensors.
``triton``: the Triton kernel, the path used for GPU tensors. On CPU tensors
it runs only in Triton's interpreter: Triton decides between compiling and
interpreting when a kernel is decorated, so ``TRITON_INTERPRET=1`` must be set
when the kernel modules are imported (that is how the tests check the kernels
on a machine without a GPU).
``auto`` (the default): ``triton`` for CUDA tensors, ``torch`` otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction

BACKENDS = ("auto", "reference", "torch", "triton")


def resolve(backend: str, device: torch.device, kernel: Any) -> str:
    """The backend to run for tensors on ``device``; ``kernel`` is the family's
    Triton kernel (whether it was decorated for the interpreter)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not interpreted(kernel):
        raise ValueError(
            f"backend 'triton' on {device.type} tensors needs Triton's interpreter "
            "(TRITON_INTERPRET=1 when the kernels module is imported)"
        )
    return backend


def interpreted(kernel: Any) -> bool:
    return isinstance(kernel, InterpretedFunction)
