"""Lowering of an explicit TIRx kernel to the plain TIR the s_tir build pipeline takes."""
from __future__ import annotations

import tvm
from tvm import tirx

from pit_tvm.schedules.hopper.dependent_launch import with_dependent_launch
from pit_tvm.target import sm_version


def lower_tirx(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc:
    """Lower an explicit TIRx kernel (``T.device_entry``, ``T.cta_id``...) to plain TIR with
    launch_thread bindings, so that the s_tir build pipeline (Relax's) compiles it; for sm_90
    and later launched with programmatic dependent launch (:mod:`pit_tvm.schedules.hopper.dependent_launch`)."""
    mod = tvm.IRModule({"main": func.with_attr("target", target)})
    with target:
        mod = tvm.transform.Sequential([tirx.transform.LowerTIRx(),
                                        tirx.transform.LowerTIRxOpaque()])(mod)
    lowered = mod["main"].without_attr("target").with_attr("tirx.is_scheduled", True)
    return with_dependent_launch(lowered) if sm_version(target) >= 90 else lowered
