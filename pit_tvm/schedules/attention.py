"""Fused attention for short sequences on the H100 (sm_90a): ``softmax(Q K^T * scale + mask) V``
in one kernel, with wgmma for both products.

Why: a BERT-style encoder's attention, imported from ONNX, is five TVM kernels per layer (the
batched QK^T, the scale + mask, softmax, PV, and a copy that transposes K), several times the
time to read Q, K, V and write O once (docs/design/measurements.md#fused-attention).  For sequences of at most 256 keys a CTA holds one (batch, head)'s K and V and a
128-query block's Q in shared memory, so the scores never leave the SM.

Workload (``q, k, v, o``: ``[B, H, S, D]`` fp16 or bf16; ``mask``: additive, ``[MB, 1, 1, S]``
with ``MB`` 1 or B, any float dtype)::

    o[b, h] = softmax(q[b, h] @ k[b, h]^T * scale + mask[b or 0, 0, 0], axis=-1) @ v[b, h]

fp32 scores, softmax and accumulation (the ONNX graph rounds the scores to fp16; the result
is closer to an fp32 reference).  Applies for D in {32, 64} and S in {128, 256}; a head of 32
(MiniLM's) sits in the 64-column tiles with its upper half zero-filled (not read): Q K^T runs
D / 16 steps, P V and O's registers the full 64 columns, of which D are written.  ``packed`` /
``out_packed``: q, k, v read in place from ``[B, S, W]`` projections (the QKV GEMM's output)
and o written as ``[B, S, H * D]``, which spares BERT's graph the slice / head-transpose
copies around attention.

One CTA = 2 warpgroups (256 threads) per (128-query block, head, batch)::

    SRead   Q_s[128, 64], K_s[S, 64], V_s[S, 64] <- cp.async, 16 B chunks, rows of 128 B,
            128B-swizzled (chunk c of row r at c ^ (r % 8))
    warpgroup g (queries 64g .. 64g+63):
        S_acc[64, S] = Q_s[64g:, :] @ K_s^T        4 x wgmma m64nSk16 (K_s is B, K-major)
        scale, mask, row max / exp / row sum in registers (quad shuffles: a row's S columns
        sit in 4 lanes)
        P_s[64g:, :S] <- fp16(exp(...))            A layout: 64-key column tiles, swizzled
        O_acc[64, 64] = P_s @ V_s                  S/16 x wgmma m64n64k16 (V_s is B, MN-major)
    SWrite  O_acc / row sum -> staged O tile [128, 64 + 8] -> 16 B stores to o[b, h, rows]

Shared memory: (128 + 2S) x 64 + 128 x S elements (S = 128: 80 KiB, two CTAs per SM).

Padding (PIT's dynamic sparsity in attention): the kernel reads Q, K and V once, so it saves
the reads the result does not depend on.  K and V rows of keys
masked at or below :data:`MASKED_KEY` are zero-filled by ``cp.async`` instead of read (all
are read when every key of (b, h) is masked: the softmax then spreads over them all), and with
``row_scale`` so are Q's rows that the row scale zeroes (their o is 0 either way).  The test is
on the device, per call, from the mask the kernel already takes: no index, no host sync.
"""
from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.schedules.hopper.config import TARGET, WGMMA_ARCH
from pit_tvm.schedules.hopper.lowering import lower_tirx
from pit_tvm.schedules.hopper.smem import PTX_TYPE, SWIZZLE_128B, k_major_strides, mn_major_strides
from pit_tvm.schedules.limits import IN_DTYPES, max_smem_bytes

__all__ = ["MASKED_KEY", "attention_applies", "fused_attention_func"]

QUERY_BLOCK = 128      # queries per CTA: 2 warpgroups x wgmma M=64
HEAD_DIM = 64          # tile width: one 128-byte swizzle atom of fp16 / bf16
HEAD_DIMS = (32, 64)   # the heads it takes (32: the tiles' upper half zero)
THREADS = 256
SEQ_LENGTHS = (128, 256)
#: keys whose additive mask is at or below this are not read (zero-filled): their weight
#: ``exp(score + mask - row max)`` is below fp32's smallest subnormal (e^-104) unless their
#: score exceeds every unmasked key's by ~9,900.  BERT's padding mask is -10000.
MASKED_KEY = -1.0e4


def attention_applies(batch, heads, seq, head_dim, dtype: str, mask_batch, arch: str) -> bool:
    """Whether :func:`fused_attention_func` takes these (static) sizes."""
    return (arch == WGMMA_ARCH and dtype in IN_DTYPES and head_dim in HEAD_DIMS and seq in SEQ_LENGTHS
            and mask_batch in (1, batch) and batch >= 1 and heads >= 1
            and _smem_elems(seq) * 2 <= max_smem_bytes(arch))


def _smem_elems(seq: int) -> int:
    return (QUERY_BLOCK + 2 * seq) * HEAD_DIM + QUERY_BLOCK * seq


@functools.lru_cache(maxsize=32)
def fused_attention_func(batch: int, heads: int, seq: int, head_dim: int, scale: float,
                         dtype: str = "float16", mask_dtype: str = "float16",
                         mask_batch: int | None = None, packed=None,
                         out_packed: bool = False, row_scale: bool = False) -> tirx.PrimFunc:
    """The lowered fused-attention PrimFunc ``(q, k, v, mask, o)`` (see the module docstring).
    Raises ValueError when the sizes do not fit (:func:`attention_applies`).

    ``packed``: ``((Wq, oq), (Wk, ok), (Wv, ov))``: q, k and v are ``[B, S, W]`` tensors whose
    head h is columns ``o + h * D .. o + h * D + D - 1`` (a projection's output before the
    head split: ``q[b, h, s] = Xq[b, s, oq + h D :]``, the same tensor may be passed three
    times); ``out_packed``: o is ``[B, S, H * D]`` (the heads merged back).  Both spare the
    graph a copy per tensor that only moves the head axis.  ``row_scale`` (with
    ``out_packed``): a ``[B, S, 1]`` input of the mask dtype after the mask, multiplying query
    row s of batch b of o (BERT's padding mask on the attention output)."""
    B, H, S, D = int(batch), int(heads), int(seq), int(head_dim)
    MB = B if mask_batch is None else int(mask_batch)
    if not attention_applies(B, H, S, D, dtype, MB, WGMMA_ARCH):
        raise ValueError(f"fused attention needs head_dim in {HEAD_DIMS}, seq in {SEQ_LENGTHS}, fp16/bf16 "
                         f"and a mask batch of 1 or B; got B={B} H={H} S={S} D={D} {dtype} mask batch {MB}")
    if packed is not None:
        packed = tuple((int(w), int(o)) for w, o in packed)
        if len(packed) != 3 or any(o < 0 or o % 8 or w % 8 or o + H * D > w for w, o in packed):
            raise ValueError(f"packed q, k, v need three (width, offset) with offset + H * D <= width, "
                             f"both multiples of 8 (16-byte rows); got {packed} for H={H}, D={D}")
    if row_scale and not out_packed:
        raise ValueError("row_scale comes with out_packed (the kernel variant that takes it)")
    in_shapes = [(B, S, w) for w, _ in packed] if packed else [(B, H, S, D)] * 3
    offsets = [o for _, o in packed] if packed else [0, 0, 0]
    out_shape = (B, S, H * D) if out_packed else (B, H, S, D)

    def row(buf, i, b, h, r, col):
        """the address of element ``col`` of row ``r`` of head h of input i (q, k, v)"""
        if packed:
            return buf.ptr_to([b, r, offsets[i] + h * D + col])
        return buf.ptr_to([b, h, r, col])

    QB = QUERY_BLOCK
    SCALE = float(scale)
    ACC_S = S // 2                # fp32 scores per thread: m64 x nS over 128 threads
    DT = HEAD_DIM                 # columns of the Q / K / V / O tiles (D of them real)
    ACC_O = DT // 2
    ROW_CHUNKS = DT // 8          # 16-byte chunks per tile row of Q / K / V / O
    HEAD_CHUNKS = D // 8          # ... of them holding the head (read / written)
    Q_OFF, K_OFF = 0, QB * DT
    V_OFF = K_OFF + S * DT
    P_OFF = V_OFF + S * DT        # P: S / 64 column tiles of [128 rows x 64 keys]
    O_ROW = DT + 8                # staged O pitch (16 bytes of padding against bank conflicts)
    t = PTX_TYPE[dtype]
    wgmma_s = f"wgmma.mma_async.sync.aligned.m64n{S}k16.f32.{t}.{t}"
    wgmma_o = f"wgmma.mma_async.sync.aligned.m64n{DT}k16.f32.{t}.{t}"
    # descriptors (16-byte units): K-major rows of 128 B, 8-row groups 1024 B apart (Q, K, P);
    # V is B in MN-major: one 64-column atom, 8-row groups along K 1024 B apart
    KM_LBO, KM_SBO = k_major_strides(64)      # 128-byte rows
    V_LBO, V_SBO = mn_major_strides(S)
    neg_inf = tirx.const(-3.0e38, "float32")

    def scaled(value, rs_buf, b, r):
        """o's fp32 value of query row r, times its row scale where the kernel takes one"""
        return value * T.Cast("float32", rs_buf[b, r, 0]) if row_scale else value

    def query_read(rs_buf, b, r):
        """whether query row r is read: with a row scale, rows it zeroes are not (their o is 0)"""
        return T.Cast("float32", rs_buf[b, r, 0]) != T.float32(0) if row_scale else T.bool(True)

    def copy16(dst, src, read):
        """16-byte cp.async (to wrap in ``T.evaluate``) that zero-fills ``dst`` without reading
        where ``read`` is false"""
        return T.ptx["cp.async.cg.shared.global"](dst, src, 16, T.Cast("uint32", T.if_then_else(read, 16, 0)))

    def head_col(ch):
        """the first column of 16-byte chunk ch of a tile row in the head (chunks past the
        head, zero-filled, point at its first: an address inside the tensor)"""
        return T.if_then_else(ch < HEAD_CHUNKS, ch * 8, 0) if HEAD_CHUNKS < ROW_CHUNKS else ch * 8

    def swizzled(r, ch):
        """element offset of 16-byte chunk ch of row r in a [rows x 64] 128B-swizzled tile"""
        return r * DT + T.bitwise_xor(ch, r % 8) * 8

    @T.macro
    def operand_descriptors(smem, desc_a, desc_b, a_off, b_off, b_lbo, b_sbo):
        # wgmma's descriptors of A (K-major, at a_off) and B (at b_off) in smem, then the
        # fence before the MMAs read them
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_a[0]), smem.ptr_to([a_off]),
                                              KM_LBO, KM_SBO, SWIZZLE_128B)
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_b[0]), smem.ptr_to([b_off]),
                                              b_lbo, b_sbo, SWIZZLE_128B)
        T.ptx.wgmma.fence.sync.aligned()

    @T.macro
    def body(Q, K, V, MASK, RS, O):
        T.device_entry()
        qb, h, b = T.cta_id([S // QB, H, B])
        tid = T.thread_id([THREADS])
        smem = T.alloc_buffer([_smem_elems(S)], dtype, scope="shared.dyn", align=1024)
        acc_s = T.alloc_local([ACC_S], "float32")
        acc_o = T.alloc_local([ACC_O], "float32")
        row_max = T.alloc_local([2], "float32")
        row_sum = T.alloc_local([2], "float32")
        desc_a = T.alloc_local([1], "uint64")
        desc_b = T.alloc_local([1], "uint64")
        wg = tid // 128
        w = (tid % 128) // 32
        lane = tid % 32
        mb = b if MB > 1 else 0
        # SRead: Q's query block, all of K and V for (b, h); rows the result does not depend
        # on are zero-filled, not read (module docstring: padding)
        for j in T.unroll(QB * ROW_CHUNKS // THREADS):
            r = (tid + THREADS * j) // ROW_CHUNKS
            ch = (tid + THREADS * j) % ROW_CHUNKS
            T.evaluate(copy16(smem.ptr_to([Q_OFF + swizzled(r, ch)]), row(Q, 0, b, h, qb * QB + r, head_col(ch)),
                              T.And(query_read(RS, b, qb * QB + r), ch < HEAD_CHUNKS)))
        # (a CTA-wide vote while Q's copies are in flight: does any key escape the mask?)
        any_key = T.cuda.syncthreads_or(T.Cast("float32", MASK[mb, 0, 0, tid % S]) > MASKED_KEY)
        for j in T.unroll(S * ROW_CHUNKS // THREADS):
            r = (tid + THREADS * j) // ROW_CHUNKS
            ch = (tid + THREADS * j) % ROW_CHUNKS
            key_read = T.And(T.Or(T.Cast("float32", MASK[mb, 0, 0, r]) > MASKED_KEY, any_key == 0), ch < HEAD_CHUNKS)
            T.evaluate(copy16(smem.ptr_to([K_OFF + swizzled(r, ch)]), row(K, 1, b, h, r, head_col(ch)), key_read))
            T.evaluate(copy16(smem.ptr_to([V_OFF + swizzled(r, ch)]), row(V, 2, b, h, r, head_col(ch)), key_read))
        T.ptx["cp.async.commit_group"]()
        for i in T.unroll(ACC_S):
            acc_s[i] = T.float32(0)
        for i in T.unroll(ACC_O):
            acc_o[i] = T.float32(0)
        T.ptx["cp.async.wait_group"](0)
        T.ptx["fence.proxy.async.shared::cta"]()
        T.cuda.cta_sync()
        # S_acc = Q K^T: this warpgroup's 64 queries against all S keys
        operand_descriptors(smem, desc_a, desc_b, Q_OFF + wg * 64 * DT, K_OFF, KM_LBO, KM_SBO)
        for kk in T.unroll(D // 16):
            T.ptx[wgmma_s](*[acc_s[i] for i in range(ACC_S)],
                           desc_a[0] + T.Cast("uint64", kk * 2), desc_b[0] + T.Cast("uint64", kk * 2),
                           True, 1, 1, 0, 0)
        T.ptx.wgmma.commit_group.sync.aligned()
        T.ptx.wgmma.wait_group.sync.aligned(0)
        # softmax over keys: thread (w, lane) holds rows 16w + lane/4 (+8) of the warpgroup's
        # 64 and columns 8nb + 2(lane%4) (+1) in acc_s[4nb + 2i + e]
        for i in T.unroll(2):
            row_max[i] = neg_inf
            for nb in T.unroll(S // 8):
                for e in T.unroll(2):
                    acc_s[nb * 4 + i * 2 + e] = acc_s[nb * 4 + i * 2 + e] * T.float32(SCALE) + T.Cast(
                        "float32", MASK[mb, 0, 0, nb * 8 + (lane % 4) * 2 + e])
                    row_max[i] = T.max(row_max[i], acc_s[nb * 4 + i * 2 + e])
            row_max[i] = T.max(row_max[i], T.cuda.__shfl_xor_sync(T.uint32(0xFFFFFFFF), row_max[i], 1, 32))
            row_max[i] = T.max(row_max[i], T.cuda.__shfl_xor_sync(T.uint32(0xFFFFFFFF), row_max[i], 2, 32))
            row_sum[i] = T.float32(0)
            for nb in T.unroll(S // 8):
                for e in T.unroll(2):
                    acc_s[nb * 4 + i * 2 + e] = T.exp(acc_s[nb * 4 + i * 2 + e] - row_max[i])
                    row_sum[i] = row_sum[i] + acc_s[nb * 4 + i * 2 + e]
            row_sum[i] = row_sum[i] + T.cuda.__shfl_xor_sync(T.uint32(0xFFFFFFFF), row_sum[i], 1, 32)
            row_sum[i] = row_sum[i] + T.cuda.__shfl_xor_sync(T.uint32(0xFFFFFFFF), row_sum[i], 2, 32)
        # P (unnormalised; O is divided by the row sum) as wgmma's A: 64-key column tiles
        for nb in T.unroll(S // 8):
            for i in T.unroll(2):
                for e in T.vectorized(2):
                    smem[P_OFF + (nb // 8) * (QB * 64) + swizzled(wg * 64 + w * 16 + lane // 4 + 8 * i, nb % 8)
                         + (lane % 4) * 2 + e] = T.Cast(dtype, acc_s[nb * 4 + i * 2 + e])
        T.ptx["fence.proxy.async.shared::cta"]()
        T.cuda.cta_sync()
        # O_acc = P V
        operand_descriptors(smem, desc_a, desc_b, P_OFF + wg * 64 * 64, V_OFF, V_LBO, V_SBO)
        for kk in T.unroll(S // 16):
            T.ptx[wgmma_o](*[acc_o[i] for i in range(ACC_O)],
                           desc_a[0] + T.Cast("uint64", ((kk // 4) * QB * 64 + (kk % 4) * 16) // 8),
                           desc_b[0] + T.Cast("uint64", kk * 16 * DT // 8),
                           True, 1, 1, 0, 1)
        T.ptx.wgmma.commit_group.sync.aligned()
        T.ptx.wgmma.wait_group.sync.aligned(0)
        T.cuda.cta_sync()
        # SWrite: O / row sum -> staged tile (over P, which both warpgroups are done with)
        for nb in T.unroll(HEAD_CHUNKS):
            for i in T.unroll(2):
                for e in T.vectorized(2):
                    smem[P_OFF + (wg * 64 + w * 16 + lane // 4 + 8 * i) * O_ROW + nb * 8 + (lane % 4) * 2 + e] = \
                        T.Cast(dtype, scaled(acc_o[nb * 4 + i * 2 + e] / row_sum[i], RS, b,
                                             qb * QB + wg * 64 + w * 16 + lane // 4 + 8 * i))
        T.cuda.cta_sync()
        for j in T.unroll(QB * HEAD_CHUNKS // THREADS):
            r = (tid + THREADS * j) // HEAD_CHUNKS
            ch = (tid + THREADS * j) % HEAD_CHUNKS
            if out_packed:
                for e in T.vectorized(8):
                    O[b, qb * QB + r, h * D + ch * 8 + e] = smem[P_OFF + r * O_ROW + ch * 8 + e]
            else:
                for e in T.vectorized(8):
                    O[b, h, qb * QB + r, ch * 8 + e] = smem[P_OFF + r * O_ROW + ch * 8 + e]

    if row_scale:
        @T.prim_func(s_tir=False)
        def kernel(q: T.handle, k: T.handle, v: T.handle, mask: T.handle, rs: T.handle, o: T.handle):
            body(T.match_buffer(q, in_shapes[0], dtype), T.match_buffer(k, in_shapes[1], dtype),
                 T.match_buffer(v, in_shapes[2], dtype), T.match_buffer(mask, (MB, 1, 1, S), mask_dtype),
                 T.match_buffer(rs, (B, S, 1), mask_dtype), T.match_buffer(o, out_shape, dtype))
    else:
        @T.prim_func(s_tir=False)
        def kernel(q: T.handle, k: T.handle, v: T.handle, mask: T.handle, o: T.handle):
            body(T.match_buffer(q, in_shapes[0], dtype), T.match_buffer(k, in_shapes[1], dtype),
                 T.match_buffer(v, in_shapes[2], dtype), T.match_buffer(mask, (MB, 1, 1, S), mask_dtype),
                 None, T.match_buffer(o, out_shape, dtype))
    return lower_tirx(kernel, TARGET)
