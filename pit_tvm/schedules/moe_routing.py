"""The small kernels around the MoE op's grouped GEMMs: routing and the combine over k.

* :func:`routing_func`: ``router[T, E]`` -> ``expert_ids[T, k]`` (int32) and ``route_weight[T*k]``
  (fp32), in fp32: the softmax over E (unless the router holds probabilities), k selection
  passes (ties go to the lower expert id, as ``torch.topk`` / ``argmax`` on CPU do), then the
  routing weights of the spec.  Deterministic, no sort.  On the GPU a warp a token (lane l
  holds experts l, l + 32, ...: coalesced reads, butterfly shuffles for the max, the sum and
  each selection); on the CPU a token an iteration of a parallel loop.
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
#: tokens a CUDA block of the routing kernel (a warp each)
ROUTING_WARPS = 4


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
    def weights_and_store(IDS, WT, t, vals, sel, st):
        # the k selected values (st: the softmax's max and sum over E) -> the spec's weights
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
        weights_and_store(IDS, WT, t, vals, sel, st)

    # GPU: experts lane, lane + 32, ... of a token in lane `lane`'s registers (PER of them)
    PER = (E + 31) // 32
    full = T.uint32(0xFFFFFFFF)

    @T.macro
    def route_token_warp(R, IDS, WT, t, lane):
        v = T.alloc_buffer((PER,), "float32", scope="local")
        taken = T.alloc_buffer((PER,), "int32", scope="local")     # 1: selected, or no expert
        vals = T.alloc_buffer((TK,), "float32", scope="local")
        sel = T.alloc_buffer((TK,), "int32", scope="local")
        st = T.alloc_buffer((2,), "float32", scope="local")       # max, sum (the whole warp's)
        best = T.alloc_buffer((1,), "float32", scope="local")     # a selection's value, expert
        best_e = T.alloc_buffer((1,), "int32", scope="local")
        other = T.alloc_buffer((1,), "float32", scope="local")
        other_e = T.alloc_buffer((1,), "int32", scope="local")
        for i in T.unroll(PER):
            if lane + 32 * i < E:
                v[i] = T.Cast("float32", R[t, lane + 32 * i])
                taken[i] = 0
            else:
                v[i] = T.min_value("float32")
                taken[i] = 1
        if softmax_over_e:
            st[0] = v[0]
            for i in T.unroll(PER):
                st[0] = T.max(st[0], v[i])
            for s in T.unroll(5):
                st[0] = T.max(st[0], T.cuda.__shfl_xor_sync(full, st[0], T.shift_right(16, s), 32))
            st[1] = T.float32(0)
            for i in T.unroll(PER):
                if taken[i] == 0:
                    st[1] = st[1] + T.exp(v[i] - st[0])
            for s in T.unroll(5):
                st[1] = st[1] + T.cuda.__shfl_xor_sync(full, st[1], T.shift_right(16, s), 32)
        for j in range(TK):
            # the lane's best untaken expert (the lower on ties), then the warp's (E: none)
            best[0] = T.min_value("float32")
            best_e[0] = E
            for i in T.unroll(PER):
                if taken[i] == 0:
                    if T.Or(best_e[0] == E, v[i] > best[0]):
                        best[0] = v[i]
                        best_e[0] = lane + 32 * i
            for s in T.unroll(5):
                other[0] = T.cuda.__shfl_xor_sync(full, best[0], T.shift_right(16, s), 32)
                other_e[0] = T.cuda.__shfl_xor_sync(full, best_e[0], T.shift_right(16, s), 32)
                if other_e[0] < E:
                    if T.Or(best_e[0] == E, T.Or(other[0] > best[0],
                                                 T.And(other[0] == best[0], other_e[0] < best_e[0]))):
                        best[0] = other[0]
                        best_e[0] = other_e[0]
            sel[j] = best_e[0]
            vals[j] = best[0]
            for i in T.unroll(PER):
                if lane + 32 * i == best_e[0]:
                    taken[i] = 1
        if lane == 0:
            weights_and_store(IDS, WT, t, vals, sel, st)

    if gpu:
        @T.macro
        def each_token(R, IDS, WT, NTOK):
            for bx in T.thread_binding((NTOK + (ROUTING_WARPS - 1)) // ROUTING_WARPS, thread="blockIdx.x"):
                for ty in T.thread_binding(ROUTING_WARPS, thread="threadIdx.y"):
                    for lane in T.thread_binding(32, thread="threadIdx.x"):
                        if bx * ROUTING_WARPS + ty < NTOK:
                            route_token_warp(R, IDS, WT, bx * ROUTING_WARPS + ty, lane)
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
