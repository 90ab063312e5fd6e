"""Programmatic dependent launch (PDL) for the kernels written in TIRx (the wgmma GEMMs, the
strips index, fused attention), applied by :func:`.lowering.lower_tirx` on
sm_90 and later.

Why: a model is a chain of kernels on one stream, and each launch waits for the kernel before
it to complete before its CTAs start, so the launch and the CTAs' start-up are paid between
every two kernels (BERT at batch 32: ~100 kernels a call).  With PDL a kernel's launch may
start while the kernel before it still runs; its threads then wait until that kernel has
completed and its memory is visible.

:func:`with_dependent_launch` gives a kernel TVM's PDL launch tag (the runtime then launches it
by ``cuLaunchKernelEx`` with programmatic stream serialization) and makes every thread start
with (:data:`ENTRY`; on sm_90 and later only)::

    griddepcontrol.launch_dependents    # the next kernel may launch now
    griddepcontrol.wait                 # the kernel before this one has completed

ahead of any memory access.  Every kernel launched this way waits before touching memory, and a
kernel launched without it starts only after the one before it has completed, so every kernel
still sees the writes of all kernels before it on the stream.

Measured gains (chains of wgmma GEMMs, BERT): docs/design/hopper_kernels.md.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

__all__ = ["PDL_TAG", "ENTRY", "with_dependent_launch", "launches_dependent"]

#: TVM's launch-parameter tag (its spelling) of a kernel launched with programmatic stream
#: serialization allowed
PDL_TAG = "tirx.use_programtic_dependent_launch"
#: the device function every thread calls first (the two instructions, for sm_90 and later:
#: the CUDA still compiles for older archs, where a plain launch needs no wait)
ENTRY = "pit_dependent_launch_entry"
_ENTRY_SOURCE = f"""__forceinline__ __device__ void {ENTRY}() {{
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}}"""


def _enter(stmt):
    """``stmt`` (a kernel's launch_thread nest) with :data:`ENTRY` called first inside it"""
    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "thread_extent":
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, _enter(stmt.body))
    return tirx.SeqStmt([tirx.Evaluate(T.cuda.func_call(ENTRY, source_code=_ENTRY_SOURCE)), stmt])


def _launch_params(func: tirx.PrimFunc) -> list[str]:
    """``func``'s kernel launch-parameter tags"""
    return [str(t) for t in func.attrs.get("tirx.kernel_launch_params", [])] if func.attrs is not None else []


def launches_dependent(func: tirx.PrimFunc) -> bool:
    """whether ``func``'s kernels are launched with PDL"""
    return PDL_TAG in _launch_params(func)


def with_dependent_launch(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` (lowered to launch_thread nests, before TVM's host / device split) with each of
    its kernels launched with PDL, every thread calling :data:`ENTRY` first; unchanged if it
    is already."""
    if launches_dependent(func):
        return func
    body = list(func.body.seq) if isinstance(func.body, tirx.SeqStmt) else [func.body]
    nests = [isinstance(s, tirx.AttrStmt) and s.attr_key == "thread_extent" for s in body]
    if not any(nests):
        raise ValueError("with_dependent_launch: the function launches no kernel at its top level")
    return (func.with_body(tirx.SeqStmt([_enter(s) if nest else s for s, nest in zip(body, nests)]))
            .with_attr("tirx.kernel_launch_params", _launch_params(func) + [PDL_TAG]))
