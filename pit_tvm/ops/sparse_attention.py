"""Block-sparse attention whose pattern is data known only at run time (issue 36).

Kept as one module: the pattern (:class:`AttentionPattern`), its numpy reference, the generic TIR
kernel, the Relax emitter and :class:`SparseAttention` all read the same pattern inputs and block
sizes; the Hopper kernel lives in :mod:`pit_tvm.schedules.hopper.sparse_attention`.

``o = softmax(q k^T * scale + bias, restricted to the allowed keys) v`` for q ``[B, H, Sq, d]``,
k / v ``[B, H, Sk, d]``.  Which (query, key) pairs are allowed is described by an
:class:`AttentionPattern` (its compile-time structure) plus run-time tensors:

* ``mask`` ``[B, 1 or H, Sq, Sk]``: boolean (True = allowed) or additive (a float added to the
  score; an entry ``<= MASK_THRESHOLD`` (-1e4, so ``-inf``, ``finfo.min``, ``-1e9`` and BERT's
  ``-10000``) means *disallowed*, the others are added to the allowed scores);
* ``global_flags`` ``[B, S]`` int32 (non-zero: a global token) with a ``window``: a global query
  row attends to every key and every row attends to the global keys;
* ``doc_ids`` ``[B, S]`` int32: a key is allowed only within its query's document (packed
  sequences);
* ``causal``: key ``k`` allowed for query ``q`` only when ``k <= q`` (top-left aligned, as
  PyTorch's ``is_causal``).

A query row with no allowed key yields 0 (docs/guide/semantics.md).  On the device a block index
(:mod:`pit_tvm.index.attention`) lists, per (batch, head group, 128-query block), the key blocks
with an allowed entry and whether each needs the element predicate; the kernel iterates only
those (PIT's SRead along the permutation-invariant key axis).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.schedules.signature import without_params

__all__ = [
    "AttentionPattern",
    "MASK_THRESHOLD",
    "QUERY_BLOCK",
    "KEY_BLOCKS",
    "pattern_predicate",
    "pattern_score_bias",
    "pattern_inputs",
    "reference_sparse_attention",
    "reference_allowed",
    "sparse_attention_func",
    "emit_sparse_attention",
    "SparseAttention",
    "sparse_attention",
]

#: an additive mask entry at or below this value disallows its (query, key) pair
MASK_THRESHOLD = -1.0e4
#: query rows per index entry (and per tile of the kernels)
QUERY_BLOCK = 128
#: key rows per listed key block that the index and kernels support
KEY_BLOCKS = (64, 128)
MASK_KINDS = (None, "bool", "additive")
ATTENTION_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class AttentionPattern:
    """The compile-time structure of a run-time attention pattern.

    ``mask``: None, ``"bool"`` or ``"additive"`` (a ``[B, 1 or H, Sq, Sk]`` run-time input);
    ``causal``: keys after the query are disallowed; ``window``: ``|q - k| <= window`` allowed
    (None: no window); ``global_tokens``: a run-time ``global_flags[B, S]`` int32 input, a global
    query row attends to every key and every row to the global keys (with ``window``; without
    one a global flag widens nothing); ``documents``: a run-time ``doc_ids[B, S]`` int32 input,
    keys allowed only within the query's document.

    allowed(b, h, q, k) = mask_ok AND causal_ok AND doc_ok AND window_or_global_ok.
    """

    mask: str | None = None
    causal: bool = False
    window: int | None = None
    global_tokens: bool = False
    documents: bool = False

    def __post_init__(self):
        if self.mask not in MASK_KINDS:
            raise ValueError(f"AttentionPattern.mask must be None, 'bool' or 'additive', got {self.mask!r}")
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, (int, np.integer))
                                        or self.window < 0):
            raise ValueError(f"AttentionPattern.window must be None or an int >= 0, got {self.window!r}")
        if self.global_tokens and self.window is None:
            warnings.warn("AttentionPattern: global_tokens without a window widens nothing "
                          "(global tokens only add keys outside the window)", stacklevel=3)
        if self.window is not None:
            object.__setattr__(self, "window", int(self.window))

    @property
    def inputs(self) -> tuple[str, ...]:
        """The run-time pattern inputs in the order the kernels take them."""
        return pattern_inputs(self)

    @property
    def tag(self) -> str:
        """A short name for kernel symbols: ``m-bool_c_w256_g_d``."""
        parts = [f"m{self.mask}" if self.mask else "nomask"]
        if self.causal:
            parts.append("c")
        if self.window is not None:
            parts.append(f"w{self.window}")
        if self.global_tokens:
            parts.append("g")
        if self.documents:
            parts.append("d")
        return "_".join(parts)


def pattern_inputs(pattern: AttentionPattern) -> tuple[str, ...]:
    """``("mask", "global_flags", "doc_ids")``, those the pattern has, in that order."""
    names = []
    if pattern.mask is not None:
        names.append("mask")
    if pattern.global_tokens:
        names.append("global_flags")
    if pattern.documents:
        names.append("doc_ids")
    return tuple(names)


def splits_global_rows(pattern: AttentionPattern) -> bool:
    """Whether the Hopper kernel takes this pattern's global tokens apart (PIT's SRead along both
    axes): the global query rows as their own dense query tiles (gathered rows against every
    key) and the global keys as gathered key blocks, so that neither widens the window's key
    blocks.  Window + global tokens (with or without documents) without a mask or causal:
    Longformer's pattern, and a padded batch of it (the padding as documents)."""
    return pattern.global_tokens and pattern.window is not None and pattern.mask is None and not pattern.causal


def sequence_lengths(pattern: AttentionPattern, Sq, Sk, S):
    """The (query, key) lengths of the kernels' signatures: ``(S, S)`` for a pattern with
    global flags or document ids (``[B, S]`` inputs: self-attention), else ``(Sq, Sk)``."""
    return (S, S) if pattern.global_tokens or pattern.documents else (Sq, Sk)


def pattern_params_dropped(pattern: AttentionPattern) -> tuple[str, ...]:
    """The parameters of the kernels' one signature (:func:`sparse_attention_func`, the block
    index) that ``pattern`` lacks, of ``m, x, y``: the mask, the first and the second pattern
    description (global flags, document ids)."""
    n_mask = int(pattern.mask is not None)
    return ("m",)[n_mask:] + ("x", "y")[len(pattern.inputs) - n_mask:]


def pattern_signature_buffers(pattern: AttentionPattern, M, X, Y) -> tuple:
    """The buffers of those parameters that ``pattern`` has, in :func:`pattern_inputs` order."""
    n_mask = int(pattern.mask is not None)
    return (M,)[:n_mask] + (X, Y)[:len(pattern.inputs) - n_mask]


def _buffers_by_name(pattern, buffers) -> dict:
    if isinstance(buffers, dict):
        found = dict(buffers)
    else:
        found = dict(zip(pattern_inputs(pattern), buffers))
    missing = [n for n in pattern_inputs(pattern) if n not in found]
    if missing:
        raise ValueError(f"pattern {pattern.tag} needs the buffers {missing}")
    return found


def mask_head(mask_buf, h):
    """the mask's head read for head ``h``: its head dim is 1 or H, so min(h, MH - 1) reads head 0
    of a shared mask, head h else"""
    return T.min(T.Cast("int64", h), T.Cast("int64", mask_buf.shape[1]) - T.int64(1))


def _mask_value(mask_buf, b, h, q, k):
    return mask_buf[b, mask_head(mask_buf, h), q, k]


def pattern_predicate(pattern: AttentionPattern, buffers, b, h, q, k, mask_value=None):
    """TIR boolean: is key ``k`` allowed for query ``q`` of batch ``b``, head ``h``.

    ``buffers``: ``{"mask": ..., "global_flags": ..., "doc_ids": ...}`` (those the pattern has)
    or a sequence of them in :func:`pattern_inputs` order.  ``h`` indexes heads (0..H-1); a mask
    with one head group is read at head 0.  Bounds (``q < Sq``, ``k < Sk``) are the caller's.
    ``mask_value``: the mask's entry at the pair when the caller has loaded it already (a bool
    expression for a boolean mask; e.g. from a vector load of a row), else it is read here.
    """
    bufs = _buffers_by_name(pattern, buffers)
    if pattern.mask is not None and mask_value is None:
        mask_value = _mask_value(bufs["mask"], b, h, q, k)
    conds = []
    if pattern.mask == "bool":
        conds.append(mask_value)
    elif pattern.mask == "additive":
        conds.append(T.Cast("float32", mask_value) > T.float32(MASK_THRESHOLD))
    if pattern.causal:
        conds.append(k <= q)
    if pattern.documents:
        doc = bufs["doc_ids"]
        conds.append(doc[b, q] == doc[b, k])
    if pattern.window is not None:
        near = T.And(k <= q + pattern.window, q <= k + pattern.window)
        if pattern.global_tokens:
            g = bufs["global_flags"]
            near = T.Or(near, T.Or(g[b, k] != 0, g[b, q] != 0))
        conds.append(near)
    if not conds:
        return tirx.const(True, "bool")
    out = conds[0]
    for c in conds[1:]:
        out = T.And(out, c)
    return out


def pattern_score_bias(pattern: AttentionPattern, buffers, b, h, q, k):
    """float32 TIR value added to the score of an allowed (q, k): the additive mask's entry,
    else 0.  The index marks a block partial wherever this is non-zero, so a kernel adds it
    only in partial blocks."""
    if pattern.mask != "additive":
        return T.float32(0)
    return T.Cast("float32", _mask_value(_buffers_by_name(pattern, buffers)["mask"], b, h, q, k))


# --------------------------------------------------------------------------- numpy reference
def reference_allowed(pattern: AttentionPattern, batch: int, heads: int, sq: int, sk: int, *,
                      mask=None, global_flags=None, doc_ids=None) -> np.ndarray:
    """bool ``[B, 1 or H, Sq, Sk]`` of the element predicate (numpy)."""
    allowed = np.ones((batch, 1, sq, sk), dtype=bool)
    qi = np.arange(sq)[:, None]
    ki = np.arange(sk)[None, :]
    if pattern.mask == "bool":
        allowed = allowed & np.asarray(mask).astype(bool)
    elif pattern.mask == "additive":
        allowed = allowed & (np.asarray(mask).astype(np.float32) > np.float32(MASK_THRESHOLD))
    if pattern.causal:
        allowed = allowed & (ki <= qi)[None, None]
    if pattern.documents:
        d = np.asarray(doc_ids)
        allowed = allowed & (d[:, :sq, None] == d[:, None, :sk])[:, None]
    if pattern.window is not None:
        near = np.broadcast_to((np.abs(qi - ki) <= pattern.window)[None, None], (batch, 1, sq, sk))
        if pattern.global_tokens:
            g = np.asarray(global_flags) != 0
            near = near | g[:, None, None, :sk] | g[:, None, :sq, None]
        allowed = allowed & near
    return allowed


def reference_sparse_attention(q, k, v, pattern: AttentionPattern, *, mask=None, global_flags=None,
                               doc_ids=None, scale=None) -> np.ndarray:
    """numpy fp64 reference of the op: masked softmax attention, rows with no allowed key -> 0."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    allowed = reference_allowed(pattern, B, H, Sq, Sk, mask=mask, global_flags=global_flags, doc_ids=doc_ids)
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if pattern.mask == "additive":
        scores = scores + np.where(allowed, np.asarray(mask).astype(np.float64), 0.0)
    allowed = np.broadcast_to(allowed, scores.shape)
    scores = np.where(allowed, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.where(allowed, np.exp(scores - row_max), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    out = np.einsum("bhqk,bhkd->bhqd", p, v)
    return np.where(denom > 0, out / np.where(denom > 0, denom, 1.0), 0.0)


# --------------------------------------------------------------------------- generic kernel
def _vector_width(d: int) -> int:
    for w in (8, 4, 2):
        if d % w == 0:
            return w
    return 1


def sparse_attention_func(head_dim: int, pattern: AttentionPattern, in_dtype: str, target, *,
                          key_block: int = 64, scale: float | None = None, mask_dtype: str | None = None
                          ) -> tirx.PrimFunc:
    """The generic kernel (any target): PrimFunc ``(q[B, H, Sq, d], k[B, H, Sk, d], v[B, H, Sk, d],
    block_counts, block_ids, block_partial, <mask, global_flags, doc_ids as present>,
    o[B, H, Sq, d])``, the Hopper kernel's signature (contracts/ATTENTION.md).

    One task per (b, h, 128-query block) (a CUDA block of 128 threads, a row each; a parallel
    task on the CPU, its rows in turn).  A row walks only the listed key blocks: per block it
    scores the keys (the element predicate and the additive mask only in partial blocks),
    then one online-softmax step (rescale by the new running max, accumulate ``p v``), fp32
    throughout; a row with no allowed key writes 0.  B, H, Sq, Sk and the mask's head dim are
    symbolic; the dot products and the ``p v`` updates are vectorised over d on the CPU."""
    from pit_tvm.index.attention import check_kernel_args

    D = int(head_dim)
    if D <= 0:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    check_kernel_args(pattern, key_block, in_dtype, mask_dtype)
    from pit_tvm.target import is_gpu, make_target

    target = make_target(target)
    gpu = is_gpu(target)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    QBL, KBL = QUERY_BLOCK, key_block
    VW = 1 if gpu else _vector_width(D)
    ND = D // VW
    vec = T.unroll if gpu else T.vectorized
    BX = (lambda n: T.thread_binding(n, thread="blockIdx.x")) if gpu else T.parallel
    TX = (lambda n: T.thread_binding(n, thread="threadIdx.x")) if gpu else T.serial
    NEG = -3.0e38          # "no score": below any finite score, and exp(NEG - finite) == 0
    has_bias = pattern.mask == "additive"

    @T.macro
    def body(Q, K, V, CNT, IDS, PART, bufs, O, B, H, HG, Sq, Sk, QB):
        for t in BX(B * H * QB):
            for r in TX(QBL):
                if t % QB * QBL + r < Sq:
                    qv = T.alloc_buffer((D,), "float32", scope="local")
                    acc = T.alloc_buffer((D,), "float32", scope="local")
                    sc = T.alloc_buffer((KBL,), "float32", scope="local")
                    part = T.alloc_buffer((VW,), "float32", scope="local")
                    st = T.alloc_buffer((4,), "float32", scope="local")   # running max, sum; block max; alpha
                    for d0 in range(ND):
                        for e in vec(VW):
                            qv[d0 * VW + e] = T.Cast("float32", Q[t // (H * QB), t // QB % H, t % QB * QBL + r,
                                                                  d0 * VW + e]) * T.float32(scale)
                            acc[d0 * VW + e] = T.float32(0)
                    st[0] = T.float32(NEG)
                    st[1] = T.float32(0)
                    for j in range((Sk + (KBL - 1)) // KBL):
                        if j < T.Cast("int64", CNT[t // (H * QB), T.min(t // QB % H, HG - 1), t % QB]):
                            st[2] = T.float32(NEG)
                            for c in range(KBL):
                                sc[c] = T.float32(NEG)
                                if T.Cast("int64", IDS[t // (H * QB), T.min(t // QB % H, HG - 1), t % QB, j]) * KBL + c < Sk:
                                    if (PART[t // (H * QB), T.min(t // QB % H, HG - 1), t % QB, j] == 0
                                            or pattern_predicate(pattern, bufs, t // (H * QB), t // QB % H,
                                                                 t % QB * QBL + r,
                                                                 T.Cast("int64", IDS[t // (H * QB), T.min(t // QB % H, HG - 1), t % QB, j]) * KBL + c)):
                                        for e in vec(VW):
                                            part[e] = T.float32(0)
                                        for d0 in range(ND):
                                            for e in vec(VW):
                                                part[e] = part[e] + qv[d0 * VW + e] * T.Cast(
                                                    "float32", K[t // (H * QB), t // QB % H,
                                                                 T.Cast("int64", IDS[t // (H * QB), T.min(t // QB % H, HG - 1), t % QB, j]) * KBL + c,
                                                                 d0 * VW + e])
                                        sc[c] = T.float32(0)
                                        for e in range(VW):
                                            sc[c] = sc[c] + part[e]
                                        if has_bias:
                                            if PART[t // (H * QB), T.min(t // QB % H, HG - 1), t % QB, j] != 0:
                                                sc[c] = sc[c] + pattern_score_bias(
                                                    pattern, bufs, t // (H * QB), t // QB % H, t % QB * QBL + r,
                                                    T.Cast("int64", IDS[t // (H * QB), T.min(t // QB % H, HG - 1), t % QB, j]) * KBL + c)
                                        st[2] = T.max(st[2], sc[c])
                            if st[2] > T.float32(NEG):
                                # one online-softmax step for the block
                                st[3] = T.exp(st[0] - T.max(st[0], st[2]))
                                st[0] = T.max(st[0], st[2])
                                st[1] = st[1] * st[3]
                                for d0 in range(ND):
                                    for e in vec(VW):
                                        acc[d0 * VW + e] = acc[d0 * VW + e] * st[3]
                                for c in range(KBL):
                                    if sc[c] > T.float32(NEG):
                                        sc[c] = T.exp(sc[c] - st[0])
                                        st[1] = st[1] + sc[c]
                                        for d0 in range(ND):
                                            for e in vec(VW):
                                                acc[d0 * VW + e] = acc[d0 * VW + e] + sc[c] * T.Cast(
                                                    "float32", V[t // (H * QB), t // QB % H,
                                                                 T.Cast("int64", IDS[t // (H * QB), T.min(t // QB % H, HG - 1), t % QB, j]) * KBL + c,
                                                                 d0 * VW + e])
                    if st[1] > T.float32(0):
                        st[1] = T.float32(1) / st[1]
                    for d0 in range(ND):
                        for e in vec(VW):
                            O[t // (H * QB), t // QB % H, t % QB * QBL + r, d0 * VW + e] = T.Cast(
                                in_dtype, acc[d0 * VW + e] * st[1])

    mdt = mask_dtype or "bool"

    def qb_of(s):
        return (s + (QBL - 1)) // QBL

    def kb_of(s):
        return (s + (KBL - 1)) // KBL

    @T.prim_func(s_tir=True)
    def attn(q: T.handle, k: T.handle, v: T.handle, c: T.handle, i: T.handle, p: T.handle, m: T.handle,
             x: T.handle, y: T.handle, o: T.handle):
        T.func_attr({"tirx.noalias": True})
        B, H, Sq, Sk, S, HG, MH = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        Lq, Lk = T.meta_var(sequence_lengths(pattern, Sq, Sk, S))
        Q = T.match_buffer(q, (B, H, Lq, D), in_dtype)
        K = T.match_buffer(k, (B, H, Lk, D), in_dtype)
        V = T.match_buffer(v, (B, H, Lk, D), in_dtype)
        CNT = T.match_buffer(c, (B, HG, qb_of(Lq)), "int32")
        IDS = T.match_buffer(i, (B, HG, qb_of(Lq), kb_of(Lk)), "int32")
        PART = T.match_buffer(p, (B, HG, qb_of(Lq), kb_of(Lk)), "int32")
        M = T.match_buffer(m, (B, MH, Lq, Lk), mdt)
        X = T.match_buffer(x, (B, Lq), "int32")
        Y = T.match_buffer(y, (B, Lq), "int32")
        O = T.match_buffer(o, (B, H, Lq, D), in_dtype)
        body(Q, K, V, CNT, IDS, PART, pattern_signature_buffers(pattern, M, X, Y), O, B, H, HG, Lq, Lk, qb_of(Lq))

    func = without_params(attn, ("q", "k", "v", "c", "i", "p", "m", "x", "y", "o"), pattern_params_dropped(pattern))
    name = (f"pit_sparse_attention_generic_{pattern.tag}_d{D}_kb{KBL}_{in_dtype}"
            + (f"_{mdt}" if pattern.mask else ""))
    func = func.with_attr("global_symbol", name).with_attr("pit.attention.key_block", KBL)
    if gpu:
        func = func.with_attr("tirx.is_scheduled", True)
    return func


# --------------------------------------------------------------------------- Relax emission
def _static_int(dim):
    return int(dim) if isinstance(dim, tirx.IntImm) else None


def _check_relax_inputs(q, k, v, pattern, runtime):
    """Check the Relax operands (rank, dtype, static head dim, the pattern inputs' shapes
    where static); return (dtype, head_dim, mask_dtype).  A ValueError names the problem."""
    from tvm import relax

    tys = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        ty = x.ty
        if not isinstance(ty, relax.TensorType) or ty.shape is None or len(ty.shape) != 4:
            raise ValueError(f"sparse attention: {name} must be a [B, H, S, d] tensor, got {ty}")
        tys.append(ty)
    dtype = str(tys[0].dtype)
    if dtype not in ATTENTION_DTYPES or any(str(t.dtype) != dtype for t in tys):
        raise ValueError(f"sparse attention: q, k, v must share one dtype of {ATTENTION_DTYPES}, got "
                         f"{[str(t.dtype) for t in tys]}")
    d = _static_int(tys[0].shape[3])
    if d is None or any(_static_int(t.shape[3]) != d for t in tys):
        raise ValueError(f"sparse attention: the head dim must be static and equal in q, k, v, got "
                         f"{[t.shape[3] for t in tys]}")
    mask_dtype = None
    for name in pattern.inputs:
        x = runtime.get(name)
        if x is None:
            raise ValueError(f"sparse attention: pattern {pattern.tag} needs the input {name!r}")
        ty = x.ty
        rank = 4 if name == "mask" else 2
        if not isinstance(ty, relax.TensorType) or ty.shape is None or len(ty.shape) != rank:
            raise ValueError(f"sparse attention: {name} must be a rank-{rank} tensor, got {ty}")
        if name == "mask":
            mask_dtype = str(ty.dtype)
            hg = _static_int(ty.shape[1])
            heads = _static_int(tys[0].shape[1])
            if hg is not None and heads is not None and hg not in (1, heads):
                raise ValueError(f"sparse attention: mask {list(ty.shape)} does not broadcast over the "
                                 f"{heads} heads of q (its head dim must be 1 or {heads})")
        elif str(ty.dtype) != "int32":
            raise ValueError(f"sparse attention: {name} must be int32, got {ty.dtype}")
    for name in runtime:
        if name not in pattern.inputs and runtime[name] is not None:
            raise ValueError(f"sparse attention: {name} given, but pattern {pattern.tag} does not take it")
    return dtype, d, mask_dtype


#: the Hopper kernel's key block unless ``key_block=`` asks for another
HOPPER_KEY_BLOCK = 64


#: head dims and dtypes of the sm_90a kernel
HOPPER_HEAD_DIMS, HOPPER_DTYPES = (64, 128), ("float16", "bfloat16")


def fast_kernel_applies(target, head_dim: int, dtype: str) -> bool:
    """Whether ``target`` runs this attention with a kernel that beats the dense one where
    blocks are skipped: the CPU kernel, or the sm_90a kernel for its head dims and dtypes.  The
    generic CUDA kernel (one thread a query row) is a correct fallback, not a fast path."""
    from pit_tvm.target import is_gpu

    if not is_gpu(target):
        return True
    return (str(target.attrs.get("arch", "")) == "sm_90a" and int(head_dim) in HOPPER_HEAD_DIMS
            and str(dtype) in HOPPER_DTYPES)


def _hopper_kernel(target, head_dim, pattern, dtype, scale, mask_dtype, key_block):
    """The sm_90a kernel (``pit.attention.key_block`` set: the index is built for it; global
    tokens taken apart where :func:`splits_global_rows`), or None (with a warning when it
    exists but does not apply)."""
    from pit_tvm.target import is_gpu

    if not is_gpu(target) or str(target.attrs.get("arch", "")) != "sm_90a":
        return None
    try:
        from pit_tvm.schedules.hopper.sparse_attention import block_sparse_attention_func
    except ImportError:
        return None
    try:
        key_block = key_block or HOPPER_KEY_BLOCK
        func = block_sparse_attention_func(head_dim, pattern, dtype, key_block, scale=scale, mask_dtype=mask_dtype,
                                           global_split=splits_global_rows(pattern))
        return func.with_attr("pit.attention.key_block", key_block)
    except (ValueError, TypeError) as err:
        warnings.warn(f"sparse attention: the sm_90a kernel does not apply ({err}); the generic kernel runs",
                      stacklevel=3)
        return None


def emit_sparse_attention(bb, q, k, v, pattern: AttentionPattern, *, mask=None, global_flags=None, doc_ids=None,
                          scale=None, target="llvm", key_block: int | None = None):
    """Emit the block index and the sparse attention kernel into ``bb``; return ``o``
    (``[B, H, Sq, d]``, q's dtype).

    q / k / v ``[B, H, S, d]`` Relax tensors (B, H, S may be symbolic, d static); the pattern's
    run-time inputs as named (see :class:`AttentionPattern`).  On sm_90a the Hopper kernel
    (:func:`pit_tvm.schedules.hopper.sparse_attention.block_sparse_attention_func`) where it
    applies, else :func:`sparse_attention_func`.  Bad operands are a ValueError naming them."""
    from tvm import relax

    from pit_tvm.index.attention import MASK_BITS_KEYS, attention_block_index_func
    from pit_tvm.ops.matmul import add_once
    from pit_tvm.target import is_gpu, make_target

    target = make_target(target)
    runtime = {"mask": mask, "global_flags": global_flags, "doc_ids": doc_ids}
    dtype, d, mask_dtype = _check_relax_inputs(q, k, v, pattern, runtime)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    func = _hopper_kernel(target, d, pattern, dtype, scale, mask_dtype, key_block)
    kind = "hopper" if func is not None else "generic"
    if func is None:
        kb = key_block or (128 if is_gpu(target) else 64)
        func = sparse_attention_func(d, pattern, dtype, target, key_block=kb, scale=scale, mask_dtype=mask_dtype)
    kb = int(func.attrs["pit.attention.key_block"])     # (both kernels carry it: the index must match)
    # one kernel per (kernel, pattern, d, key block, dtypes, scale): a model may hold several
    name = (f"pit_sparse_attention_{kind}_{pattern.tag}_d{d}_kb{kb}_{dtype}" + (f"_{mask_dtype}" if mask_dtype else "")
            + "_scale" + repr(scale).replace(".", "p").replace("-", "m").replace("+", ""))
    # (the Hopper kernel says whether it takes the global tokens apart: the index must match)
    global_split = bool(func.attrs.get("pit.attention.global_split", False))
    name += "_gsplit" if global_split else ""
    # (the Hopper kernel says whether it reads the mask packed by the index: the index must write it)
    mask_bits = bool(func.attrs.get("pit.attention.mask_bits", False))
    name += "_bits" if mask_bits else ""
    kernel_gv = add_once(bb, name, lambda: func)
    index_func = attention_block_index_func(pattern, kb, dtype, target, mask_dtype=mask_dtype, global_split=global_split,
                                            mask_bits=mask_bits)
    index_gv = add_once(bb, str(index_func.attrs["global_symbol"]), lambda: index_func)

    B, H, Sq, _ = q.ty.shape
    Sk = k.ty.shape[2]
    # (the index's head groups: the mask's; 1 without one; the split's window and global tiles)
    HG = mask.ty.shape[1] if pattern.mask is not None else tirx.const(2 if global_split else 1, "int64")
    QB = tirx.floordiv(Sq + (QUERY_BLOCK - 1), QUERY_BLOCK)
    KB = tirx.floordiv(Sk + (kb - 1), kb)
    extra = [runtime[n] for n in pattern.inputs]
    outputs = [relax.TensorType([B, HG, QB], "int32"), relax.TensorType([B, HG, QB, KB], "int32"),
               relax.TensorType([B, HG, QB, KB], "int32")]
    if global_split:    # the global rows and their count
        outputs += [relax.TensorType([B, Sq], "int32"), relax.TensorType([B], "int32")]
    if mask_bits:       # the packed mask
        outputs += [relax.TensorType([B, HG, tirx.floordiv(Sk + (MASK_BITS_KEYS - 1), MASK_BITS_KEYS), Sq], "uint64")]
    index = bb.emit(relax.call_tir(index_gv, [q, k, *extra], outputs))
    index_parts = [bb.emit(relax.TupleGetItem(index, i)) for i in range(len(outputs))]
    return bb.emit(relax.call_tir(kernel_gv, [q, k, v, *index_parts[:3], *extra, *index_parts[3:]],
                                  relax.TensorType(list(q.ty.shape), dtype)))


# --------------------------------------------------------------------------- Python API
def _pattern_of(pattern, kwargs) -> AttentionPattern:
    if pattern is None:
        return AttentionPattern(**kwargs)
    if kwargs:
        raise TypeError(f"give either pattern= or the pattern fields {sorted(kwargs)}, not both")
    if not isinstance(pattern, AttentionPattern):
        raise TypeError(f"pattern must be an AttentionPattern, got {type(pattern).__name__}")
    return pattern


class SparseAttention:
    """Block-sparse attention whose pattern is data, compiled once for (head dim, pattern,
    dtype, target); each call builds the block index on the device and runs the kernel.

    Use :func:`sparse_attention` to create one.  ``op(q, k, v, mask=..., global_flags=...,
    doc_ids=...)`` takes numpy arrays or DLPack tensors (torch, TVM, ...) ``[B, H, S, d]`` (B, H
    and S vary per call) and returns ``o`` of q's kind; ``op.index(q, k, ...)`` returns the
    device index ``(block_counts, block_ids, block_partial)`` for inspection.
    """

    def __init__(self, head_dim, pattern: AttentionPattern, dtype="float16", target="llvm", scale=None,
                 key_block=None, mask_dtype=None):
        from tvm import relax

        from pit_tvm._args import dtype_name, positive_int
        from pit_tvm.index.attention import MASK_DTYPES
        from pit_tvm.ops.matmul import op_target
        from pit_tvm.target import build, device_for

        self.head_dim = positive_int(head_dim, "head_dim")
        self.pattern = pattern
        self.dtype = dtype_name(dtype)
        if self.dtype not in ATTENTION_DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}: use one of {', '.join(ATTENTION_DTYPES)}")
        if pattern.mask is not None:
            mask_dtype = dtype_name(mask_dtype) if mask_dtype is not None else (
                "bool" if pattern.mask == "bool" else self.dtype)
            if mask_dtype not in MASK_DTYPES[pattern.mask]:
                raise ValueError(f"a {pattern.mask} mask must have dtype {' or '.join(MASK_DTYPES[pattern.mask])}, "
                                 f"got {mask_dtype!r}")
        self.mask_dtype = mask_dtype if pattern.mask is not None else None
        self.scale = 1.0 / math.sqrt(self.head_dim) if scale is None else float(scale)
        self.target = op_target(target)
        self.device = device_for(self.target)
        descriptions = pattern.global_tokens or pattern.documents
        b, h = tirx.Var("b", "int64"), tirx.Var("h", "int64")
        sq = tirx.Var("s" if descriptions else "sq", "int64")
        sk = sq if descriptions else tirx.Var("sk", "int64")
        q = relax.Var("q", relax.TensorType([b, h, sq, self.head_dim], self.dtype))
        k = relax.Var("k", relax.TensorType([b, h, sk, self.head_dim], self.dtype))
        v = relax.Var("v", relax.TensorType([b, h, sk, self.head_dim], self.dtype))
        runtime = {}
        if pattern.mask is not None:
            runtime["mask"] = relax.Var("mask", relax.TensorType([b, tirx.Var("hg", "int64"), sq, sk], self.mask_dtype))
        for name in ("global_flags", "doc_ids"):
            if name in pattern.inputs:
                runtime[name] = relax.Var(name, relax.TensorType([b, sq], "int32"))
        bb = relax.BlockBuilder()
        with bb.function("main", [q, k, v, *runtime.values()]):
            with bb.dataflow():
                o = emit_sparse_attention(bb, q, k, v, pattern, scale=self.scale, target=self.target,
                                          key_block=key_block, **runtime)
                out = bb.emit_output(o)
            bb.emit_func_output(out)
        mod = bb.get()
        self.kernel_name = next(gv.name_hint for gv in mod.get_global_vars()
                                if gv.name_hint.startswith("pit_sparse_attention_"))
        kernel = mod[self.kernel_name]
        self.key_block = int(kernel.attrs["pit.attention.key_block"])
        self.index_name = next(gv.name_hint for gv in mod.get_global_vars()
                               if gv.name_hint.startswith("pit_attention_index_"))
        self.global_split = bool(kernel.attrs.get("pit.attention.global_split", False))
        self.mask_bits = bool(kernel.attrs.get("pit.attention.mask_bits", False))
        self.executable = build(mod, self.target)
        self._main = None

    # -- tensors in and out ---------------------------------------------------------
    def _tensor(self, x, name, want_dtype, rank):
        from pit_tvm._args import dtype_name
        from pit_tvm.runtime.loader import is_dlpack_tensor, numpy_dtype, op_dlpack_tensor
        import tvm

        if x is None:
            raise TypeError(f"{name} is required by pattern {self.pattern.tag}")
        if is_dlpack_tensor(x):
            t = op_dlpack_tensor(x, name, want_dtype, self.device)
        else:
            arr = np.asarray(x)
            have = dtype_name(arr.dtype)
            if have != want_dtype:
                # integer / bool pattern descriptions are converted (exactly); floats are not
                if want_dtype == "int32" and (np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool):
                    arr = arr.astype(np.int32)
                else:
                    raise ValueError(f"{name}: dtype {have} given, {want_dtype} expected")
            t = tvm.runtime.tensor(np.ascontiguousarray(arr, dtype=numpy_dtype(want_dtype)), self.device)
        if len(t.shape) != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {tuple(t.shape)}")
        return t

    def _inputs(self, q, k, v, mask, global_flags, doc_ids):
        qt = self._tensor(q, "q", self.dtype, 4)
        kt = self._tensor(k, "k", self.dtype, 4)
        vt = self._tensor(v, "v", self.dtype, 4) if v is not None else None
        B, H, Sq, D = (int(s) for s in qt.shape)
        if D != self.head_dim:
            raise ValueError(f"q: head dim {D}, the op was built for {self.head_dim}")
        Sk = int(kt.shape[2])
        for name, t in (("k", kt), ("v", vt)):
            if t is not None and tuple(int(s) for s in t.shape) != (B, H, Sk, D):
                raise ValueError(f"{name} must have shape {(B, H, Sk, D)} (q's B, H, d), got {tuple(t.shape)}")
        given = {"mask": mask, "global_flags": global_flags, "doc_ids": doc_ids}
        for name, x in given.items():
            if x is not None and name not in self.pattern.inputs:
                raise ValueError(f"{name} given, but pattern {self.pattern.tag} does not take it")
        extra = []
        if self.pattern.mask is not None:
            m = self._tensor(mask, "mask", self.mask_dtype, 4)
            shape = tuple(int(s) for s in m.shape)
            if shape[0] != B or shape[1] not in (1, H) or shape[2:] != (Sq, Sk):
                raise ValueError(f"mask of shape {shape} does not broadcast to the scores [B, H, Sq, Sk] = "
                                 f"{[B, H, Sq, Sk]}: [{B}, 1 or {H}, {Sq}, {Sk}] expected")
            extra.append(m)
        for name in ("global_flags", "doc_ids"):
            if name in self.pattern.inputs:
                t = self._tensor(given[name], name, "int32", 2)
                if tuple(int(s) for s in t.shape) != (B, Sq) or Sq != Sk:
                    raise ValueError(f"{name} must have shape {(B, Sq)} ([B, S], self-attention: Sq = Sk), got "
                                     f"{tuple(t.shape)} with Sq {Sq}, Sk {Sk}")
                extra.append(t)
        return qt, kt, vt, extra

    def index(self, q, k, mask=None, global_flags=None, doc_ids=None):
        """``(block_counts, block_ids, block_partial)`` of this call's pattern, on the device, and
        where the kernel takes the global tokens apart (``global_split``) ``global_rows,
        global_count``, where it reads the packed mask ``mask_bits``
        (:func:`pit_tvm.index.attention.attention_block_index_func`)."""
        qt, kt, _, extra = self._inputs(q, k, None, mask, global_flags, doc_ids)
        import tvm

        B, _, Sq, _ = (int(s) for s in qt.shape)
        Sk = int(kt.shape[2])
        HG = int(extra[0].shape[1]) if self.pattern.mask is not None else (2 if self.global_split else 1)
        QB, KB = -(-Sq // QUERY_BLOCK), -(-Sk // self.key_block)
        outs = (tvm.runtime.empty((B, HG, QB), "int32", self.device),
                tvm.runtime.empty((B, HG, QB, KB), "int32", self.device),
                tvm.runtime.empty((B, HG, QB, KB), "int32", self.device))
        if self.global_split:
            outs += (tvm.runtime.empty((B, Sq), "int32", self.device), tvm.runtime.empty((B,), "int32", self.device))
        if self.mask_bits:
            from pit_tvm.index.attention import MASK_BITS_KEYS

            outs += (tvm.runtime.empty((B, HG, -(-Sk // MASK_BITS_KEYS), Sq), "uint64", self.device),)
        self.executable[self.index_name](qt, kt, *extra, *outs)
        return outs

    def __call__(self, q, k, v, mask=None, global_flags=None, doc_ids=None):
        """``o`` of q's kind (TVM tensor, torch tensor, else numpy)."""
        import tvm

        qt, kt, vt, extra = self._inputs(q, k, v, mask, global_flags, doc_ids)
        if self._main is None:
            from tvm import relax

            self._main = relax.VirtualMachine(self.executable, self.device)["main"]
        o = self._main(qt, kt, vt, *extra)
        if isinstance(q, tvm.runtime.Tensor):
            return o
        if type(q).__module__.startswith("torch"):
            import torch

            return torch.from_dlpack(o)
        return o.numpy()


def sparse_attention(head_dim, pattern: AttentionPattern | None = None, dtype="float16", target="llvm",
                     scale=None, key_block=None, mask_dtype=None, **pattern_fields) -> SparseAttention:
    """Compile block-sparse attention for ``head_dim`` and a pattern known only at run time.

    ``pattern``: an :class:`AttentionPattern`, or its fields as keywords (``mask="bool"``,
    ``causal=True``, ``window=256, global_tokens=True``, ``documents=True``).  ``dtype``: float16,
    bfloat16 or float32; ``target``: ``"llvm"``, ``"cuda"``, ``"cuda:sm_XY"``; ``scale``: the
    score scale (default ``1 / sqrt(head_dim)``); ``key_block``: 64 or 128 (the generic kernel's
    key block; default 64 on the CPU, 128 on CUDA); ``mask_dtype``: an additive mask's dtype
    (default ``dtype``).  Rows with no allowed key give 0.
    """
    return SparseAttention(head_dim, _pattern_of(pattern, pattern_fields), dtype, target, scale, key_block,
                           mask_dtype)
