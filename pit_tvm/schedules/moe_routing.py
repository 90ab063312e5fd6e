"""The small kernels around the MoE op's grouped GEMMs: routing and the combine over k.

* :func:`routing_func`: ``router[T, E]`` -> ``expert_ids[T, k]`` (int32) and ``route_weight[T*k]``
  (fp32), one token per thread, in fp32: the softmax over E (unless the router holds
  probabilities), k selection passes (ties go to the lower expert id, as ``torch.topk`` /
  ``argmax`` on CPU do), then the routing weights of the spec.  Deterministic, no sort.
* :func:`combine_func`: ``y[t] = sum_j Y[t*k + j]`` in fp32, in order of ``j`` (no atomics), plus
  for ``dropped_token="input_scaled"`` the capacity-dropped assignments' ``w * x[t]``.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.schedules.signature import without_params
from pit_tvm.target import is_gpu, make_target

ROUTINGS = ("softmax_topk", "topk_softmax")
ROUTER_INPUTS = ("logits", "probs")
THREADS = 128


def routing_func(num_experts: int, top_k: int, routing: str, normalize: bool, router_input: str,
                 router_dtype: str, target) -> tirx.PrimFunc:
    """PrimFunc ``(router[T, E], expert_ids[T, k], route_weight[T*k])``; see the module docstring.

    ``softmax_topk``: weights are the top-k softmax probabilities (of the router itself with
    ``router_input="probs"``), divided by their sum with ``normalize``.  ``topk_softmax``: the
    softmax over the k selected logits."""
    E, TK = int(num_experts), int(top_k)
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if router_input not in ROUTER_INPUTS:
        raise ValueError(f"router_input must be one of {ROUTER_INPUTS}, got {router_input!r}")
    softmax_over_e = routing == "softmax_topk" and router_input == "logits"
    topk_softmax = routing == "topk_softmax"
    normalize = bool(normalize) and routing == "softmax_topk"
    gpu = is_gpu(make_target(target))

    @T.macro
    def route_token(R, IDS, WT, t):
        vals = T.alloc_buffer((TK,), "float32", scope="local")
        sel = T.alloc_buffer((TK,), "int32", scope="local")
        st = T.alloc_buffer((2,), "float32", scope="local")      # running max, sum
        taken = T.alloc_buffer((1,), "int32", scope="local")
        if softmax_over_e:
            st[0] = T.Cast("float32", R[t, 0])
            for e in range(E):
                st[0] = T.max(st[0], T.Cast("float32", R[t, e]))
            st[1] = T.float32(0)
            for e in range(E):
                st[1] = st[1] + T.exp(T.Cast("float32", R[t, e]) - st[0])
        for j in range(TK):
            sel[j] = -1
            vals[j] = T.float32(0)
            for e in range(E):
                taken[0] = 0
                for jj in range(TK):
                    if jj < j:
                        if sel[jj] == e:
                            taken[0] = 1
                if taken[0] == 0:
                    if T.Or(sel[j] < 0, T.Cast("float32", R[t, e]) > vals[j]):
                        sel[j] = e
                        vals[j] = T.Cast("float32", R[t, e])
        if softmax_over_e:
            for j in range(TK):
                vals[j] = T.exp(vals[j] - st[0]) / st[1]
        if topk_softmax:
            st[0] = vals[0]                  # the largest selected logit
            st[1] = T.float32(0)
            for j in range(TK):
                vals[j] = T.exp(vals[j] - st[0])
                st[1] = st[1] + vals[j]
            for j in range(TK):
                vals[j] = vals[j] / st[1]
        if normalize:
            st[1] = T.float32(0)
            for j in range(TK):
                st[1] = st[1] + vals[j]
            for j in range(TK):
                vals[j] = vals[j] / st[1]
        for j in range(TK):
            IDS[t, j] = sel[j]
            WT[t * TK + j] = vals[j]

    if gpu:
        @T.macro
        def each_token(R, IDS, WT, NTOK):
            for bx in T.thread_binding((NTOK + (THREADS - 1)) // THREADS, thread="blockIdx.x"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    if bx * THREADS + tx < NTOK:
                        route_token(R, IDS, WT, bx * THREADS + tx)
    else:
        @T.macro
        def each_token(R, IDS, WT, NTOK):
            for t in T.parallel(NTOK):
                route_token(R, IDS, WT, t)

    @T.prim_func(s_tir=True)
    def route(r: T.handle, i: T.handle, w: T.handle):
        T.func_attr({"tirx.noalias": True})
        NTOK = T.int64()
        R = T.match_buffer(r, (NTOK, E), router_dtype)
        IDS = T.match_buffer(i, (NTOK, TK), "int32")
        WT = T.match_buffer(w, (NTOK * TK,), "float32")
        with T.sblock("root"):
            each_token(R, IDS, WT, NTOK)

    name = (f"pit_moe_routing_e{E}_k{TK}_{routing}{'_norm' if normalize else ''}_{router_input}_{router_dtype}")
    return route.with_attrs({"global_symbol": name, "tirx.is_scheduled": True})


def combine_func(top_k: int, d: int, dtype: str, out_dtype: str, input_scaled: bool, target) -> tirx.PrimFunc:
    """PrimFunc ``(Y[T*k, d], [x[T, d], kept[T*k], route_weight[T*k]], y[T, d])``: the sum of each
    token's k rows of ``Y`` in fp32, in ``j`` order; with ``input_scaled`` (HF Switch in
    transformers 4.x: a token dropped by capacity passes through scaled by its routing weight)
    plus ``route_weight * x[t]`` for every assignment whose ``kept`` is 0."""
    TK, D = int(top_k), int(d)
    gpu = is_gpu(make_target(target))

    def value(Y, X, KEPT, WT, t, n):
        v = T.float32(0)
        for j in range(TK):
            v = v + T.Cast("float32", Y[t * TK + j, n])
        if input_scaled:
            for j in range(TK):
                v = v + T.Select(KEPT[t * TK + j] == 0, WT[t * TK + j], T.float32(0)) * T.Cast("float32", X[t, n])
        return T.Cast(out_dtype, v)

    if gpu:
        @T.macro
        def body(Y, X, KEPT, WT, O, NTOK):
            for bx in T.thread_binding((NTOK * D + 255) // 256, thread="blockIdx.x"):
                for tx in T.thread_binding(256, thread="threadIdx.x"):
                    if bx * 256 + tx < NTOK * D:
                        O[(bx * 256 + tx) // D, (bx * 256 + tx) % D] = value(
                            Y, X, KEPT, WT, (bx * 256 + tx) // D, (bx * 256 + tx) % D)
    else:
        @T.macro
        def body(Y, X, KEPT, WT, O, NTOK):
            for t in T.parallel(NTOK):
                for n in range(D):
                    O[t, n] = value(Y, X, KEPT, WT, t, n)

    @T.prim_func(s_tir=True)
    def combine(y: T.handle, x: T.handle, kp: T.handle, w: T.handle, o: T.handle):
        T.func_attr({"tirx.noalias": True})
        NTOK = T.int64()
        Y = T.match_buffer(y, (NTOK * TK, D), dtype)
        X = T.match_buffer(x, (NTOK, D), out_dtype)
        KEPT = T.match_buffer(kp, (NTOK * TK,), "int32")
        WT = T.match_buffer(w, (NTOK * TK,), "float32")
        O = T.match_buffer(o, (NTOK, D), out_dtype)
        with T.sblock("root"):
            body(Y, X, KEPT, WT, O, NTOK)

    # (without input_scaled the body reads none of x, kept, route_weight)
    combine = without_params(combine, ("y", "x", "kp", "w", "o"), () if input_scaled else ("x", "kp", "w"))
    name = f"pit_moe_combine_k{TK}_d{D}_{dtype}_{out_dtype}{'_input_scaled' if input_scaled else ''}"
    return combine.with_attrs({"global_symbol": name, "tirx.is_scheduled": True})
