"""Run the kernels' Triton paths on CPU tensors, in Triton's interpreter.

Triton chooses between compiling and interpreting when a kernel is decorated,
i.e. when a kernels module is imported, and reads ``TRITON_INTERPRET`` then.
The flag is set only around that import (re-importing a module another test
imported first) and removed again, so nothing else in this pytest process,
and no engine it starts, inherits it. (vLLM's CPU build would not notice it
anyway: it finds no Triton CPU backend and swaps in placeholder decorators.)
Triton itself is imported before the flag is set (another test may have
imported it already, through vLLM): its library functions stay compiled-mode
objects, which its lazily imported parts (gluon, at the first launch) insist
on. So the kernels call only Triton's builtins (``tl.full``, not the library's
``tl.zeros``); a kernel that calls a library function fails here loudly. The
interpreter needs no flag to run a kernel decorated for it.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import triton.language  # noqa: F401  (before the flag: see above)

_MODULES = ("kernels.packing", "kernels.dcp", "kernels.attention_merge")


def _import_interpreted() -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in _MODULES:
            if name in sys.modules:
                importlib.reload(sys.modules[name])
            else:
                importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


_import_interpreted()


@pytest.fixture(params=["torch", "triton"])
def backend(request) -> str:
    """The two fast paths, each checked against the reference."""
    return request.param
