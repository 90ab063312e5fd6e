"""Generic grouped GEMM of the MoE op (PIT along the token axis of every expert), CPU and CUDA SIMT.

One contract, two modes (docs/design/moe.md); ``E, K, N`` compile-time, tokens ``T`` and
positions ``P`` symbolic; ``offsets[E+1]`` / ``assignments[P]`` the expert index
(:func:`pit_tvm.index.expert_index_func`):

* ``"gather"`` (fc1): ``H[p] = act(X[assignments[p] // top_k] @ W[e] + bias[e])`` for every listed
  position ``p`` (``e`` the expert whose range holds it); rows ``p >= offsets[E]`` are zero.  With a
  gate ``G[P, N]`` (a gated FFN's other half), ``H[p]`` is that times ``G[p]`` in ``H``'s dtype.
  SRead: a tile's rows are gathered from the token rows.
* ``"scatter"`` (fc2): ``Y[a] = route_weight[a] * (H[p] @ W[e] + bias[e])`` with
  ``a = assignments[p]``; rows of ``Y`` no position lists (dropped by capacity) are zero.
  SWrite: each result row goes to its assignment, scaled by its routing weight.

Work is cut into tiles of ``BM`` positions *of one expert* (an expert's last tile is partial),
so every tile multiplies by one weight matrix; tile ``i`` is found on the device by walking the
expert counts (``ceil(P / BM) + E`` tiles bound the grid; the ones past the last expert's exit
at once).  No host synchronisation, no atomics: every output element is written by one thread.

CPU: one parallel loop over (tile, ``BN``-column panel), a ``BM x BN`` fp32 accumulator with the
column loop vectorised.  CUDA: one CTA per (64-position tile, 64-column panel), 256 threads of
4x4 outputs each, K in steps of 16 through shared memory (the fast sm_90a kernel is
``pit_tvm.schedules.hopper.grouped``).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.schedules.signature import without_params
from pit_tvm.target import is_gpu, make_target

MODES = ("gather", "scatter")
ACTIVATIONS = (None, "none", "relu", "gelu", "silu")
DTYPES = ("float32", "float16", "bfloat16")

CPU_BM = 4    # positions per CPU tile (the register accumulator's rows)
CPU_BN = 64   # columns per CPU task (vectorised)
GPU_BM = 64   # positions per CTA tile
GPU_BN = 64   # columns per CTA
GPU_BK = 16   # K per shared-memory step
GPU_THREADS = 16  # threads per side (16 x 16 = 256; each 4 x 4 outputs)
SEARCH_STEPS = 32  # binary-search steps: enough for any int32 count


def apply_activation(v, activation):
    """``activation`` of the fp32 value ``v`` (GELU in its exact erf form, SiLU ``v * sigmoid(v)``)."""
    if activation in (None, "none", "identity"):
        return v
    if activation == "relu":
        return T.max(v, T.float32(0))
    if activation == "gelu":
        return T.float32(0.5) * v * (T.float32(1) + T.erf(v * T.float32(0.7071067811865476)))
    if activation == "silu":
        return v / (T.float32(1) + T.exp(T.float32(0) - v))
    raise ValueError(f"unknown activation {activation!r}: use None, 'relu', 'gelu' or 'silu'")


def check_grouped_args(mode, k, n, num_experts, top_k, dtype, out_dtype, activation):
    if mode not in MODES:
        raise ValueError(f"grouped GEMM mode must be 'gather' or 'scatter', got {mode!r}")
    for name, v in (("K", k), ("N", n), ("num_experts", num_experts), ("top_k", top_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"grouped GEMM {name} must be a positive int, got {v!r}")
    if dtype not in DTYPES or out_dtype not in DTYPES:
        raise ValueError(f"grouped GEMM dtypes {dtype}/{out_dtype} unsupported: use {', '.join(DTYPES)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"grouped GEMM activation {activation!r} unsupported: use None, 'relu', 'gelu' or 'silu'")
    if mode == "scatter" and activation not in (None, "none"):
        raise ValueError("grouped GEMM scatter mode (fc2) takes no activation")


def _find_tile(E, BM):
    """Macro ``find_tile(OFF, tile, info)``: ``info[0:3] = (expert, first position, end)`` of
    tile ``tile`` (expert -1 past the last tile); ``info[3]`` is scratch."""

    @T.macro
    def find_tile(OFF, tile, info):
        info[0] = T.int64(-1)
        info[1] = T.int64(0)
        info[2] = T.int64(0)
        info[3] = T.int64(0)
        for e in range(E):
            if info[0] < 0:
                count = T.Cast("int64", OFF[e + 1] - OFF[e])
                if tile < info[3] + (count + (BM - 1)) // BM:
                    info[0] = T.Cast("int64", e)
                    info[1] = T.Cast("int64", OFF[e]) + (tile - info[3]) * BM
                    info[2] = T.Cast("int64", OFF[e + 1])
                info[3] = info[3] + (count + (BM - 1)) // BM

    return find_tile


def _listed(E):
    """Macro ``listed(OFF, ASG, a, st)``: ``st[0] = 1`` when assignment ``a`` is in the index
    (a binary search in every expert's ascending list), else 0; ``st[1:3]`` scratch."""

    @T.macro
    def listed(OFF, ASG, a, st):
        st[0] = T.int64(0)
        for e in range(E):
            st[1] = T.Cast("int64", OFF[e])
            st[2] = T.Cast("int64", OFF[e + 1])
            for _ in range(SEARCH_STEPS):
                if st[1] < st[2]:
                    if T.Cast("int64", ASG[(st[1] + st[2]) // 2]) < a:
                        st[1] = (st[1] + st[2]) // 2 + 1
                    else:
                        st[2] = (st[1] + st[2]) // 2
            if st[1] < T.Cast("int64", OFF[e + 1]):
                if T.Cast("int64", ASG[st[1]]) == a:
                    st[0] = T.int64(1)

    return listed


def grouped_gemm_generic_func(mode, k, n, num_experts, top_k, dtype, out_dtype, bias, activation,
                              target, gate=False) -> tirx.PrimFunc:
    """The generic grouped GEMM PrimFunc (see the module docstring), scheduled for ``target``.

    Parameters in order: gather ``(X[T, K], assignments[P], offsets[E+1], W[E, K, N], [bias[E, N]],
    [gate G[P, N]], H[P, N])``; scatter ``(H[P, K], assignments[P], offsets[E+1], W[E, K, N], [bias[E, N]],
    route_weight[P], Y[P, N])``."""
    activation = None if activation in (None, "none", "identity") else activation
    check_grouped_args(mode, k, n, num_experts, top_k, dtype, out_dtype, activation)
    if gate and mode != "gather":
        raise ValueError(f"a gate multiplies the grouped gather's output only, got mode {mode!r}")
    target = make_target(target)
    make = _cuda_func if is_gpu(target) else _cpu_func
    func = make(mode, k, n, num_experts, top_k, dtype, out_dtype, bool(bias), activation, bool(gate))
    name = (f"pit_grouped_{mode}_e{num_experts}_k{k}_n{n}_top{top_k}_{dtype}_{out_dtype}"
            f"{'_bias' if bias else ''}{'_' + activation if activation else ''}{'_gated' if gate else ''}")
    return func.with_attrs({"global_symbol": name, "tirx.is_scheduled": True, "tirx.noalias": True})


def _epilogue_value(mode, acc, BIAS, WT, e, col, a, activation, out_dtype, bias, gate):
    """one output element: gather ``act(acc + bias)`` (times ``WT[a, col]``, the gate, at row
    ``a``: the product of two ``out_dtype`` values rounded once, as the graph's multiply);
    scatter ``WT[a] * (acc + bias)`` (``WT`` the route weights, ``a`` the assignment)"""
    v = acc
    if bias:
        v = v + T.Cast("float32", BIAS[e, col])
    if mode == "gather":
        if gate:
            return T.Cast(out_dtype, T.Cast("float32", T.Cast(out_dtype, apply_activation(v, activation)))
                          * T.Cast("float32", WT[a, col]))
        return T.Cast(out_dtype, apply_activation(v, activation))
    return T.Cast(out_dtype, WT[a] * v)


def _cpu_func(mode, K, N, E, TK, dtype, out_dtype, bias, activation, gate):
    BM = CPU_BM
    BN = min(CPU_BN, -(-N // 8) * 8)
    NBLK = -(-N // BN)
    gather = mode == "gather"
    # (bf16 on llvm is legalised to integer ops with Let bindings that TIR's vectoriser
    # rejects: serial loops there, LLVM's own vectoriser takes what it can)
    VEC = T.serial if "bfloat16" in (dtype, out_dtype) else T.vectorized
    find_tile = _find_tile(E, BM)
    listed = _listed(E)

    @T.macro
    def tile_body(A, ASG, W, BIAS, WT, O, info, src, acc, n0, width, guarded):
        for r in T.unroll(BM):
            for j in VEC(width):
                acc[r * width + j] = T.float32(0)
        for kk in range(K):
            for r in T.unroll(BM):
                if guarded:
                    for j in range(width):
                        if n0 + j < N:
                            acc[r * width + j] = acc[r * width + j] + T.Cast("float32", A[src[r], kk]) * T.Cast(
                                "float32", W[info[0], kk, n0 + j])
                else:
                    for j in VEC(width):
                        acc[r * width + j] = acc[r * width + j] + T.Cast("float32", A[src[r], kk]) * T.Cast(
                            "float32", W[info[0], kk, n0 + j])
        for r in T.unroll(BM):
            if info[1] + r < info[2]:
                if guarded:
                    for j in range(width):
                        if n0 + j < N:
                            if gather:
                                O[info[1] + r, n0 + j] = _epilogue_value(
                                    mode, acc[r * width + j], BIAS, WT, info[0], n0 + j, info[1] + r, activation,
                                    out_dtype, bias, gate)
                            else:
                                O[ASG[info[1] + r], n0 + j] = _epilogue_value(
                                    mode, acc[r * width + j], BIAS, WT, info[0], n0 + j, ASG[info[1] + r],
                                    activation, out_dtype, bias, gate)
                else:
                    for j in VEC(width):
                        if gather:
                            O[info[1] + r, n0 + j] = _epilogue_value(
                                mode, acc[r * width + j], BIAS, WT, info[0], n0 + j, info[1] + r, activation,
                                out_dtype, bias, gate)
                        else:
                            O[ASG[info[1] + r], n0 + j] = _epilogue_value(
                                mode, acc[r * width + j], BIAS, WT, info[0], n0 + j, ASG[info[1] + r],
                                activation, out_dtype, bias, gate)

    @T.macro
    def body(A, ASG, OFF, W, BIAS, WT, O, P):
        # rows no expert lists: zero (gather: the tail positions; scatter: dropped assignments)
        for p in T.parallel(P):
            if gather:
                if p >= T.Cast("int64", OFF[E]):
                    for j in range(N):
                        O[p, j] = T.Cast(out_dtype, T.float32(0))
            else:
                if T.Cast("int64", OFF[E]) < P:
                    st = T.alloc_buffer((3,), "int64", scope="local")
                    listed(OFF, ASG, p, st)
                    if st[0] == 0:
                        for j in range(N):
                            O[p, j] = T.Cast(out_dtype, T.float32(0))
        # column panel outermost: a core's consecutive tasks reuse one panel of W from cache
        for task in T.parallel(((P + (BM - 1)) // BM + E) * NBLK):
            info = T.alloc_buffer((4,), "int64", scope="local")
            find_tile(OFF, task % ((P + (BM - 1)) // BM + E), info)
            if info[0] >= 0:
                src = T.alloc_buffer((BM,), "int64", scope="local")
                acc = T.alloc_buffer((BM * BN,), "float32", scope="local")
                for r in T.unroll(BM):
                    if gather:
                        src[r] = T.Cast("int64", ASG[T.min(info[1] + r, info[2] - 1)]) // TK
                    else:
                        src[r] = T.min(info[1] + r, info[2] - 1)
                if (task // ((P + (BM - 1)) // BM + E)) * BN + BN <= N:
                    tile_body(A, ASG, W, BIAS, WT, O, info, src, acc, (task // ((P + (BM - 1)) // BM + E)) * BN,
                              BN, False)
                else:
                    tile_body(A, ASG, W, BIAS, WT, O, info, src, acc, (task // ((P + (BM - 1)) // BM + E)) * BN,
                              BN, True)

    return _signature(mode, K, N, E, TK, dtype, out_dtype, bias, gate, body)


def _signature(mode, K, N, E, TK, dtype, out_dtype, bias, gate, body):
    """The PrimFunc of ``body(A, ASG, OFF, W, BIAS, WT, O, P)`` with the contract's parameters
    (one definition a mode; the bias and gate parameters dropped where not taken; ``WT`` is
    gather's gate, scatter's route weights)."""
    dropped = (() if bias else ("b",)) + (() if gate else ("g",))
    if mode == "gather":
        @T.prim_func(s_tir=True)
        def gather(x: T.handle, s: T.handle, o: T.handle, w: T.handle, b: T.handle, g: T.handle, h: T.handle):
            NTOK = T.int64()
            P = T.int64()
            X = T.match_buffer(x, (NTOK, K), dtype)
            ASG = T.match_buffer(s, (P,), "int32")
            OFF = T.match_buffer(o, (E + 1,), "int32")
            W = T.match_buffer(w, (E, K, N), dtype)
            BIAS = T.match_buffer(b, (E, N), dtype)
            G = T.match_buffer(g, (P, N), out_dtype)
            H = T.match_buffer(h, (P, N), out_dtype)
            with T.sblock("root"):
                body(X, ASG, OFF, W, BIAS, G, H, P)

        return without_params(gather, ("x", "s", "o", "w", "b", "g", "h"), dropped)

    @T.prim_func(s_tir=True)
    def scatter(h: T.handle, s: T.handle, o: T.handle, w: T.handle, b: T.handle, r: T.handle, y: T.handle):
        P = T.int64()
        H = T.match_buffer(h, (P, K), dtype)
        ASG = T.match_buffer(s, (P,), "int32")
        OFF = T.match_buffer(o, (E + 1,), "int32")
        W = T.match_buffer(w, (E, K, N), dtype)
        BIAS = T.match_buffer(b, (E, N), dtype)
        WT = T.match_buffer(r, (P,), "float32")
        Y = T.match_buffer(y, (P, N), out_dtype)
        with T.sblock("root"):
            body(H, ASG, OFF, W, BIAS, WT, Y, P)

    return without_params(scatter, ("h", "s", "o", "w", "b", "r", "y"), dropped)


def _cuda_func(mode, K, N, E, TK, dtype, out_dtype, bias, activation, gate):
    BM, BN, BK, TS = GPU_BM, GPU_BN, GPU_BK, GPU_THREADS
    RM, RN = BM // TS, BN // TS          # outputs per thread: RM x RN
    NBLK = -(-N // BN)
    KSTEPS = -(-K // BK)
    gather = mode == "gather"
    find_tile = _find_tile(E, BM)
    listed = _listed(E)
    ZT = 256  # threads of the zero-fill kernels

    @T.macro
    def body(A, ASG, OFF, W, BIAS, WT, O, P):
        if gather:
            for zb in T.thread_binding((P * N + (ZT - 1)) // ZT, thread="blockIdx.x"):
                for zt in T.thread_binding(ZT, thread="threadIdx.x"):
                    if zb * ZT + zt < P * N:
                        if (zb * ZT + zt) // N >= T.Cast("int64", OFF[E]):
                            O[(zb * ZT + zt) // N, (zb * ZT + zt) % N] = T.Cast(out_dtype, T.float32(0))
        else:
            for zb in T.thread_binding((P + (ZT - 1)) // ZT, thread="blockIdx.x"):
                for zt in T.thread_binding(ZT, thread="threadIdx.x"):
                    if zb * ZT + zt < P:
                        if T.Cast("int64", OFF[E]) < P:
                            st = T.alloc_buffer((3,), "int64", scope="local")
                            listed(OFF, ASG, zb * ZT + zt, st)
                            if st[0] == 0:
                                for j in range(N):
                                    O[zb * ZT + zt, j] = T.Cast(out_dtype, T.float32(0))
        for bid in T.thread_binding(((P + (BM - 1)) // BM + E) * NBLK, thread="blockIdx.x"):
            As = T.alloc_buffer((BK, BM), "float32", scope="shared")
            Bs = T.alloc_buffer((BK, BN), "float32", scope="shared")
            for ty in T.thread_binding(TS, thread="threadIdx.y"):
                for tx in T.thread_binding(TS, thread="threadIdx.x"):
                    info = T.alloc_buffer((4,), "int64", scope="local")
                    find_tile(OFF, bid // NBLK, info)
                    acc = T.alloc_buffer((RM * RN,), "float32", scope="local")
                    src = T.alloc_buffer((1,), "int64", scope="local")
                    for i in range(RM * RN):
                        acc[i] = T.float32(0)
                    # this thread loads row (ty*TS+tx) // 4 of the A tile, 4 consecutive k
                    src[0] = T.int64(0)
                    if info[0] >= 0:
                        if gather:
                            src[0] = T.Cast("int64", ASG[T.min(info[1] + (ty * TS + tx) // 4, info[2] - 1)]) // TK
                        else:
                            src[0] = T.min(info[1] + (ty * TS + tx) // 4, info[2] - 1)
                    # (no K steps past the last tile: a loop bound, not a branch, around the
                    # barriers; the bound is the same for every thread of the CTA)
                    for k0 in range(T.Select(info[0] >= 0, KSTEPS, 0)):
                        for i in range(4):
                            if k0 * BK + ((ty * TS + tx) % 4) * 4 + i < K:
                                As[((ty * TS + tx) % 4) * 4 + i, (ty * TS + tx) // 4] = T.Cast(
                                    "float32", A[src[0], k0 * BK + ((ty * TS + tx) % 4) * 4 + i])
                            else:
                                As[((ty * TS + tx) % 4) * 4 + i, (ty * TS + tx) // 4] = T.float32(0)
                        for i in range(4):
                            if (k0 * BK + (ty * TS + tx) // 16 < K
                                    and (bid % NBLK) * BN + ((ty * TS + tx) % 16) * 4 + i < N):
                                Bs[(ty * TS + tx) // 16, ((ty * TS + tx) % 16) * 4 + i] = T.Cast(
                                    "float32", W[T.max(info[0], T.int64(0)), k0 * BK + (ty * TS + tx) // 16,
                                                 (bid % NBLK) * BN + ((ty * TS + tx) % 16) * 4 + i])
                            else:
                                Bs[(ty * TS + tx) // 16, ((ty * TS + tx) % 16) * 4 + i] = T.float32(0)
                        for kk in range(BK):
                            for i in range(RM):
                                for j in range(RN):
                                    acc[i * RN + j] = acc[i * RN + j] + As[kk, ty + TS * i] * Bs[kk, tx + TS * j]
                    for i in range(RM):
                        for j in range(RN):
                            if info[1] + ty + TS * i < info[2] and (bid % NBLK) * BN + tx + TS * j < N:
                                if gather:
                                    O[info[1] + ty + TS * i, (bid % NBLK) * BN + tx + TS * j] = _epilogue_value(
                                        mode, acc[i * RN + j], BIAS, WT, info[0], (bid % NBLK) * BN + tx + TS * j,
                                        info[1] + ty + TS * i, activation, out_dtype, bias, gate)
                                else:
                                    O[ASG[info[1] + ty + TS * i], (bid % NBLK) * BN + tx + TS * j] = _epilogue_value(
                                        mode, acc[i * RN + j], BIAS, WT, info[0], (bid % NBLK) * BN + tx + TS * j,
                                        ASG[info[1] + ty + TS * i], activation, out_dtype, bias, gate)

    return _signature(mode, K, N, E, TK, dtype, out_dtype, bias, gate, body)
