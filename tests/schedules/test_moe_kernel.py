"""The Hopper grouped GEMM of the MoE layer (pit_tvm.schedules.hopper.grouped) on sm_90a.

CPU part: the kernels build for ``cuda:sm_90a`` in both modes with each epilogue and dtype and
nvcc compiles a few of them; the tile choice; bad arguments.  GPU part (``@pytest.mark.gpu``,
an H100 / H200): both modes against a numpy implementation of the contract
(docs/design/moe.md) over random routings with empty experts, all tokens on one expert, row
counts that are not multiples of 128, more experts than a warp, capacity-dropped assignments.
"""
from __future__ import annotations

import functools
import re
import zlib

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st

from pit_tvm.runtime.loader import numpy_dtype
from pit_tvm.nvcc import cuda_sources, find_nvcc, ptxas_log
from pit_tvm.schedules.hopper.config import WgmmaConfig
from pit_tvm.schedules.hopper.grouped import (GROUPED_ATTR, expected_pairs, glu_config, grouped_config,
                                              wgmma_grouped_gemm_func)
from pit_tvm.target import build

TARGET = "cuda:sm_90a"


@functools.lru_cache(maxsize=None)
def _exe(mode, k, n, num_experts, top_k, in_dtype="float16", out_dtype="float16", bias=False, activation=None,
         config=None, gate=False, glu=False):
    f = wgmma_grouped_gemm_func("glu" if glu else mode, k, n, num_experts, top_k, in_dtype, out_dtype, bias,
                                activation, config, gate)
    return build(tvm.IRModule({"main": f}), TARGET)


def _source(ex) -> str:
    return "\n".join(m.inspect_source("cuda") for m in ex.mod.imports)


# ---------------------------------------------------------------------------------------
# the contract in numpy
# ---------------------------------------------------------------------------------------
def route(num_tokens, num_experts, top_k, rng, experts=None):
    """``expert_ids[T, k]``: k distinct experts a token, drawn from ``experts`` (default all)"""
    pool = np.arange(num_experts) if experts is None else np.asarray(experts)
    return np.stack([rng.choice(pool, top_k, replace=False) for _ in range(num_tokens)]).astype(np.int32)


def expert_index(expert_ids, num_experts, capacity=None):
    """The contract's device index in numpy: ``offsets[E + 1]`` and ``assignments[T * k]`` (flat
    ids ``t * k + j`` grouped by expert, ascending within one; an expert keeps its first
    ``capacity``; tail -1)."""
    flat = expert_ids.reshape(-1)
    lists = [np.flatnonzero(flat == e)[:capacity] for e in range(num_experts)]
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int32)
    assignments = np.full(flat.size, -1, np.int32)
    assignments[: offsets[-1]] = np.concatenate(lists) if offsets[-1] else []
    return offsets, assignments


def _act(v, activation):
    if activation == "relu":
        return np.maximum(v, 0)
    if activation == "gelu":
        from math import erf
        return v * 0.5 * (1 + np.vectorize(erf)(v / np.sqrt(2)))
    if activation == "silu":
        return v / (1 + np.exp(-v))
    return v


def grouped_reference(mode, a, assignments, offsets, w, bias, route_weight, top_k, activation, gate=None):
    """The contract's grouped GEMM in float64: gather ``H[p] = act(X[a[p] // k] @ W[e] + b[e])``
    (times ``gate[p]`` where given), zero past offsets[E]; scatter ``Y[a[p]] = rw[a[p]] * act(H[p] @ W[e] + b[e])``, zero rows
    for the flat ids not listed."""
    num_experts, _, n = w.shape
    p_rows = assignments.shape[0]
    out = np.zeros((p_rows, n))
    for e in range(num_experts):
        rows = np.arange(offsets[e], offsets[e + 1])
        if not len(rows):
            continue
        ids = assignments[rows]
        x = a[ids // top_k] if mode == "gather" else a[rows]
        v = x.astype(np.float64) @ w[e].astype(np.float64)
        if bias is not None:
            v = v + bias[e].astype(np.float64)
        v = _act(v, activation)
        if mode == "gather":
            out[rows] = v if gate is None else v * gate[rows]
        else:
            out[ids] = route_weight[ids, None].astype(np.float64) * v
    return out


def run_grouped(mode, num_tokens, k, n, num_experts, top_k, expert_ids, *, capacity=None, in_dtype="float16",
                out_dtype="float16", bias=False, activation=None, config=None, seed=0, gate=False, glu=False):
    """Runs the kernel on the GPU; returns (got, want) as float64, every row of the output
    (initialised to a non-zero fill, so rows the kernel leaves unwritten show).  ``glu``: a
    second weight W3 (and bias b3), the reference ``act(X W1 + b1) * (X W3 + b3)``."""
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(in_dtype)
    offsets, assignments = expert_index(expert_ids, num_experts, capacity)
    p_rows = num_tokens * top_k
    a_rows = num_tokens if mode == "gather" else p_rows
    a = rng.standard_normal((a_rows, k)).astype(np.float32).astype(dt)
    w = (rng.standard_normal((num_experts, k, n)) / np.sqrt(k)).astype(np.float32).astype(dt)
    b = rng.standard_normal((num_experts, n)).astype(np.float32).astype(dt) if bias else None
    rw = rng.uniform(0.1, 1.0, p_rows).astype(np.float32)
    g = rng.standard_normal((p_rows, n)).astype(np.float32).astype(numpy_dtype(out_dtype)) if gate else None
    w3 = (rng.standard_normal((num_experts, k, n)) / np.sqrt(k)).astype(np.float32).astype(dt) if glu else None
    b3 = rng.standard_normal((num_experts, n)).astype(np.float32).astype(dt) if glu and bias else None
    dev = tvm.cuda()
    t = lambda x: tvm.runtime.tensor(x, dev)  # noqa: E731
    out = t(np.full((p_rows, n), 7.0, np.float32).astype(numpy_dtype(out_dtype)))
    args = ([t(a), t(assignments), t(offsets), t(w)] + ([t(w3)] if glu else []) + ([t(b)] if bias else [])
            + ([t(b3)] if glu and bias else []) + ([t(g)] if gate else []) + ([t(rw)] if mode == "scatter" else [])
            + [out])
    _exe(mode, k, n, num_experts, top_k, in_dtype, out_dtype, bias, activation, config, gate, glu)["main"](*args)
    f64 = lambda x: None if x is None else x.astype(np.float64)  # noqa: E731
    if glu:
        want = (grouped_reference(mode, f64(a), assignments, offsets, f64(w), f64(b), rw, top_k, activation)
                * grouped_reference(mode, f64(a), assignments, offsets, f64(w3), f64(b3), rw, top_k, None))
    else:
        want = grouped_reference(mode, f64(a), assignments, offsets, f64(w), f64(b), rw, top_k, activation, f64(g))
    return out.numpy().astype(np.float64), want, offsets, assignments


def _close(got, want, out_dtype, in_dtype):
    tol = 3e-2 if "bfloat16" in (in_dtype, out_dtype) else 1.5e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------
# CPU: builds, nvcc, configs, bad arguments
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,E,K,N,in_dtype,out_dtype,bias,act", [
    ("gather", 8, 256, 512, "float16", "float16", True, "silu"),
    ("gather", 64, 512, 768, "bfloat16", "bfloat16", False, "gelu"),
    ("gather", 256, 256, 256, "float16", "float32", True, "relu"),
    ("scatter", 8, 512, 256, "float16", "float16", True, None),
    ("scatter", 128, 256, 768, "bfloat16", "float32", False, None),
    ("scatter", 3, 192, 128, "float16", "bfloat16", True, "relu"),
])
def test_cuda_build(mode, E, K, N, in_dtype, out_dtype, bias, act):
    """Both modes build for sm_90a: the rows kernel's warp-specialized body (B by TMA over all
    experts' weights; gather's A rows by cp.async, scatter's A tile by TMA), the expert scan,
    the signature of the contract."""
    ex = _exe(mode, K, N, E, 2, in_dtype, out_dtype, bias, act)
    src = _source(ex)
    t = "bf16" if in_dtype == "bfloat16" else "f16"
    bn = grouped_config(N, E).block_n
    assert f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{t}.{t}" in src
    body = src[src.index('extern "C" __global__'):]
    assert "__launch_bounds__(384)" in body and "cp.async.bulk.tensor.2d" in src
    assert ("cp_async_cg" in body) == (mode == "gather")   # gather's A rows; scatter's A by TMA
    assert "__shfl_up_sync" in body                    # the expert tiles' scan
    signature = body.split(")", 2)[1]
    # assignments and offsets; scatter: the route weight (fp32); TMA maps of W (scatter: and A)
    assert signature.count("int* __restrict__") == 2
    assert signature.count("float* __restrict__") == (1 if mode == "scatter" else 0) + (out_dtype == "float32")
    assert signature.count("CUtensorMap") == (2 if mode == "scatter" else 1)
    assert "atomic" not in body     # (scatter marks its listed ids in shared flags by plain stores)
    if act == "silu":
        assert "__expf" in body


def test_signature_and_attr():
    """The parameters of each variant (bias and route weight only where taken) and the attr
    naming the kernel's mode and tiles."""
    f = wgmma_grouped_gemm_func("gather", 256, 512, 8, 2, "float16", "float16", True, "relu")
    assert len(f.params) == 6      # x, assignments, offsets, w, bias, h
    assert f.attrs[GROUPED_ATTR]["num_experts"] == 8 and f.attrs[GROUPED_ATTR]["mode"] == "gather"
    g = wgmma_grouped_gemm_func("scatter", 256, 512, 8, 2)
    assert len(g.params) == 6      # h, assignments, offsets, w, route_weight, y
    # a name of its own per variant (the op adds each kernel to its module once, by name)
    gated = wgmma_grouped_gemm_func("gather", 256, 512, 8, 2, "float16", "float16", True, None, gate=True)
    assert len(gated.params) == 7  # x, assignments, offsets, w, bias, gate, h
    assert gated.attrs[GROUPED_ATTR]["gate"] and not f.attrs[GROUPED_ATTR]["gate"]
    glu = wgmma_grouped_gemm_func("glu", 256, 512, 8, 2, "float16", "float16", True, "silu")
    assert len(glu.params) == 8    # x, assignments, offsets, w1, w3, b1, b3, h
    assert glu.attrs[GROUPED_ATTR]["glu"] and not gated.attrs[GROUPED_ATTR]["glu"]
    names = {str(h.attrs["global_symbol"])
             for h in (f, g, gated, glu, wgmma_grouped_gemm_func("gather", 256, 512, 8, 2))}
    assert len(names) == 5 and all(name.startswith("wgmma_grouped_") for name in names)


#: the kernels ptxas checks: each mode at a Switch layer's shapes, the decode tiles
_PTXAS_CASES = {
    "gather_bias_silu": lambda: wgmma_grouped_gemm_func("gather", 768, 3072, 8, 2, "float16", "float16", True, "silu"),
    "scatter_bias": lambda: wgmma_grouped_gemm_func("scatter", 3072, 768, 8, 2, "float16", "float16", True, None),
    "gather_gated_bf16": lambda: wgmma_grouped_gemm_func("gather", 2048, 1408, 64, 6, "bfloat16", "bfloat16", False,
                                                         None, grouped_config(1408, 64, 6), gate=True),
    "gather_glu_bf16": lambda: wgmma_grouped_gemm_func("glu", 2048, 1408, 64, 6, "bfloat16", "bfloat16", False,
                                                       "silu", glu_config(1408, 64, 6, tokens=4096)),
    "gather_glu_bias_fp16": lambda: wgmma_grouped_gemm_func("glu", 4096, 14336, 8, 2, "float16", "float16", True,
                                                            "gelu"),
    "scatter_decode_bf16_f32": lambda: wgmma_grouped_gemm_func("scatter", 3072, 768, 8, 1, "bfloat16", "float32",
                                                               False, None, grouped_config(768, 8, 1, tokens=16)),
}


@pytest.mark.parametrize("case", sorted(_PTXAS_CASES))
def test_ptxas_keeps_wgmma_async(case):
    """nvcc compiles the kernels for sm_90a, and ptxas keeps the wgmmas asynchronous (no
    C7515 serialisation).  Spills stay within a few words (the gather kernels spill 4 to 32
    bytes at the 168 registers a thread of 384: docs/design/moe.md)."""
    assert grouped_config(768, 8, 1, tokens=16) == WgmmaConfig(64, 8)
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    ex = build(tvm.IRModule({"main": _PTXAS_CASES[case]()}), TARGET)
    log = ptxas_log(cuda_sources(ex)[0], "sm_90a")
    assert "Used" in log and "registers" in log, log[-2000:]
    assert "C7515" not in log and "serialized" not in log, log[-2000:]
    spilled = re.search(r"\b(\d+) bytes spill stores", log)
    # (the glu kernels: none, their loader's registers handed to the consumers)
    assert spilled and int(spilled.group(1)) <= (0 if "glu" in case else 64), log[-2000:]


def test_grouped_config():
    """Many tokens: the widest tile; decode-size T: about one pair an expert, tiles narrowed
    until the experts' N tiles fill the GPU (the weight-read-bound case)."""
    assert grouped_config(3072, 64) == WgmmaConfig(256, 4)
    assert expected_pairs(8, 2, 16) == 8              # 32 rows: ~8 receiving experts, a tile each
    assert expected_pairs(8, 2, 4096) == 64 + 4       # 8192 rows: 64 tiles, half a tile more an expert
    assert grouped_config(768, 8, 1, tokens=16).block_n == 64
    # Mixtral fc1 at decode: 56 N tiles of 256 over 8 experts already fill the SMs
    assert grouped_config(14336, 8, 2, tokens=16).block_n == 256
    assert grouped_config(768, 128, 1, tokens=16384).block_n >= 128
    # the glu kernel (2 N accumulator columns): halves of whole 64-column atoms
    assert glu_config(1408, 64, 6, tokens=4096).block_n == 256          # 11 tiles of 128 columns of H
    assert glu_config(704, 8, 2).block_n == 128                          # 1408 = 11 x 128
    assert glu_config(768, 8, 1, tokens=16).block_n == 128               # the planner's 64 or 192, widened
    assert glu_config(96, 8, 1) is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="rows"), "mode"),
    (dict(activation="swiglu"), "activation"),
    (dict(num_experts=257), "experts"),
    (dict(num_experts=0), "experts"),
    (dict(top_k=9), "top_k"),
    (dict(k=100), "K % 64"),
    (dict(n=96), "N % block_n"),
    (dict(in_dtype="float32"), "wgmma takes"),
    (dict(config=WgmmaConfig(256, 4, 32)), "block_k"),
    (dict(config=WgmmaConfig(256, 8)), "shared memory"),
    (dict(mode="scatter", gate=True), "gate"),
    (dict(mode="glu", gate=True), "gate"),
    (dict(mode="glu", config=WgmmaConfig(192, 4)), "glu"),
    (dict(mode="glu", n=96), "N % block_n"),
])
def test_bad_arguments_raise(kwargs, match):
    args = dict(mode="gather", k=256, n=512, num_experts=8, top_k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        wgmma_grouped_gemm_func(**args)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 700), min_size=1, max_size=256), st.integers(0, 2000))
def test_spare_ctas_cover_unwritten_rows(counts, dropped):
    """The grid's bound (:func:`pair_grid`, docs/design/moe.md): for any expert row counts and
    dropped rows, the (expert, tile) pairs fit the ``max(ceil(P / 128) + min(E, P), 1)`` CTAs
    of an N tile, and the CTAs past them are enough for gather's zero rows ``P - offsets[E]``
    at 128 a CTA (scatter's zero rows need one CTA past them when any row is dropped)."""
    E, listed = len(counts), sum(counts)
    P = listed + dropped
    pairs = sum(-(-c // 128) for c in counts)
    grid = max(-(-P // 128) + min(E, P), 1)
    assert pairs <= grid
    assert (grid - pairs) * 128 >= P - listed


def test_reference_index_follows_contract():
    """The numpy index: grouped by expert, ascending flat ids within one, capacity keeps the
    first ones in token order, tail -1 (the layout the GPU tests feed the kernel)."""
    ids = np.array([[1, 0], [1, 2], [0, 1], [1, 0]], np.int32)
    offsets, assignments = expert_index(ids, 4, capacity=2)
    assert offsets.tolist() == [0, 2, 4, 5, 5]
    assert assignments.tolist() == [1, 4, 0, 2, 3, -1, -1, -1]


# ---------------------------------------------------------------------------------------
# GPU: numerics against the contract
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["gather", "scatter"])
@pytest.mark.parametrize("case", ["uniform", "empty_experts", "one_expert", "tail", "many_experts", "dropped"])
def test_gpu_grouped(mode, case):
    """Both modes on the routings that stress the expert tiles: random (77 tokens, 2 of 8
    experts: no row count a multiple of 128), half the experts empty, every token on one
    expert (its 300 rows in 3 tiles), 1 token, 256 experts (the scan across 8 warps), and
    capacity-dropped assignments (gather: zero rows past offsets[E]; scatter: zero rows at the
    dropped flat ids).  Every output row is checked, unwritten ones included."""
    rng = np.random.default_rng(zlib.crc32(f"{mode}/{case}".encode()))
    k, n, E, top_k, T, capacity, experts = 256, 512, 8, 2, 77, None, None
    if case == "empty_experts":
        T, experts = 200, [1, 4, 6]
    elif case == "one_expert":
        T, top_k, experts = 300, 1, [5]
    elif case == "tail":
        T = 1
    elif case == "many_experts":
        T, E, top_k, k, n = 1000, 256, 2, 128, 256
    elif case == "dropped":
        T, capacity = 500, 90
    expert_ids = route(T, E, top_k, rng, experts)
    got, want, offsets, assignments = run_grouped(mode, T, k, n, E, top_k, expert_ids, capacity=capacity,
                                                  bias=True, activation="relu" if mode == "gather" else None)
    if case == "dropped":
        assert offsets[-1] < T * top_k
    _close(got, want, "float16", "float16")
    if mode == "gather":
        assert np.all(got[offsets[-1]:] == 0)
    else:
        unlisted = np.setdiff1d(np.arange(T * top_k), assignments[: offsets[-1]])
        assert np.all(got[unlisted] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["gather", "scatter"])
@pytest.mark.parametrize("in_dtype,out_dtype,activation,bias", [
    ("bfloat16", "bfloat16", "silu", True),
    ("float16", "float32", "gelu", False),
    ("bfloat16", "float32", None, True),
])
def test_gpu_grouped_epilogues(mode, in_dtype, out_dtype, activation, bias):
    """Each epilogue and dtype pair, 64 experts (the scan across 2 warps), K = 512, N = 768
    (three 256-column tiles)."""
    rng = np.random.default_rng(7)
    T, E, top_k = 600, 64, 2
    expert_ids = route(T, E, top_k, rng)
    got, want, _, _ = run_grouped(mode, T, 512, 768, E, top_k, expert_ids, in_dtype=in_dtype, out_dtype=out_dtype,
                                  bias=bias, activation=activation)
    _close(got, want, out_dtype, in_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype,out_dtype,bias,case", [
    ("bfloat16", "bfloat16", False, "uniform"),
    ("float16", "float16", True, "dropped"),
    ("float16", "float32", True, "uniform"),
])
def test_gpu_grouped_gated(in_dtype, out_dtype, bias, case):
    """The gate epilogue (a gated FFN's up half times its gate half, element by element in the
    output dtype): every listed row against the contract, the rows past offsets[E] zero."""
    rng = np.random.default_rng(23)
    T, E, top_k = 700, 64, 6
    expert_ids = route(T, E, top_k, rng)
    got, want, offsets, _ = run_grouped("gather", T, 512, 768, E, top_k, expert_ids, in_dtype=in_dtype,
                                        out_dtype=out_dtype, bias=bias, gate=True,
                                        capacity=40 if case == "dropped" else None)
    _close(got, want, out_dtype, in_dtype)
    assert np.all(got[offsets[-1]:] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype,out_dtype,bias,activation,n,case", [
    ("bfloat16", "bfloat16", False, "silu", 768, "uniform"),
    ("float16", "float16", True, "gelu", 704, "dropped"),
    ("float16", "float32", True, "silu", 256, "tail"),
    ("float16", "float16", False, None, 768, "long_k"),
])
def test_gpu_grouped_glu(in_dtype, out_dtype, bias, activation, n, case):
    """Both halves of a gated FFN in one kernel (glu): W1's half activated times W3's, in fp32,
    rounded once; 256- and 128-column tiles (128 / 64 columns of H), every row against the
    contract, the rows past offsets[E] zero.  ``long_k``: K 2048 with an
    fp16 output and no bias, where the halves rounded and multiplied in fp16 lost the last K
    tile's products."""
    rng = np.random.default_rng(zlib.crc32(f"glu/{case}".encode()))
    T, E, top_k, capacity = (700, 64, 6, None) if case == "uniform" else (300, 8, 2, 40 if case == "dropped" else None)
    if case == "tail":
        T = 1
    expert_ids = route(T, E, top_k, rng)
    got, want, offsets, _ = run_grouped("gather", T, 2048 if case == "long_k" else 512, n, E, top_k, expert_ids,
                                        in_dtype=in_dtype, out_dtype=out_dtype, bias=bias, activation=activation,
                                        glu=True, capacity=capacity, config=glu_config(n, E, top_k, T))
    _close(got, want, out_dtype, in_dtype)
    assert np.all(got[offsets[-1]:] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["gather", "scatter"])
@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_gpu_grouped_decode_config(mode, tokens):
    """The decode tiles of :func:`grouped_config` (narrow tiles, deeper ring) at T <= 256."""
    rng = np.random.default_rng(tokens)
    E, top_k, k, n = 8, 2, 1024, 768
    config = grouped_config(n, E, top_k, tokens=tokens)
    expert_ids = route(tokens, E, top_k, rng)
    got, want, _, _ = run_grouped(mode, tokens, k, n, E, top_k, expert_ids, config=config, bias=True)
    _close(got, want, "float16", "float16")


@pytest.mark.gpu
@pytest.mark.parametrize("skew", [False, True])
def test_gpu_grouped_fc1_fc2_chain(skew):
    """fc1 (gather, SiLU) then fc2 (scatter) then the combine ``y[t] = sum_j Y[t*k + j]``
    against the layer in numpy: the two modes agree on the compact row order.  Skewed: Zipf
    routing over 16 experts."""
    rng = np.random.default_rng(11)
    T, E, top_k, d, f = 333, 16, 2, 256, 512
    if skew:
        probs = 1.0 / np.arange(1, E + 1) ** 1.5
        probs /= probs.sum()
        expert_ids = np.stack([rng.choice(E, top_k, replace=False, p=probs) for _ in range(T)]).astype(np.int32)
    else:
        expert_ids = route(T, E, top_k, rng)
    offsets, assignments = expert_index(expert_ids, E)
    x = rng.standard_normal((T, d)).astype(np.float16)
    w1 = (rng.standard_normal((E, d, f)) / np.sqrt(d)).astype(np.float16)
    w2 = (rng.standard_normal((E, f, d)) / np.sqrt(f)).astype(np.float16)
    rw = rng.uniform(0.1, 1.0, T * top_k).astype(np.float32)
    dev = tvm.cuda()
    t = lambda v: tvm.runtime.tensor(v, dev)  # noqa: E731
    h = t(np.zeros((T * top_k, f), np.float16))
    y = t(np.zeros((T * top_k, d), np.float16))
    _exe("gather", d, f, E, top_k, activation="silu")["main"](t(x), t(assignments), t(offsets), t(w1), h)
    _exe("scatter", f, d, E, top_k)["main"](h, t(assignments), t(offsets), t(w2), t(rw), y)
    got = y.numpy().astype(np.float64).reshape(T, top_k, d).sum(1)
    want = np.zeros((T, d))
    for tok in range(T):
        for j in range(top_k):
            e = expert_ids[tok, j]
            hv = _act(x[tok].astype(np.float64) @ w1[e].astype(np.float64), "silu").astype(np.float16)
            want[tok] += rw[tok * top_k + j] * (hv.astype(np.float64) @ w2[e].astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)
