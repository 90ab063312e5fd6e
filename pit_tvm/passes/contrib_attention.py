"""Converters of ONNX Runtime's contrib attention operators, as plain Relax attention graphs.

``com.microsoft.SparseAttention`` (Phi-3-small's block-sparse attention) is decomposed into
``softmax(where(allowed, Q Kᵀ · scale, fill)) V`` where ``allowed[B, H, S, S]`` is computed
from the operator's run-time inputs (the CSR block layouts, the per-batch key lengths) and the
causal bound; :class:`~pit_tvm.passes.SparseAttentionToPIT` then lowers that to block-sparse
attention like any attention with a run-time mask.  What it computes, as ONNX Runtime's CPU
kernel does (checked against it in the tests):

* q ``[B, S, NH * d]``, k / v ``[B, S, KVH * d]`` (grouped-query: head h reads kv head
  ``h // (NH / KVH)``), scale the ``scale`` attribute or ``1 / sqrt(d)``;
* head h uses layout ``h % num_layout``: query block r may read key block c when c is listed in
  ``block_col_indices[l, block_row_indices[l, r] : block_row_indices[l, r + 1]]`` (blocks of
  ``sparse_block_size``); and key ``k <= q`` (causal), ``k < key_total_sequence_lengths[b]``;
* ``present_key`` / ``present_value``: ``past_key`` / ``past_value`` with the new keys / values
  in positions ``[0, S)``.

Converted: the prompt (no past: ``total_sequence_length`` and every
``key_total_sequence_lengths[b]`` equal to S; run-time values the conversion assumes: with a past,
ONNX Runtime places the queries at positions ``key_total_sequence_lengths[b] - S ..``, which this
conversion does not model), unpacked q / k / v, ``do_rotary = 0``, static S, heads and head dim.  Other
forms raise a ``ValueError`` naming the node's operator and what is not supported.

``com.microsoft.LongformerAttention`` is not converted (ONNX Runtime runs it on CUDA only, so
there is no CPU reference to check a conversion against).
"""
from __future__ import annotations

import math

import numpy as np
from tvm import relax, tirx

__all__ = ["CONTRIB_CONVERTERS", "sparse_attention_contrib"]


def _static(shape, what):
    dims = []
    for d in list(shape):
        if not isinstance(d, tirx.IntImm):
            raise ValueError(f"com.microsoft.SparseAttention: {what} needs a static shape, got {list(shape)} "
                             "(fix the inputs' symbolic dims with shapes=)")
        dims.append(int(d))
    return dims


def sparse_attention_contrib(bb: relax.BlockBuilder, inputs, attrs):
    """The converter of ``com.microsoft.SparseAttention``: ``(output, present_key, present_value)``."""
    op = "com.microsoft.SparseAttention"
    if int(attrs.get("do_rotary", 0)):
        raise ValueError(f"{op}: do_rotary=1 is not supported (apply the rotary embedding before the operator)")
    given = [inputs[i] for i in range(len(inputs))]     # (TVM's input list takes no slices)
    q, k, v, past_k, past_v, rows, cols, _total, key_lengths = (given + [None] * 11)[:9]
    if k is None or v is None:
        raise ValueError(f"{op}: packed QKV (no key / value input) is not supported")
    if past_k is None or past_v is None:
        raise ValueError(f"{op}: past_key / past_value are required")
    nh, kvh = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
    bs = int(attrs["sparse_block_size"])
    B = q.ty.shape[0]
    _, S, hidden = [B] + _static(list(q.ty.shape)[1:], "query")
    d = hidden // nh
    if hidden % nh or nh % kvh:
        raise ValueError(f"{op}: query hidden size {hidden} and heads num_heads={nh}, kv_num_heads={kvh} "
                         "do not divide")
    layouts, max_rows = _static(rows.ty.shape, "block_row_indices")
    max_cache = _static(list(past_k.ty.shape)[2:3], "past_key")[0]
    if max_cache < S:
        raise ValueError(f"{op}: past_key holds {max_cache} positions, fewer than the {S} new ones")
    scale = float(attrs.get("scale", 0.0)) or 1.0 / math.sqrt(d)
    dtype = str(q.ty.dtype)
    fill = -65504.0 if dtype == "float16" else -1.0e30

    def emit(x):
        return bb.emit(x)

    def heads(x, n):
        return emit(relax.op.permute_dims(emit(relax.op.reshape(x, [B, S, n, d])), [0, 2, 1, 3]))

    q4, k4, v4 = heads(q, nh), heads(k, kvh), heads(v, kvh)
    kr = emit(relax.op.repeat(k4, nh // kvh, axis=1)) if nh != kvh else k4
    vr = emit(relax.op.repeat(v4, nh // kvh, axis=1)) if nh != kvh else v4
    scores = emit(relax.op.multiply(emit(relax.op.matmul(q4, emit(relax.op.permute_dims(kr, [0, 1, 3, 2])))),
                                    relax.const(scale, dtype)))
    # the block layouts from CSR: listed[l, r, c] = any_j (row_start <= j < row_end and cols[l, j] == c)
    q_blocks, k_blocks = -(-S // bs), -(-S // bs)
    if q_blocks + 1 > max_rows:
        raise ValueError(f"{op}: block_row_indices has {max_rows - 1} block rows, {q_blocks} needed for {S} tokens")
    nnz = _static(cols.ty.shape, "block_col_indices")[1]
    r = relax.const(np.arange(q_blocks, dtype=np.int64))
    start = emit(relax.op.take(rows, r, axis=1))                                  # [L, QB]
    end = emit(relax.op.take(rows, relax.const(np.arange(1, q_blocks + 1, dtype=np.int64)), axis=1))
    j = relax.const(np.arange(nnz, dtype=np.int32).reshape(1, 1, nnz))
    in_row = emit(relax.op.logical_and(
        emit(relax.op.greater_equal(j, emit(relax.op.expand_dims(start, 2)))),
        emit(relax.op.less(j, emit(relax.op.expand_dims(end, 2))))))               # [L, QB, NNZ]
    c = relax.const(np.arange(k_blocks, dtype=np.int32).reshape(1, 1, k_blocks, 1))
    hit = emit(relax.op.logical_and(
        emit(relax.op.expand_dims(in_row, 2)),
        emit(relax.op.equal(emit(relax.op.expand_dims(emit(relax.op.expand_dims(cols, 1)), 1)), c))))  # [L,QB,KB,NNZ]
    listed = emit(relax.op.greater(emit(relax.op.max(emit(relax.op.astype(hit, "int32")), axis=[3])),
                                   relax.const(0, "int32")))                       # [L, QB, KB]
    per_head = emit(relax.op.take(listed, relax.const(np.arange(nh, dtype=np.int64) % layouts), axis=0))
    pos_blocks = relax.const(np.arange(S, dtype=np.int64) // bs)
    elem = emit(relax.op.take(emit(relax.op.take(per_head, pos_blocks, axis=1)), pos_blocks, axis=2))  # [NH, S, S]
    causal = relax.const(np.tril(np.ones((S, S), dtype=bool)))
    key_pos = relax.const(np.arange(S, dtype=np.int32).reshape(1, 1, 1, S))
    key_ok = emit(relax.op.less(key_pos, emit(relax.op.reshape(key_lengths, [B, 1, 1, 1]))))  # [B, 1, 1, S]
    allowed = emit(relax.op.logical_and(emit(relax.op.logical_and(elem, causal)), key_ok))     # [B, NH, S, S]
    logits = emit(relax.op.where(allowed, scores, relax.const(fill, dtype)))
    probs = emit(relax.op.nn.softmax(logits, axis=-1))
    ctx = emit(relax.op.matmul(probs, vr))
    out = emit(relax.op.reshape(emit(relax.op.permute_dims(ctx, [0, 2, 1, 3])), [B, S, hidden]))

    def present(new, past):
        if max_cache == S:
            return new
        rest = emit(relax.op.strided_slice(past, axes=[2], begin=[S], end=[max_cache]))
        return emit(relax.op.concat([new, rest], axis=2))

    return relax.Tuple([out, present(k4, past_k), present(v4, past_v)])


#: ONNX op type -> converter ``(bb, inputs, attrs) -> relax expr``, for contrib ops TVM lacks
CONTRIB_CONVERTERS = {"SparseAttention": sparse_attention_contrib}
