"""Functions that MetaSchedule's builder/runner worker processes unpickle (by reference).

Kept free of ``pit_tvm.schedules`` imports: importing ``tvm.s_tir.tensor_intrin.cuda`` (which
the tensor-core schedule needs) costs ~20 s of CPU per fresh worker process, and LocalBuilder
starts fresh workers for every batch.  The early exit is applied in the tuning process
(:class:`pit_tvm.tuning.space.PitBuilder`), so the workers only compile.
"""
from __future__ import annotations

import math


def build_module(mod, target, _params=None):
    """``LocalBuilder`` ``f_build``: ``tvm.compile`` with the target current (the CUDA
    callback reads it) and ``tirx.use_async_copy`` on (cp.async for the pipelined copies);
    returns the runtime module (``f_export`` calls ``export_library`` on it)."""
    import tvm

    with tvm.transform.PassContext(config={"tirx.use_async_copy": True}):
        with target:
            ex = tvm.compile(mod, target=target)
    return getattr(ex, "mod", ex)


def export_shared(mod) -> str:
    """``LocalBuilder`` ``f_export``: a linked ``.so`` (in the parallel builder workers), not
    the default tar that the single runner worker would have to link per candidate."""
    import os
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), "tvm_tmp_mod.so")
    mod.export_library(path)
    return path


#: (device, args_info, repeat) -> allocated arguments: the runner worker process persists
#: across candidates, and every candidate of a task takes the same arguments
_ARGS_CACHE: dict = {}


def alloc_pit_arguments(device, args_info, alloc_repeat):
    """``LocalRunner`` ``f_alloc_argument`` for the row-gather workload
    ``(A[M,K], B[K,N], offsets[2], ids[M], [bias[N],] C[M,N])``: random A/B/bias, a *valid*
    index listing every row (``offsets=[0, M]``, ``ids=arange(M)``; MetaSchedule's default
    random int32 fill would index out of bounds), C uninitialised.  Cached per worker
    process: the kernels only read A/B/offsets/ids and write C."""
    import numpy as np
    import tvm

    infos = [tuple(a) for a in args_info]
    key = (str(device), repr(infos), int(alloc_repeat))
    if key in _ARGS_CACHE:
        return _ARGS_CACHE[key]
    _ARGS_CACHE.clear()          # a new task: free the previous task's tensors
    out = []
    for rep in range(alloc_repeat):
        rng = np.random.default_rng(rep)
        m = int(infos[0][2][0])
        args = []
        for i, (_, dtype, shape) in enumerate(infos):
            shape = [int(s) for s in shape]
            if i == len(infos) - 1:
                args.append(tvm.runtime.empty(shape, dtype, device))
                continue
            if i == 2:
                host = np.array([0, m], "int32")
            elif i == 3:
                host = np.arange(m, dtype="int32")
            else:
                scale = 1.0 / math.sqrt(shape[0]) if i == 1 else 1.0
                host = rng.standard_normal(shape, dtype=np.float32) * scale
                if dtype == "bfloat16":
                    import ml_dtypes

                    host = host.astype(ml_dtypes.bfloat16)
                else:
                    host = host.astype(dtype)
            args.append(tvm.runtime.tensor(host, device))
        out.append(args)
    _ARGS_CACHE[key] = out
    return out
