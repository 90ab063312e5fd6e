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

``com.microsoft.LongformerAttention`` (Longformer's self-attention: a ``±window`` band plus
global tokens given per call) is converted to two calls of the block-sparse attention op
(:func:`longformer_attention_contrib`), never to a dense ``[S, S]`` mask.  ONNX Runtime runs it
on CUDA only, so the conversion is checked against a numpy implementation of the op's semantics
and against Hugging Face's ``LongformerSelfAttention``.
"""
from __future__ import annotations

import math

import numpy as np
from tvm import relax, tirx
from tvm.sym.analyzer import Analyzer

__all__ = ["CONTRIB_CONVERTERS", "sparse_attention_contrib", "longformer_attention_contrib",
           "reference_longformer_attention"]


def _static(shape, what):
    dims = []
    for d in list(shape):
        if not isinstance(d, tirx.IntImm):
            raise ValueError(f"com.microsoft.SparseAttention: {what} needs a static shape, got {list(shape)} "
                             "(fix the inputs' symbolic dims with shapes=)")
        dims.append(int(d))
    return dims


def sparse_attention_contrib(bb: relax.BlockBuilder, inputs, attrs, **_options):
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


LONGFORMER = "com.microsoft.LongformerAttention"


def reference_longformer_attention(x, weight, bias, mask, global_weight, global_bias, global_flags, num_heads,
                                   window):
    """numpy fp64 reference of ``com.microsoft.LongformerAttention``, written from the operator's
    definition (ONNX Runtime's CUDA kernel, Hugging Face's ``LongformerSelfAttention``):

    * ``q | k | v = x @ weight + bias`` and ``gq | gk | gv = x @ global_weight + global_bias``
      (``[B, S, 3 * hidden]``, heads of ``d = hidden / num_heads``), scores scaled by ``1 / sqrt(d)``;
    * a token is padding where ``mask < 0`` (ONNX Runtime's masks are 0 / -10000);
    * a local (non-global) row attends, with ``q, k, v``, to the non-padding keys with
      ``|i - j| <= window`` and to the global keys;
    * a global row attends, with ``gq, gk, gv``, to every non-padding key;
    * a padding row is 0.
    """
    x = np.asarray(x, np.float64)
    B, S, hidden = x.shape
    d = hidden // num_heads

    def heads(t):
        return t.reshape(B, S, num_heads, d).transpose(0, 2, 1, 3)

    def attend(qkv, allowed):
        q, k, v = (heads(t) for t in np.split(qkv, 3, axis=-1))
        scores = np.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(d)
        scores = np.where(allowed[:, None], scores, -np.inf)
        top = scores.max(-1, keepdims=True)
        p = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
        p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
        return np.einsum("bhij,bhjd->bhid", p, v)

    pad = np.asarray(mask, np.float64) < 0
    glob = np.asarray(global_flags) != 0
    i = np.arange(S)
    near = np.abs(i[:, None] - i[None, :]) <= window
    local = attend(x @ np.asarray(weight, np.float64) + np.asarray(bias, np.float64),
                   ~pad[:, None, :] & (near[None] | glob[:, None, :]))
    glob_out = attend(x @ np.asarray(global_weight, np.float64) + np.asarray(global_bias, np.float64),
                      np.broadcast_to(~pad[:, None, :], (B, S, S)))
    out = np.where(glob[:, None, :, None], glob_out, local)
    out = np.where(pad[:, None, :, None], 0.0, out)
    return out.transpose(0, 2, 1, 3).reshape(B, S, hidden)


def _longformer_operands(inputs, attrs):
    """the operands and attributes of a LongformerAttention node, checked: ``(x, w, b, mask, gw, gb,
    flags, num_heads, window, hidden, dtype)``; a ValueError names what does not fit"""
    op = LONGFORMER
    given = [inputs[i] for i in range(len(inputs))]
    if len(given) != 7 or any(t is None for t in given):
        raise ValueError(f"{op}: 7 inputs expected (input, weight, bias, mask, global_weight, global_bias, "
                         f"global), got {len(given)}")
    x, w, b, mask, gw, gb, flags = given
    if "num_heads" not in attrs or "window" not in attrs:
        raise ValueError(f"{op}: the num_heads and window attributes are required")
    nh, window = int(attrs["num_heads"]), int(attrs["window"])
    if nh <= 0 or window < 0:
        raise ValueError(f"{op}: num_heads={nh} must be > 0 and window={window} >= 0")
    operands = {"input": x, "weight": w, "bias": b, "mask": mask, "global_weight": gw, "global_bias": gb,
                "global": flags}
    shapes = {}
    for (name, t), rank in zip(operands.items(), (3, 2, 1, 2, 2, 1, 2)):
        if not isinstance(getattr(t, "ty", None), relax.TensorType) or t.ty.shape is None or len(t.ty.shape) != rank:
            raise ValueError(f"{op}: input {name!r} must be a tensor of rank {rank}")
        shapes[name] = list(t.ty.shape)
    hidden = shapes["input"][2]
    if not isinstance(hidden, tirx.IntImm):
        raise ValueError(f"{op}: the hidden size of 'input' must be static, got {shapes['input']}")
    hidden = int(hidden)
    if hidden % nh:
        raise ValueError(f"{op}: hidden size {hidden} is not a multiple of num_heads={nh}")
    dtype = str(x.ty.dtype)
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"{op}: input of dtype {dtype} is not supported (float32, float16, bfloat16)")
    for name, want in (("weight", [hidden, 3 * hidden]), ("bias", [3 * hidden]),
                       ("global_weight", [hidden, 3 * hidden]), ("global_bias", [3 * hidden])):
        have = [int(v) if isinstance(v, tirx.IntImm) else v for v in shapes[name]]
        if have != want:
            raise ValueError(f"{op}: {name!r} must have shape {want} (hidden {hidden}), got {have}")
        if str(operands[name].ty.dtype) != dtype:
            raise ValueError(f"{op}: {name!r} must have the input's dtype {dtype}, got {operands[name].ty.dtype}")
    if "float" not in str(mask.ty.dtype):
        raise ValueError(f"{op}: 'mask' must be a float tensor (0 / -10000), got {mask.ty.dtype}")
    if str(flags.ty.dtype) not in ("int32", "int64", "bool"):
        raise ValueError(f"{op}: 'global' must be int32, got {flags.ty.dtype}")
    for name in ("mask", "global"):      # [B, S] of the input (static dims that differ: an error)
        for have, want in zip(shapes[name], shapes["input"][:2]):
            if isinstance(have, tirx.IntImm) and isinstance(want, tirx.IntImm) and int(have) != int(want):
                raise ValueError(f"{op}: {name!r} of shape {shapes[name]} does not match the input's "
                                 f"[batch, sequence] {shapes['input'][:2]}")
    return x, w, b, mask, gw, gb, flags, nh, window, hidden, dtype


def longformer_attention_contrib(bb: relax.BlockBuilder, inputs, attrs, target=None, sparse=None, notes=None,
                                 node_output=None, input_sources=None):
    """The converter of ``com.microsoft.LongformerAttention`` (semantics:
    :func:`reference_longformer_attention`).

    Both projections are GEMMs; then two block-sparse attention calls, their index built from
    the run-time ``global`` flags and ``mask`` on the device (the padding as document ids: 0 for
    a token, 1 for padding, so no token attends to padding):

    * local rows: ``AttentionPattern(window=window, global_tokens=True, documents=True)`` over
      ``q, k, v``: the band, the global keys (and, unused, the global rows);
    * global rows: ``AttentionPattern(window=0, global_tokens=True, documents=True)`` over the
      global projections: a global row reads every key; a local row only its own key and the
      global keys (a few key blocks, discarded);

    and the output takes the global rows from the second, zeroes the padding rows.  ``sparse``:
    ``compile_onnx``'s ``sparse_attention=`` (True / None: where a fast kernel runs it; the name
    of the ``mask`` or ``global`` input: in any case; False: dense).  Dense, and where the op
    refuses the operands (with a warning), is the same computation with ``[B, 1, S, S]`` masks.
    ``notes``: a list the decision record is appended to (source ``attention:`` and the graph
    inputs ``mask`` and ``global`` are computed from, from ``input_sources``: the node's
    ``[(input name, its graph inputs)]``)."""
    import warnings

    from pit_tvm.ops.sparse_attention import AttentionPattern, emit_sparse_attention, fast_kernel_applies
    from pit_tvm.target import make_target

    from .frontend import sanitize

    x, w, b, mask, gw, gb, flags, nh, window, hidden, dtype = _longformer_operands(inputs, attrs)
    d = hidden // nh
    B, S = list(x.ty.shape)[:2]
    scale = 1.0 / math.sqrt(d)

    def emit(e):
        return bb.emit(e)

    def project(weight, bias_):
        qkv = emit(relax.op.add(emit(relax.op.matmul(x, weight)), bias_))          # [B, S, 3 hidden]
        parts = emit(relax.op.split(qkv, 3, axis=2))
        return [emit(relax.op.permute_dims(emit(relax.op.reshape(emit(relax.TupleGetItem(parts, i)),
                                                                 [B, S, nh, d])), [0, 2, 1, 3]))
                for i in range(3)]

    def as_tokens(t):     # [B, S] with the input's dims (symbolic dims under other names: a reshape)
        if all(Analyzer().can_prove_equal(a, c) for a, c in zip(t.ty.shape, [B, S])):
            return t
        return emit(relax.op.reshape(t, [B, S]))

    pattern_inputs = set()
    for i in (3, 6):        # mask, global: the graph inputs they come from, else their own names
        name, graph_inputs = (input_sources or [])[i] if input_sources and len(input_sources) > i else (None, [])
        pattern_inputs |= set(graph_inputs) or ({name} if name else set())
    source = "attention:" + (",".join(sorted(pattern_inputs)) or "LongformerAttention")
    mask, flags = as_tokens(mask), as_tokens(flags)
    q, k, v = project(w, b)
    gq, gk, gv = project(gw, gb)
    pad = emit(relax.op.less(emit(relax.op.astype(mask, "float32")), relax.const(0.0, "float32")))    # [B, S]
    flags32 = flags if str(flags.ty.dtype) == "int32" else emit(relax.op.astype(
        emit(relax.op.not_equal(flags, relax.const(0, str(flags.ty.dtype)))), "int32"))
    is_global = emit(relax.op.not_equal(flags32, relax.const(0, "int32")))                            # [B, S]
    target = make_target(target or "llvm")
    reason = None if sparse is not False else "sparse_attention=False"
    # (a name of the mask or global input takes the sparse kernel whatever the target)
    named = isinstance(sparse, str) and sparse in pattern_inputs
    if reason is None and not named and not fast_kernel_applies(target, d, dtype):
        reason = (f"no fast sparse kernel for {target.kind.name} {target.attrs.get('arch', '')}, head dim {d}, "
                  f"{dtype} (the generic CUDA kernel is slower than the dense attention)")
        warnings.warn(f"{LONGFORMER} {node_output!r}: {reason}; it runs dense", stacklevel=2)
    elif reason is None:
        try:
            doc_ids = emit(relax.op.astype(pad, "int32"))
            runtime = dict(global_flags=flags32, doc_ids=doc_ids, scale=scale, target=target)
            local = emit_sparse_attention(bb, q, k, v, AttentionPattern(window=window, global_tokens=True,
                                                                        documents=True), **runtime)
            glob = emit_sparse_attention(bb, gq, gk, gv, AttentionPattern(window=0, global_tokens=True, documents=True),
                                         **runtime)
        except ValueError as err:
            reason = f"the sparse attention op refused it ({err})"
            warnings.warn(f"{LONGFORMER} {node_output!r}: {reason}; it runs dense", stacklevel=2)
    if reason is not None:
        keys = emit(relax.op.expand_dims(emit(relax.op.logical_not(pad)), [1, 2]))                   # [B, 1, 1, S]
        idx = emit(relax.op.arange(tirx.const(0, "int64"), S, tirx.const(1, "int64"), "int64"))        # [S]
        diff = emit(relax.op.abs(emit(relax.op.subtract(emit(relax.op.expand_dims(idx, 1)),
                                                         emit(relax.op.expand_dims(idx, 0))))))
        band = emit(relax.op.less_equal(diff, relax.const(window, "int64")))                            # [S, S]
        near = emit(relax.op.logical_or(emit(relax.op.expand_dims(band, [0, 1])),
                                        emit(relax.op.expand_dims(is_global, [1, 2]))))               # [B, 1, S, S]
        fill = relax.const(-65504.0 if dtype == "float16" else -1.0e30, dtype)

        def dense(q_, k_, v_, allowed, which):
            scores = emit(relax.op.multiply(emit(relax.op.matmul(q_, emit(relax.op.permute_dims(k_, [0, 1, 3, 2])))),
                                            relax.const(scale, dtype)))
            probs = emit(relax.op.nn.softmax(emit(relax.op.where(allowed, scores, fill)), axis=-1))
            return bb.emit(relax.op.matmul(probs, v_), name_hint=sanitize(f"{node_output or 'longformer'}_{which}"))

        local = dense(q, k, v, emit(relax.op.logical_and(keys, near)), "local")
        glob = dense(gq, gk, gv, keys, "global")
    # the rows' choice as 0 / 1 factors in the data's dtype, exact for finite values (x * 1 + y * 0
    # is x): a where on these [B, 1, S, 1] booleans, fused into the dense path's P V matmul, became a
    # 4-lane boolean select that TVM's CUDA codegen declares half4 (nvcc rejects it)
    rows_global = emit(relax.op.astype(emit(relax.op.expand_dims(is_global, [1, 3])), dtype))           # [B, 1, S, 1]
    rows_real = emit(relax.op.astype(emit(relax.op.expand_dims(emit(relax.op.logical_not(pad)), [1, 3])), dtype))
    one = relax.const(1.0, dtype)
    out = emit(relax.op.add(emit(relax.op.multiply(glob, rows_global)),
                            emit(relax.op.multiply(local, emit(relax.op.subtract(one, rows_global))))))
    out = emit(relax.op.multiply(out, rows_real))
    out = emit(relax.op.reshape(emit(relax.op.permute_dims(out, [0, 2, 1, 3])), [B, S, hidden]))
    if notes is not None:
        tensor = node_output or "LongformerAttention"
        if reason is None:
            notes.append({"tensor": tensor, "source": source, "status": "pit",
                          "reason": f"{LONGFORMER}: window +-{window} and global tokens per call, padding from the "
                                    "mask: block-sparse attention (local and global projections, block index "
                                    "built on the device every call)"})
        else:
            notes.append({"tensor": tensor, "source": source, "status": "dense",
                          "reason": f"{LONGFORMER}: {reason}; dense [B, 1, S, S] masks"})
    return out


#: ONNX op type -> converter ``(bb, inputs, attrs, target=, sparse=, notes=, node_output=) -> relax
#: expr``, for contrib ops TVM lacks
CONTRIB_CONVERTERS = {"SparseAttention": sparse_attention_contrib, "LongformerAttention": longformer_attention_contrib}
