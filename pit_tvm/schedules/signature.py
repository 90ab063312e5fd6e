"""One TVMScript definition for the signature variants of a kernel.

TVMScript takes a fixed parameter list, so a kernel whose optional inputs vary (a bias, an
attention pattern's run-time tensors) is written once with every input a parameter; its body
leaves the absent ones unread, and :func:`without_params` removes them from the PrimFunc.
"""
from __future__ import annotations

from collections.abc import Container, Sequence

from tvm import tirx


def without_params(kernel: tirx.PrimFunc, names: Sequence[str], dropped: Container[str]) -> tirx.PrimFunc:
    """``kernel`` without the parameters named in ``dropped``; ``names`` names every parameter
    of ``kernel`` in order (the handles' names: a matched parameter takes its buffer's).  The
    body must not read a dropped parameter."""
    if len(names) != len(kernel.params):
        raise ValueError(f"{len(names)} names for the {len(kernel.params)} parameters of the kernel")
    params = [p for name, p in zip(names, kernel.params) if name not in dropped]
    return tirx.PrimFunc(params, kernel.body, kernel.ret_type, kernel.attrs)
