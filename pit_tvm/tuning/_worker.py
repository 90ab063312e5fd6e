"""Functions that MetaSchedule's builder/runner worker processes unpickle (by reference).

Kept free of ``pit_tvm.schedules`` imports: importing ``tvm.s_tir.tensor_intrin.cuda`` (which
the tensor-core schedule needs) costs ~20 s of CPU per fresh worker process, and builder workers
are replaced now and then (:mod:`pit_tvm.tuning.builder`).  The early exit is applied in the tuning process
(:class:`pit_tvm.tuning.space.PitBuilder`), so the workers only compile.
"""
from __future__ import annotations

import math


def build_module(mod, target, _params=None):
    """The builder's ``f_build``: ``tvm.compile`` with the target current (the CUDA
    callback reads it) and ``tirx.use_async_copy`` on (cp.async for the pipelined copies);
    returns the runtime module (``f_export`` calls ``export_library`` on it)."""
    import tvm

    with tvm.transform.PassContext(config={"tirx.use_async_copy": True}):
        with target:
            ex = tvm.compile(mod, target=target)
    return getattr(ex, "mod", ex)


def export_shared(mod) -> str:
    """The builder's ``f_export``: a linked ``.so`` (in the parallel builder workers), not
    the default tar that the single runner worker would have to link per candidate."""
    import os
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), "tvm_tmp_mod.so")
    mod.export_library(path)
    return path


#: (device, args_info, repeat) -> allocated arguments: the runner worker process (or an RPC
#: server's session worker) persists across candidates, and every candidate of a task takes the
#: same arguments
_ARGS_CACHE: dict = {}


def _index_host_arrays(infos, rep: int, density: float):
    """the index ``(offsets, ids)`` of repetition ``rep`` (numpy int32) for the PIT workload whose
    arguments are ``infos``, and the random generator that drew it: rows workload (one group of
    M ids) lists every row; tiles workload lists ``density`` of each strip's micro-tiles"""
    import numpy as np

    m = int(infos[0][2][0])
    strips = int(infos[2][2][0]) - 1
    rng = np.random.default_rng(rep)
    if strips == 1 and int(infos[3][2][0]) == m:
        return rng, (np.array([0, m], "int32"), np.arange(m, dtype="int32"))
    return rng, _tiles_index(rng, strips, int(infos[3][2][0]) // strips, density)


def alloc_pit_arguments(device, args_info, alloc_repeat, density: float = 0.5):
    """``LocalRunner`` ``f_alloc_argument`` for the PIT workloads: random A/B/bias, C
    uninitialised, and a *valid* index (MetaSchedule's default random int32 fill would index
    out of bounds).  The rows workload ``(A[M,K], B[K,N], offsets[2], ids[M], [bias[N],]
    C[M,N])`` lists every row (``offsets=[0, M]``, ``ids=arange(M)``); the tiles workload
    ``(A[M,K], B[K,N], offsets[G+1], ids[G*KT], C[M,N])`` lists ``density`` of each strip's
    KT micro-tile columns, drawn at random and ascending.  Cached per worker process: the
    kernels only read A/B/offsets/ids and write C."""
    import numpy as np
    import tvm

    infos = [tuple(a) for a in args_info]
    key = (str(device), repr(infos), int(alloc_repeat), float(density))
    if key in _ARGS_CACHE:
        return _ARGS_CACHE[key]
    _ARGS_CACHE.clear()          # a new task: free the previous task's tensors
    out = []
    for rep in range(alloc_repeat):
        rng, (offsets, ids) = _index_host_arrays(infos, rep, density)
        args = []
        for i, (_, dtype, shape) in enumerate(infos):
            shape = [int(s) for s in shape]
            if i == len(infos) - 1:
                args.append(tvm.runtime.empty(shape, dtype, device))
                continue
            if i in (2, 3):
                host = offsets if i == 2 else ids
            else:
                scale = 1.0 / math.sqrt(shape[0]) if i == 1 else 1.0
                host = _host_as(rng.standard_normal(shape, dtype=np.float32) * scale, dtype)
            args.append(tvm.runtime.tensor(host, device))
        out.append(args)
    _ARGS_CACHE[key] = out
    return out


def no_delay(sock):
    """``sock`` (a TCP socket) with Nagle's algorithm off, and returned.  Why: TVM's RPC
    protocol sends each tracker message as two writes (its length, then its JSON), and with
    Nagle's algorithm the second waits for the peer's delayed ACK of the first -- tens of ms a
    session (CHANGELOG, issue 37)."""
    import socket

    if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def rpc_create_session(rpc_config):
    """``RPCRunner`` ``f_create_session``: MetaSchedule's default (a tracker request per
    candidate, then a session on the server the tracker names) with :func:`no_delay` on the
    tracker socket (the servers' side: :func:`pit_tvm.tuning.rpc_server.init_server_process`)."""
    tracker = rpc_config.connect_tracker()
    no_delay(getattr(tracker, "_sock", None))       # (TVM's TrackerSession keeps its socket there)
    return tracker.request(key=rpc_config.tracker_key, priority=rpc_config.session_priority,
                           session_timeout=rpc_config.session_timeout_sec)


def warm_runner_worker(hold_s: float) -> None:
    """A job for a runner's worker process that imports what its measurement jobs need, then
    holds the worker ``hold_s`` seconds.  Submitted once per worker when the RPC runner is
    made (:func:`pit_tvm.tuning.rpc.rpc_runner`), so that every worker starts (imports TVM)
    during the first round's search instead of one joining in the middle of its measurements;
    the hold keeps a warm worker from taking a cold one's job."""
    import time

    import tvm.s_tir.meta_schedule.runner.rpc_runner  # noqa: F401 - the import is the point

    time.sleep(hold_s)


def rpc_alloc_pit_arguments(session, device, args_info, alloc_repeat, density: float = 0.5):
    """``RPCRunner`` ``f_alloc_argument``: :func:`alloc_pit_arguments` on an RPC server's
    device.  A, B (and a bias) are filled on the server (``random_fill_for_measure``, nothing
    sent), the index is drawn here exactly as the local runner draws it and sent (offsets and
    ids: a few KiB), C is left uninitialised; kept on the server for the task's next
    candidates (:func:`_remote_arguments`)."""
    infos = [tuple(a) for a in args_info]

    def host_arrays(rep):
        _, (offsets, ids) = _index_host_arrays(infos, rep, density)
        return [offsets if i == 2 else ids if i == 3 else None for i in range(len(infos))]

    return _remote_arguments(session, device, infos, alloc_repeat, host_arrays, ("pit", float(density)))


#: the global functions of a PIT RPC server that keep a task's arguments between its sessions
#: (the server's session worker process persists; :func:`register_server_functions`)
CACHE_ARGUMENTS_FUNC = "pit.cache_arguments"
RESTORE_ARGUMENTS_FUNC = "pit.restore_arguments"
#: the tasks whose inputs a server keeps (the least recently used goes first): tuners sharing
#: the servers do not refill each other's
KEPT_TASKS = 4


def _cache_arguments(key: str, *tensors) -> None:
    """on the server: keep device copies of ``tensors`` under ``key`` (the session's own
    tensors are freed when it ends), dropping the least recently used task's beyond
    :data:`KEPT_TASKS`"""
    import tvm

    while len(_ARGS_CACHE) >= KEPT_TASKS:
        _ARGS_CACHE.pop(next(iter(_ARGS_CACHE)))
    kept = []
    for t in tensors:
        copy = tvm.runtime.empty(t.shape, t.dtype, t.device)
        copy.copyfrom(t)
        kept.append(copy)
    _ARGS_CACHE[key] = kept


def _restore_arguments(key: str, *tensors) -> bool:
    """on the server: copy what is kept under ``key`` into ``tensors`` (on the device);
    False, nothing copied, when nothing is kept under it"""
    kept = _ARGS_CACHE.pop(key, None)
    if kept is None or len(kept) != len(tensors):
        return False
    _ARGS_CACHE[key] = kept          # the most recently used now
    for dst, src in zip(tensors, kept):
        dst.copyfrom(src)
    return True


def _remote_arguments(session, device, infos, alloc_repeat, host_arrays, workload):
    """``alloc_repeat`` argument lists on an RPC server's ``device``: position i is
    ``host_arrays(rep)[i]`` sent from here where it is not None (an index), else, but for the
    output (last, left uninitialised), filled on the server (``random_fill_for_measure``,
    nothing sent) or, for a dtype the server's fill does not take, with data sent from here.
    A PIT server keeps the inputs under a key of ``workload`` (the parameters ``host_arrays``
    draws with), the shapes and the device, and the task's later candidates, each in a new
    session, get them by a copy on the device: filling them cost far more than measuring
    (CHANGELOG, issue 37).  Like the local runner's cache, the kernels only write the output."""
    import tvm
    from tvm.s_tir.meta_schedule.utils import get_global_func_on_rpc_session

    out = [[tvm.runtime.empty([int(s) for s in shape], dtype, device) for _, dtype, shape in infos]
           for _ in range(int(alloc_repeat))]
    inputs = [arg for args in out for arg in args[:-1]]
    key = repr((workload, infos, int(alloc_repeat), int(device.dlpack_device_type()) % 128, int(device.index)))
    try:
        restore, cache = session.get_function(RESTORE_ARGUMENTS_FUNC), session.get_function(CACHE_ARGUMENTS_FUNC)
    except Exception:  # noqa: BLE001 - a plain TVM server (tvm raises a plain error for a missing function)
        restore = cache = None
    if restore is not None and restore(key, *inputs):
        return out
    fill = get_global_func_on_rpc_session(
        session, "tvm.contrib.random.random_fill_for_measure",
        "the RPC server's TVM runtime has no random fill (build TVM with USE_RANDOM=ON)")
    for rep, args in enumerate(out):
        for host, arg in zip(host_arrays(rep), args[:-1]):
            if host is not None:
                arg.copyfrom(host)
                continue
            try:
                fill(arg)
            except Exception:  # noqa: BLE001 - a dtype the server's fill does not take: send data
                arg.copyfrom(_random_host(list(arg.shape), str(arg.dtype), rep))
    if cache is not None:
        cache(key, *inputs)
    return out


def _random_host(shape, dtype: str, seed: int):
    """standard-normal host data of ``dtype`` (bfloat16 through ml_dtypes)"""
    import numpy as np

    return _host_as(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), dtype)


def _host_as(host, dtype: str):
    """``host`` (numpy) cast to ``dtype`` (bfloat16 through ml_dtypes)"""
    if dtype == "bfloat16":
        import ml_dtypes

        return host.astype(ml_dtypes.bfloat16)
    return host.astype(dtype)


def _tiles_index(rng, strips: int, tiles_per_strip: int, density: float):
    """a ``group="row"`` tiles index listing ``round(density * tiles_per_strip)`` (at least 1)
    random columns of every strip, ascending; unused tail -1"""
    import numpy as np

    count = max(1, min(tiles_per_strip, int(round(density * tiles_per_strip))))
    offsets = np.arange(strips + 1, dtype="int32") * count
    ids = np.full(strips * tiles_per_strip, -1, "int32")
    for g in range(strips):
        ids[g * count:(g + 1) * count] = np.sort(rng.choice(tiles_per_strip, count, replace=False))
    return offsets, ids


#: bytes a flush copies (read + write): well over the H100's 50 MB L2
_FLUSH_BYTES = 1 << 27
#: on a CPU (the llvm target): over a core's L2 and its share of L3
_FLUSH_BYTES_CPU = 1 << 25
#: the global function ``time_evaluator`` calls before every timed run
FLUSH_FUNC = "pit.flush_l2"
_FLUSH: dict = {}


def _flush_l2(*args) -> None:
    """``time_evaluator`` ``f_preproc``: evict the cache by a device-to-device copy of
    :data:`_FLUSH_BYTES` (CPU: :data:`_FLUSH_BYTES_CPU`) on the device of the kernel's first
    argument (queued on the stream before the timed run's start event).  The buffers are
    allocated at the first call in a process: in the local runner's worker, or on an RPC
    server (where ``time_evaluator`` runs and looks this function up by name)."""
    device = args[0].device
    if _FLUSH.get("device") != str(device):
        size = _FLUSH_BYTES_CPU if device.dlpack_device_type() == 1 else _FLUSH_BYTES
        _FLUSH["buffers"] = None      # free the previous device's buffers first
        _FLUSH["buffers"] = tuple(_empty_bytes(size, device) for _ in range(2))
        _FLUSH["device"] = str(device)
    dst, src = _FLUSH["buffers"]
    dst.copyfrom(src)


def _empty_bytes(size: int, device):
    import tvm

    return tvm.runtime.empty((size,), "uint8", device)


def register_server_functions() -> None:
    """Register what the PIT runners call by name on the side that times the kernels
    (:data:`FLUSH_FUNC`; on a server, the argument cache :data:`CACHE_ARGUMENTS_FUNC` /
    :data:`RESTORE_ARGUMENTS_FUNC`): in the local runner's worker, and in the session worker
    of the RPC servers :mod:`pit_tvm.tuning.rpc_server` starts."""
    import tvm_ffi

    tvm_ffi.register_global_func(FLUSH_FUNC, _flush_l2, override=True)
    tvm_ffi.register_global_func(CACHE_ARGUMENTS_FUNC, _cache_arguments, override=True)
    tvm_ffi.register_global_func(RESTORE_ARGUMENTS_FUNC, _restore_arguments, override=True)


def _time_cold(rt_mod, device, evaluator_config, repeated_args):
    """``number x repeat`` timed runs of one call each, every one after :data:`FLUSH_FUNC`"""
    import itertools

    evaluator = rt_mod.time_evaluator(rt_mod.entry_name, device, number=1,
                                      repeat=evaluator_config.number * evaluator_config.repeat,
                                      min_repeat_ms=0, f_preproc=FLUSH_FUNC)
    costs = []
    for args in repeated_args:
        device.sync()
        costs.append(evaluator(*args).results)
    return [float(c) for c in itertools.chain.from_iterable(costs)]


def run_evaluator_cold_l2(rt_mod, device, evaluator_config, repeated_args):
    """``LocalRunner`` ``f_run_evaluator``: every timed run starts with the L2 cache flushed,
    ``number x repeat`` runs of one call each.  Why: in the op the index kernels read A (and
    the compaction writes it) between two GEMMs, so B and A are cold when the PIT kernel
    starts; timed back to back, a tile shape that re-reads B more often looks faster than it
    is (docs/design/measurements.md#tuning)."""
    register_server_functions()
    return _time_cold(rt_mod, device, evaluator_config, repeated_args)


def rpc_run_evaluator_cold_l2(session, rt_mod, device, evaluator_config, repeated_args):
    """``RPCRunner`` ``f_run_evaluator``: :func:`run_evaluator_cold_l2` on the RPC server.
    ``time_evaluator`` runs there and calls :data:`FLUSH_FUNC` there, so the server must have
    registered it (servers started by ``python -m pit_tvm.tuning.rpc_server`` do)."""
    try:
        session.get_function(FLUSH_FUNC)
    except Exception as err:  # noqa: BLE001 - tvm raises a plain error for a missing function
        raise RuntimeError(
            f"the RPC server has no {FLUSH_FUNC} (the cold-L2 timing): start the servers with "
            "`python -m pit_tvm.tuning.rpc_server --tracker HOST:PORT --key KEY`, not "
            "`python -m tvm.exec.rpc_server`") from err
    return _time_cold(rt_mod, device, evaluator_config, repeated_args)


# --------------------------------------------------------------------------------------
# the MoE grouped GEMM's arguments (pit_tvm.tuning.moe)
# --------------------------------------------------------------------------------------
#: the routings a grouped GEMM is measured with: every token's k experts uniformly at random,
#: or Zipf-skewed over the experts (expert e drawn with weight (e + 1) ** -zipf_a)
MOE_ROUTINGS = ("balanced", "zipf")


def moe_routing_index(tokens: int, num_experts: int, top_k: int, routing: str = "balanced",
                      zipf_a: float = 1.2, seed: int = 0):
    """``(expert_ids[T, k], offsets[E+1], assignments[T*k])`` (int32, numpy) of a random routing:
    ``k`` distinct experts a token (drawn without replacement by the Gumbel top-k of the
    log-weights), and its expert index as the op's device index builds it (flat ids
    ``t*k + j`` grouped by expert, ascending within one; nothing dropped)."""
    import numpy as np

    if routing not in MOE_ROUTINGS:
        raise ValueError(f"routing must be one of {MOE_ROUTINGS}, got {routing!r}")
    if not 0 < int(top_k) <= int(num_experts):
        raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
    rng = np.random.default_rng(seed)
    log_w = np.zeros(num_experts) if routing == "balanced" else -float(zipf_a) * np.log1p(np.arange(num_experts))
    keys = log_w[None, :] + rng.gumbel(size=(int(tokens), int(num_experts)))
    ids = np.argsort(-keys, axis=1, kind="stable")[:, :top_k].astype("int32")
    flat = ids.reshape(-1)
    assignments = np.argsort(flat, kind="stable").astype("int32")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=num_experts))]).astype("int32")
    return ids, offsets, assignments


def _moe_shapes(infos, mode: str, top_k: int) -> tuple[int, int]:
    """(tokens, experts) of a grouped GEMM workload's arguments"""
    positions = int(infos[1][2][0])
    return positions // int(top_k), int(infos[2][2][0]) - 1


def _moe_host_args(infos, mode: str, top_k: int, routing: str, zipf_a: float, rep: int, fill: bool):
    """host arrays (None where ``fill`` is False and the argument is data to fill on the device;
    the output None) of one repetition: the index of a random routing, route weights in (0, 1]"""
    import numpy as np

    tokens, num_experts = _moe_shapes(infos, mode, top_k)
    _, offsets, assignments = moe_routing_index(tokens, num_experts, top_k, routing, zipf_a, seed=rep)
    rng = np.random.default_rng(1000 + rep)
    out = []
    for i, (_, dtype, shape) in enumerate(infos):
        shape = [int(s) for s in shape]
        if i == len(infos) - 1:
            out.append(None)
        elif i == 1:
            out.append(assignments)
        elif i == 2:
            out.append(offsets)
        elif mode == "scatter" and i == 4:
            out.append((1.0 - rng.random(shape)).astype("float32"))
        elif fill:
            # (the weights, W and glu's W3: [E, K, N])
            scale = 1.0 / math.sqrt(shape[1]) if i == 3 or (mode == "glu" and i == 4) else 1.0
            out.append(_host_as(rng.standard_normal(shape, dtype=np.float32) * scale, dtype))
        else:
            out.append(None)
    return out


def alloc_moe_arguments(device, args_info, alloc_repeat, mode: str = "gather", top_k: int = 1,
                        routing: str = "balanced", zipf_a: float = 1.2):
    """``LocalRunner`` ``f_alloc_argument`` for the MoE grouped GEMM's workload
    (:func:`pit_tvm.tuning.space.grouped_tuning_workload`): random A and W, the output
    uninitialised, and a *valid* index of a random ``routing`` (:func:`moe_routing_index`;
    one routing a repetition), route weights for scatter.  Cached per worker process."""
    import tvm

    infos = [tuple(a) for a in args_info]
    key = ("moe", str(device), repr(infos), int(alloc_repeat), mode, int(top_k), routing, float(zipf_a))
    if key in _ARGS_CACHE:
        return _ARGS_CACHE[key]
    _ARGS_CACHE.clear()
    out = []
    for rep in range(alloc_repeat):
        host = _moe_host_args(infos, mode, top_k, routing, zipf_a, rep, fill=True)
        out.append([tvm.runtime.empty([int(s) for s in info[2]], info[1], device) if h is None
                    else tvm.runtime.tensor(h, device) for h, info in zip(host, infos)])
    _ARGS_CACHE[key] = out
    return out


def rpc_alloc_moe_arguments(session, device, args_info, alloc_repeat, mode: str = "gather", top_k: int = 1,
                            routing: str = "balanced", zipf_a: float = 1.2):
    """``RPCRunner`` ``f_alloc_argument`` of :func:`alloc_moe_arguments`: A and W filled on the
    server, the index and route weights drawn here and sent."""
    infos = [tuple(a) for a in args_info]
    return _remote_arguments(session, device, infos, alloc_repeat,
                             lambda rep: _moe_host_args(infos, mode, top_k, routing, zipf_a, rep, fill=False),
                             ("moe", mode, int(top_k), routing, float(zipf_a)))
