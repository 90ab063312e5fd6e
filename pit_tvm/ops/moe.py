"""Mixture-of-experts FFN as PIT: the expert-routed matmul (docs/guide/moe.md, docs/design/moe.md).

Kept as one module: :class:`MoESpec`, its numpy references, the Relax emitter and
:class:`MoEFFN` are the op's one public surface; its kernels live in
:mod:`pit_tvm.schedules.moe_routing`, :mod:`pit_tvm.schedules.grouped_gemm` and
:mod:`pit_tvm.schedules.hopper`.

``y = sum over a token's k routed experts e of  w_e * fc2_e(act(fc1_e(x)))``.  In PIT's terms
the token axis of every expert's FFN is permutation invariant; the micro-tile is one token row.
The layer is five on-device steps, none of which reads a value back to the host:

1. routing (:func:`pit_tvm.schedules.moe_routing.routing_func`): ``router[T, E]`` ->
   ``expert_ids[T, k]``, ``route_weight[T*k]`` (fp32);
2. the expert index (:func:`pit_tvm.index.expert_index_func`, or
   :func:`~pit_tvm.index.expert_capacity_index_func` with a capacity): ``offsets[E+1]``,
   ``assignments[T*k]`` grouped by expert, ascending within one;
3. fc1, grouped GEMM in ``"gather"`` mode (SRead: token rows gathered per expert tile), with the
   bias and activation in its epilogue; a gated FFN (SwiGLU / GeGLU) on sm_90a computes both
   halves in one kernel (:func:`glu_gemm_func`), elsewhere a second GEMM takes the first as its gate;
4. fc2, grouped GEMM in ``"scatter"`` mode (SWrite: each row to its assignment, scaled by its
   routing weight);
5. the combine over k (:func:`~pit_tvm.schedules.moe_routing.combine_func`): a fixed-order fp32
   sum per token, no atomics.

:func:`grouped_gemm_func` picks the kernel of steps 3-4: the Hopper wgmma kernel on sm_90a
where it applies, else the generic TIR one (:mod:`pit_tvm.schedules.grouped_gemm`).
"""
from __future__ import annotations

import functools
import math
import os
import warnings
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import tirx

from pit_tvm._args import dtype_name, is_int, positive_int
from pit_tvm.errors import UserError
from pit_tvm.runtime.loader import check_dtype, is_dlpack_tensor, numpy_dtype, op_dlpack_tensor
from pit_tvm.target import DEFAULT_CUDA_ARCH, build, device_for, is_gpu, make_target

ROUTINGS = ("softmax_topk", "topk_softmax")
ROUTER_INPUTS = ("logits", "probs")
ACTIVATIONS = ("relu", "gelu", "silu", "identity", "swiglu", "geglu")
GATED = {"swiglu": "silu", "geglu": "gelu"}
DROPPED_TOKENS = ("zero", "input_scaled")
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class MoESpec:
    """What a routed-expert FFN layer computes (not its shapes or dtypes).

    ``num_experts`` E, ``top_k`` k (experts per token).  ``routing``: ``"softmax_topk"`` (softmax
    over the E router values, the k largest probabilities are the weights: Switch with k=1,
    com.microsoft.MoE) or ``"topk_softmax"`` (the k largest logits, softmax over those k:
    Mixtral).  ``normalize_routing_weights`` (softmax_topk): divide the k weights by their sum.
    ``router_input``: ``"logits"``, or ``"probs"`` when the router tensor already holds the
    probabilities (the softmax over E is skipped; softmax_topk only).  ``activation``: relu,
    gelu (exact erf form), silu, identity, or the gated swiglu / geglu
    (``act(x@w1 + b1) * (x@w3 + b3)`` with act silu / gelu).  ``capacity`` (None: no token is
    dropped): HF Switch's expert capacity, counted per sequence (the second-to-last axis of
    ``x``; all tokens of a 2-D ``x``): an expert keeps its first ``capacity`` assignments in
    token order.  ``dropped_token``: what a dropped assignment contributes: ``"zero"`` (HF
    transformers 5.x, whose experts ``index_add_`` only the routed tokens) or
    ``"input_scaled"`` (HF transformers 4.x: ``router_prob * x``).  Ties in the top-k go to the lower
    expert id.
    """

    num_experts: int
    top_k: int = 1
    routing: str = "softmax_topk"
    normalize_routing_weights: bool = False
    router_input: str = "logits"
    activation: str = "relu"
    capacity: int | None = None
    dropped_token: str = "zero"

    def __post_init__(self):
        for name in ("num_experts", "top_k"):
            v = getattr(self, name)
            if not is_int(v) or v <= 0:
                raise UserError(f"MoESpec.{name} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            raise UserError(f"MoESpec.top_k={self.top_k} exceeds num_experts={self.num_experts}: "
                            "a token cannot pick more experts than there are")
        if self.routing not in ROUTINGS:
            raise UserError(f"MoESpec.routing {self.routing!r} unsupported: use one of {', '.join(ROUTINGS)}")
        if self.router_input not in ROUTER_INPUTS:
            raise UserError(f"MoESpec.router_input {self.router_input!r} unsupported: use 'logits' or 'probs'")
        if self.router_input == "probs" and self.routing != "softmax_topk":
            raise UserError("MoESpec.router_input='probs' needs routing='softmax_topk' (topk_softmax takes "
                            "a softmax over the k selected logits)")
        if not isinstance(self.normalize_routing_weights, (bool, np.bool_)):
            raise UserError(f"MoESpec.normalize_routing_weights must be a bool, got {self.normalize_routing_weights!r}")
        if self.activation not in ACTIVATIONS:
            raise UserError(f"MoESpec.activation {self.activation!r} unsupported: use one of {', '.join(ACTIVATIONS)}")
        if self.capacity is not None and (not is_int(self.capacity) or self.capacity <= 0):
            raise UserError(f"MoESpec.capacity must be a positive int or None, got {self.capacity!r}")
        if self.dropped_token not in DROPPED_TOKENS:
            raise UserError(f"MoESpec.dropped_token {self.dropped_token!r} unsupported: use 'zero' or 'input_scaled'")

    @property
    def gated(self) -> bool:
        """Whether the activation needs the third weight w3 (SwiGLU / GeGLU)."""
        return self.activation in GATED

    def validate(self, x_shape, router_shape, w1_shape, w2_shape, *, b1_shape=None, b2_shape=None,
                 w3_shape=None, b3_shape=None, dtype=None, router_dtype=None) -> tuple[int, int]:
        """Check the shapes (and dtypes where given) of a layer's tensors against this spec;
        return ``(d, f)``.  Dims may be ints or TVM expressions (symbolic ones are not compared).
        Layout: ``x[..., d]``, ``router[..., E]`` (``x``'s leading dims, or ``[T, E]``),
        ``w1, w3: [E, d, f]``, ``w2: [E, f, d]``, ``b1, b3: [E, f]``, ``b2: [E, d]``."""
        x_shape, router_shape = _dims(x_shape), _dims(router_shape)
        w1_shape, w2_shape = _dims(w1_shape), _dims(w2_shape)
        E = self.num_experts
        if len(x_shape) < 2:
            raise UserError(f"MoE input x must be [..., d] with at least 2 dims (tokens, d), "
                            f"got shape {_show(x_shape)}")
        d = x_shape[-1]
        if not isinstance(d, int):
            raise UserError(f"MoE input x: its last dim (d) must be static, got shape {_show(x_shape)}")
        if len(w1_shape) != 3 or not all(isinstance(v, int) for v in w1_shape):
            raise UserError(f"MoE weight w1 must be a static [E, d, f] = [{E}, {d}, f], got shape {_show(w1_shape)}")
        f = w1_shape[2]
        if w1_shape[:2] != [E, d]:
            raise UserError(f"MoE weight w1 has shape {_show(w1_shape)}: [E, d, f] = [{E}, {d}, f] expected "
                            f"(E from the spec, d from x {_show(x_shape)})")
        if w2_shape != [E, f, d]:
            raise UserError(f"MoE weight w2 has shape {_show(w2_shape)}: [E, f, d] = [{E}, {f}, {d}] expected "
                            "(it must agree with w1 [E, d, f])")
        lead = x_shape[:-1]
        if not router_shape or router_shape[-1] != E and isinstance(router_shape[-1], int):
            raise UserError(f"MoE router has shape {_show(router_shape)}: [T, E] with E={E} (the spec's "
                            f"num_experts) expected")
        if self.top_k > E:      # (also refused by the spec itself)
            raise UserError(f"MoE top_k={self.top_k} exceeds the {E} experts")
        r_lead = router_shape[:-1]
        tokens = _product(lead)
        if not (_same(r_lead, lead) or (len(r_lead) == 1 and _same([_product(r_lead)], [tokens]))):
            raise UserError(f"MoE router has shape {_show(router_shape)}: [T, E] with T the tokens of x "
                            f"{_show(x_shape)} (or x's leading dims + [E]) expected")
        for name, shape, want in (("b1", b1_shape, [E, f]), ("b2", b2_shape, [E, d]), ("w3", w3_shape, [E, d, f]),
                                  ("b3", b3_shape, [E, f])):
            if shape is not None and _dims(shape) != want:
                raise UserError(f"MoE tensor {name} has shape {_show(_dims(shape))}: {_show(want)} expected")
        if self.gated and w3_shape is None:
            raise UserError(f"MoE activation {self.activation!r} is gated: it needs the third weight w3 [E, d, f]")
        if not self.gated and (w3_shape is not None or b3_shape is not None):
            raise UserError(f"MoE activation {self.activation!r} takes no w3 / b3 (only swiglu and geglu do)")
        if b3_shape is not None and w3_shape is None:
            raise UserError("MoE bias b3 given without w3")
        if dtype is not None and dtype_name(dtype) not in SUPPORTED_DTYPES:
            raise UserError(f"MoE dtype {dtype_name(dtype)!r} unsupported: use one of {', '.join(SUPPORTED_DTYPES)}")
        if router_dtype is not None and dtype_name(router_dtype) not in SUPPORTED_DTYPES:
            raise UserError(f"MoE router dtype {dtype_name(router_dtype)!r} unsupported: use one of "
                            f"{', '.join(SUPPORTED_DTYPES)}")
        return d, f


def _dims(shape) -> list:
    if shape is None:
        return None
    out = []
    for s in shape:
        if isinstance(s, tirx.IntImm):
            out.append(int(s))
        elif is_int(s):
            out.append(int(s))
        else:
            out.append(s)
    return out


def _show(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _product(dims):
    out = 1
    for d in dims:
        out = out * d
    if not isinstance(out, int):
        from tvm.sym.analyzer import Analyzer

        out = Analyzer().simplify(out)
        return int(out) if isinstance(out, tirx.IntImm) else out
    return out


def _same(xs, ys) -> bool:
    """Dims that are equal where both are static and structurally equal otherwise."""
    if len(xs) != len(ys):
        return False
    import tvm_ffi

    for x, y in zip(xs, ys):
        if isinstance(x, int) and isinstance(y, int):
            if x != y:
                return False
        elif isinstance(x, int) or isinstance(y, int):
            continue            # one static, one symbolic: checked at run time by the VM
        elif not tvm_ffi.structural_equal(x, y):
            return False
    return True


# ------------------------------------------------------------------------------ reference
def _np_activation(v, activation):
    if activation in ("identity", None, "none"):
        return v
    if activation == "relu":
        return np.maximum(v, 0)
    if activation == "gelu":
        from math import erf

        return 0.5 * v * (1.0 + np.vectorize(erf, otypes=[np.float64])(v / math.sqrt(2.0)))
    if activation == "silu":
        return v / (1.0 + np.exp(-v))
    raise ValueError(f"unknown activation {activation!r}")


def reference_routing(router, spec: MoESpec):
    """Numpy (fp64) routing of ``router[T, E]``: ``(expert_ids[T, k] int32, weights[T, k])``."""
    r = np.asarray(router, dtype=np.float64).reshape(-1, spec.num_experts)
    # the k largest, ties to the lower expert id
    order = np.argsort(-r, axis=1, kind="stable")[:, : spec.top_k]
    vals = np.take_along_axis(r, order, axis=1)
    if spec.routing == "softmax_topk":
        if spec.router_input == "logits":
            m = r.max(axis=1, keepdims=True)
            vals = np.exp(vals - m) / np.exp(r - m).sum(axis=1, keepdims=True)
        if spec.normalize_routing_weights:
            vals = vals / vals.sum(axis=1, keepdims=True)
    else:
        e = np.exp(vals - vals[:, :1])
        vals = e / e.sum(axis=1, keepdims=True)
    return order.astype(np.int32), vals


def reference_moe(x, router, w1, w2, spec: MoESpec, b1=None, b2=None, w3=None, b3=None) -> np.ndarray:
    """Numpy (fp64) reference of the op: ``y`` of ``x``'s shape, float64.  Capacity dropping as
    HF Switch: per sequence (``x``'s second-to-last axis; a 2-D ``x`` is one sequence), an expert
    keeps its first ``capacity`` assignments in token order."""
    x = np.asarray(x, dtype=np.float64)
    shape = x.shape
    d = shape[-1]
    seq = shape[-2] if x.ndim >= 3 else int(np.prod(shape[:-1]))
    x2 = x.reshape(-1, d)
    ntok = x2.shape[0]
    ids, weights = reference_routing(router, spec)
    k = spec.top_k
    kept = np.ones((ntok, k), dtype=bool)
    if spec.capacity is not None:
        for s0 in range(0, ntok, max(seq, 1)):
            seen = np.zeros(spec.num_experts, dtype=np.int64)
            for t in range(s0, min(s0 + seq, ntok)):
                for j in range(k):
                    kept[t, j] = seen[ids[t, j]] < spec.capacity
                    seen[ids[t, j]] += 1
    w1, w2, b1, b2, w3, b3 = (None if a is None else np.asarray(a, dtype=np.float64)
                              for a in (w1, w2, b1, b2, w3, b3))
    y = np.zeros_like(x2)
    act = GATED.get(spec.activation, spec.activation)
    for e in range(spec.num_experts):          # each expert once, over all its rows
        t, j = np.nonzero((ids == e) & kept)
        if len(t) == 0:
            continue
        h = x2[t] @ w1[e] + (0 if b1 is None else b1[e])
        h = _np_activation(h, act)
        if spec.gated:
            h = h * (x2[t] @ w3[e] + (0 if b3 is None else b3[e]))
        np.add.at(y, t, weights[t, j][:, None] * (h @ w2[e] + (0 if b2 is None else b2[e])))
    if spec.dropped_token == "input_scaled":
        t, j = np.nonzero(~kept)
        np.add.at(y, t, weights[t, j][:, None] * x2[t])
    return y.reshape(shape)


def reference_grouped_gemm(mode, a, assignments, offsets, w, *, top_k, bias=None, route_weight=None,
                           activation=None, gate=None) -> np.ndarray:
    """Numpy (fp64) reference of the grouped GEMM contract (:func:`grouped_gemm_func`): ``H[P, N]``
    (``"gather"``, times ``gate[P, N]`` where given) or ``Y[P, N]`` (``"scatter"``), the rows no
    position lists zero."""
    a = np.asarray(a, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    offsets, assignments = np.asarray(offsets), np.asarray(assignments)
    positions, n = len(assignments), w.shape[2]
    out = np.zeros((positions, n))
    for e in range(w.shape[0]):
        p = np.arange(offsets[e], offsets[e + 1])
        if len(p) == 0:
            continue
        asg = assignments[p]
        rows = a[asg // top_k] if mode == "gather" else a[p]
        v = rows @ w[e] + (0 if bias is None else np.asarray(bias, np.float64)[e])
        if mode == "gather":
            out[p] = _np_activation(v, activation) * (1 if gate is None else np.asarray(gate, np.float64)[p])
        else:
            out[asg] = np.asarray(route_weight, np.float64)[asg][:, None] * v
    return out


# ------------------------------------------------------------------------------ kernels
def _arch_of(target) -> str:
    return str(target.attrs.get("arch", DEFAULT_CUDA_ARCH))


#: token counts up to which :class:`MoEFFN` builds a decode-size variant of the layer (the
#: grouped kernel's narrow tiles and deep rings, :func:`pit_tvm.schedules.hopper.grouped.grouped_config`)
DECODE_TOKENS = 256


def tile_tokens(tokens):
    """The token count :class:`MoEFFN` plans a call's tiles for (and looks up in a tuning log):
    the call's own at decode size, above :data:`DECODE_TOKENS` the power of two nearest it in log
    scale (at least ``2 * DECODE_TOKENS``, which keeps the regime), so that calls of many token
    counts plan, read the log and build for a handful of them; None stays None (many tokens)."""
    if tokens is None:
        return None
    t = int(tokens)
    return t if t <= DECODE_TOKENS else max(1 << round(math.log2(t)), 2 * DECODE_TOKENS)


def _wgmma_target(target) -> bool:
    """whether builds for ``target`` run the Hopper grouped kernel (sm_90a), whose tiles are knobs"""
    return is_gpu(target) and _arch_of(target) == "sm_90a"


@functools.lru_cache(maxsize=64)
def _grouped_gemm_cached(mode, k, n, num_experts, top_k, dtype, out_dtype, bias, activation, target_key, config,
                         gate):
    target = make_target(tvm.target.Target(target_key))
    if _wgmma_target(target):
        try:
            from pit_tvm.schedules.hopper.grouped import wgmma_grouped_gemm_func
        except ImportError:
            wgmma_grouped_gemm_func = None
        if wgmma_grouped_gemm_func is not None:
            for tiles in dict.fromkeys((config, None)):     # the given tiles, else the kernel's default
                try:
                    func = wgmma_grouped_gemm_func(mode, k, n, num_experts, top_k, dtype, out_dtype, bias,
                                                   activation, tiles, gate)
                except ValueError as err:
                    if tiles is not None:
                        why = err
                    continue    # the shape does not fit these tiles (or any): the generic kernel
                if tiles is None and config is not None:
                    warnings.warn(f"MoE grouped GEMM ({mode}, K={k}, N={n}): tiles {config} do not build "
                                  f"here ({why}); using the default tiles", stacklevel=4)
                return func
    from pit_tvm.schedules.grouped_gemm import grouped_gemm_generic_func

    return grouped_gemm_generic_func(mode, k, n, num_experts, top_k, dtype, out_dtype, bias, activation, target,
                                     gate)


def grouped_gemm_func(mode, k, n, num_experts, top_k, dtype, out_dtype, bias, activation, target, *,
                      config=None, gate=False) -> tirx.PrimFunc:
    """The grouped GEMM PrimFunc of the MoE contract (mode ``"gather"`` / ``"scatter"``): the
    Hopper wgmma kernel (:mod:`pit_tvm.schedules.hopper.grouped`) on an sm_90a target where it
    applies, else the generic TIR kernel (:mod:`pit_tvm.schedules.grouped_gemm`).  ``config``:
    the wgmma kernel's tiles (a :class:`~pit_tvm.schedules.hopper.config.WgmmaConfig`, e.g.
    :func:`grouped_tile_config`'s; None: the kernel's default, the widest tile); tiles that do
    not fit are said and the default taken.  ``gate`` (gather): the output times a gate tensor
    ``G[P, N]``, a parameter after the bias (a gated FFN's second half, its multiply fused).  Made
    once per arguments in a process."""
    activation = None if activation in (None, "none", "identity") else activation
    return _grouped_gemm_cached(mode, int(k), int(n), int(num_experts), int(top_k), str(dtype), str(out_dtype),
                                bool(bias), activation, str(make_target(target)), config, bool(gate))


def grouped_tile_config(mode, k, n, num_experts, top_k, dtype, target, tokens=None, tuning_log=None):
    """The tiles of one grouped GEMM of the layer, chosen on the host: None where ``target``
    does not run the Hopper kernel (the generic kernel has fixed tiles), else the tuned config
    of ``tuning_log`` for the token count nearest ``tokens`` in its regime
    (:func:`pit_tvm.tuning.moe.tuned_moe_config`), else the planner's for ``tokens``
    (:func:`~pit_tvm.schedules.hopper.grouped.grouped_config`: narrow tiles and deep rings for
    decode-size T; ``tokens=None``, a symbolic T: the widest tile).  Mode ``"glu"``: the kernel
    computing both halves of a gated fc1 (planned by :func:`~pit_tvm.schedules.hopper.grouped.glu_config`)."""
    target = make_target(target)
    if not _wgmma_target(target):
        return None
    if tuning_log is not None:
        from pit_tvm.tuning.moe import tuned_moe_config      # warns where the log has none

        tuned = tuned_moe_config(tuning_log, mode, k, n, num_experts, top_k, dtype, target, tokens)
        if tuned is not None:
            return tuned
    try:
        from pit_tvm.schedules.hopper.grouped import planned_config
    except ImportError:
        return None
    return planned_config(mode, int(n), int(num_experts), int(top_k), None if tokens is None else int(tokens))


def glu_tiles(d, f, num_experts, top_k, dtype, target, tokens, tuning_log, plain):
    """The tiles of the kernel computing both halves of a gated fc1 (:func:`glu_gemm_func`) where
    the layer takes it, else None (two GEMMs): on sm_90a, for decode-size T (at most
    :data:`DECODE_TOKENS` tokens: weight-bound, the intermediate's round trip saved), and for
    many tokens where its tile stores at least as many columns of H as the plain fc1's
    (the fine-grained shape, f 1408: 128 against 128, x's rows gathered once instead of twice).
    Where the plain tile is wider (Mixtral, f 14336: 256) the glu tile gathers x's rows as often
    and measured slower (docs/design/moe.md, "One GEMM for both halves").  ``plain``: the plain
    fc1's tiles (:func:`grouped_tile_config` of mode ``"gather"``)."""
    config = grouped_tile_config("glu", d, f, num_experts, top_k, dtype, target, tokens, tuning_log)
    if config is None:
        return None
    if tokens is not None and int(tokens) <= DECODE_TOKENS:
        return config
    return config if plain is None or config.block_n // 2 >= plain.block_n else None


def glu_gemm_func(k, n, num_experts, top_k, dtype, bias, activation, target, config):
    """The Hopper kernel of a gated FFN's fc1 with both halves in one GEMM, ``act(x W1 + b1) *
    (x W3 + b3)`` (:func:`~pit_tvm.schedules.hopper.grouped.wgmma_grouped_gemm_func` with
    ``glu``: x's rows gathered once, no intermediate), or None where it does not apply (not
    sm_90a, no tiles, or, with a warning, tiles the kernel refuses): the layer then runs two grouped
    GEMMs, the second taking the first as its gate."""
    if config is None or not _wgmma_target(make_target(target)):
        return None
    try:
        from pit_tvm.schedules.hopper.grouped import wgmma_grouped_gemm_func
    except ImportError:
        return None
    try:
        return wgmma_grouped_gemm_func("glu", int(k), int(n), int(num_experts), int(top_k), str(dtype), str(dtype),
                                       bool(bias), activation, config)
    except ValueError as err:
        warnings.warn(f"MoE: the glu kernel does not take tiles {config} here ({err}); fc1 runs as two grouped "
                      "GEMMs", stacklevel=2)
        return None


def static_tokens(x_shape):
    """The token count of ``x[..., d]`` where its leading dims are all static, else None."""
    dims = _dims(x_shape)[:-1]
    return int(np.prod(dims)) if all(isinstance(v, int) for v in dims) else None


def _add_once(bb, func):
    """``func`` added to the module under its global symbol, once (a model asks for the same
    kernel for every MoE layer of one shape); opaque to FuseOps: the kernels' symbolic buffers
    must meet their arguments as they are."""
    from pit_tvm.ops.matmul import OPAQUE_OP_PATTERN, add_once

    return add_once(bb, str(func.attrs["global_symbol"]), lambda: func.with_attr("op_pattern", OPAQUE_OP_PATTERN))


def _shape_of(expr):
    from tvm import relax

    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        raise UserError(f"MoE operand {getattr(expr, 'name_hint', expr)!r} must be a tensor of known rank")
    return list(ty.shape), str(ty.dtype)


def emit_moe(bb, x, router, w1, w2, spec: MoESpec, *, b1=None, b2=None, w3=None, b3=None, target="llvm",
             tokens=None, tuning_log=None):
    """Emit the whole MoE layer into ``bb`` (a Relax BlockBuilder, inside a dataflow block);
    return ``y`` (``x``'s shape and dtype).  See the module docstring for the steps and
    :class:`MoESpec` for the semantics; the layouts are :meth:`MoESpec.validate`'s.

    The grouped GEMMs' tiles (sm_90a; :func:`grouped_tile_config`) are chosen for ``tokens``,
    the expected token count: by default ``x``'s where its leading dims are static (decode
    shapes get narrow tiles and deep rings), the widest tile where they are symbolic.
    ``tuning_log``: a ``pit-tvm tune --op moe`` database (or log root) whose tuned tiles win."""
    from tvm import relax

    if not isinstance(spec, MoESpec):
        raise UserError(f"emit_moe needs a MoESpec, got {type(spec).__name__}")
    target = make_target(target)
    x_shape, dtype = _shape_of(x)
    r_shape, r_dtype = _shape_of(router)
    shapes = {name: (_shape_of(v)[0] if v is not None else None) for name, v in
              (("b1", b1), ("b2", b2), ("w3", w3), ("b3", b3))}
    d, f = spec.validate(x_shape, r_shape, _shape_of(w1)[0], _shape_of(w2)[0], b1_shape=shapes["b1"],
                         b2_shape=shapes["b2"], w3_shape=shapes["w3"], b3_shape=shapes["b3"],
                         dtype=dtype, router_dtype=r_dtype)
    for name, v in (("w1", w1), ("w2", w2), ("b1", b1), ("b2", b2), ("w3", w3), ("b3", b3)):
        if v is not None and _shape_of(v)[1] != dtype:
            raise UserError(f"MoE tensor {name} is {_shape_of(v)[1]}, x is {dtype}: the weights must be in x's dtype")
    E, k = spec.num_experts, spec.top_k
    lead = x_shape[:-1]
    ntok = tirx.const(1, "int64")
    for s in lead:
        ntok = ntok * (s if str(s.ty.dtype) == "int64" else tirx.Cast("int64", s))
    # the capacity counts per sequence: x's second-to-last axis (a 2-D x is one sequence)
    batch, seq = tirx.const(1, "int64"), ntok
    if len(lead) >= 2:
        for s in lead[:-1]:
            batch = batch * (s if str(s.ty.dtype) == "int64" else tirx.Cast("int64", s))
        seq = lead[-1] if str(lead[-1].ty.dtype) == "int64" else tirx.Cast("int64", lead[-1])
    x2 = bb.emit(relax.op.reshape(x, [ntok, d])) if len(lead) != 1 else x
    r2 = bb.emit(relax.op.reshape(router, [ntok, E])) if len(r_shape) != 2 else router
    if r_dtype == "bfloat16":
        # (a bf16 router read inside the routing kernel met the CPU pipeline's exp rewrite
        # (ExpToVectorExp) and bf16 legalisation badly: weights of 0; [T, E] in fp32 is cheap)
        r2, r_dtype = bb.emit(relax.op.astype(r2, "float32")), "float32"

    from pit_tvm.index import expert_capacity_index_func, expert_index_func
    from pit_tvm.schedules.moe_routing import combine_func, routing_func

    route_gv = _add_once(bb, routing_func(E, k, spec.routing, spec.normalize_routing_weights,
                                          spec.router_input, r_dtype, target))
    routed = bb.emit(relax.call_tir(route_gv, [r2], [relax.TensorType([ntok, k], "int32"),
                                                      relax.TensorType([ntok * k], "float32")]))
    expert_ids, weights = (bb.emit(relax.TupleGetItem(routed, i)) for i in (0, 1))
    positions = ntok * k
    index_ty = [relax.TensorType([E + 1], "int32"), relax.TensorType([positions], "int32")]
    if spec.capacity is None:
        index_gv = _add_once(bb, expert_index_func(E, k, target))
        index = bb.emit(relax.call_tir(index_gv, [expert_ids], index_ty))
        kept = None
    else:
        index_gv = _add_once(bb, expert_capacity_index_func(E, k, spec.capacity, target))
        ids3 = bb.emit(relax.op.reshape(expert_ids, [batch, seq, k]))
        index = bb.emit(relax.call_tir(index_gv, [ids3], index_ty + [relax.TensorType([positions], "int32")]))
        kept = bb.emit(relax.TupleGetItem(index, 2))
    offsets, assignments = (bb.emit(relax.TupleGetItem(index, i)) for i in (0, 1))

    if tokens is None:
        tokens = static_tokens(x_shape)
    tiles = {mode: grouped_tile_config(mode, kk, n, E, k, dtype, target, tokens, tuning_log)
             for mode, kk, n in (("gather", d, f), ("scatter", f, d))}
    # a gated FFN on sm_90a: both halves of fc1 in one kernel (both biases or neither)
    glu = (glu_gemm_func(d, f, E, k, dtype, b1 is not None, GATED[spec.activation], target,
                         glu_tiles(d, f, E, k, dtype, target, tokens, tuning_log, tiles["gather"]))
           if spec.gated and (b1 is None) == (b3 is None) else None)

    def fc1(w, b, act, gate=None):
        gv = _add_once(bb, grouped_gemm_func("gather", d, f, E, k, dtype, dtype, b is not None, act, target,
                                             config=tiles["gather"], gate=gate is not None))
        args = [x2, assignments, offsets, w] + ([b] if b is not None else []) + ([gate] if gate is not None else [])
        return bb.emit(relax.call_tir(gv, args, relax.TensorType([positions, f], dtype)))

    if glu is not None:
        h = bb.emit(relax.call_tir(_add_once(bb, glu), [x2, assignments, offsets, w1, w3]
                                   + ([b1, b3] if b1 is not None else []), relax.TensorType([positions, f], dtype)))
    else:
        h = fc1(w1, b1, GATED.get(spec.activation, spec.activation))
        if spec.gated:      # the up projection's epilogue multiplies by the activated gate projection
            h = fc1(w3, b3, None, gate=h)
    fc2_gv = _add_once(bb, grouped_gemm_func("scatter", f, d, E, k, dtype, dtype, b2 is not None, None, target,
                                             config=tiles["scatter"]))
    y_rows = bb.emit(relax.call_tir(fc2_gv, [h, assignments, offsets, w2] + ([b2] if b2 is not None else [])
                                    + [weights], relax.TensorType([positions, d], dtype)))
    input_scaled = spec.capacity is not None and spec.dropped_token == "input_scaled"
    if k == 1 and not input_scaled:
        y = bb.emit(relax.op.reshape(y_rows, [ntok, d]))
    else:
        combine_gv = _add_once(bb, combine_func(k, d, dtype, dtype, input_scaled, target))
        args = [y_rows] + ([x2, kept, weights] if input_scaled else [])
        y = bb.emit(relax.call_tir(combine_gv, args, relax.TensorType([ntok, d], dtype)))
    return bb.emit(relax.op.reshape(y, x_shape)) if len(lead) != 1 else y


# ------------------------------------------------------------------------------ Python API
class MoEFFN:
    """A routed-expert FFN layer compiled once per target; called with the tensors each time.

    Use :func:`moe_ffn` to create one.  ``op(x, router, w1, w2, b1=None, b2=None, w3=None,
    b3=None)`` takes numpy arrays or DLPack tensors (torch, TVM, ...): ``x[..., d]``,
    ``router[..., E]`` (x's leading dims, or ``[T, E]``), weights as in :meth:`MoESpec.validate`;
    it returns ``y`` of ``x``'s shape and kind (numpy for numpy, TVM for TVM, torch for torch).
    Each combination of the optional biases is compiled on first use.  The capacity (if any)
    counts per sequence: ``x``'s second-to-last axis (a 2-D ``x`` is one sequence).

    On sm_90a a call runs the variant of the layer whose grouped GEMMs' tiles are the ones
    planned (or tuned) for its token count (:func:`grouped_tile_config`): the same module
    (symbolic T) with those tiles, picked on the host from ``x``'s shape (no device read);
    token counts that come out with the same tiles share one build (the widest tiles: the
    symbolic-T layer's).  ``tuning_log``: a
    ``pit-tvm tune --op moe`` database whose tuned tiles win (docs/guide/tuning.md)."""

    def __init__(self, spec: MoESpec, d, f, dtype="float32", target="llvm", router_dtype=None, tuning_log=None):
        if not isinstance(spec, MoESpec):
            raise TypeError(f"spec must be a MoESpec, got {type(spec).__name__}")
        self.spec = spec
        self.d, self.f = positive_int(d, "d"), positive_int(f, "f")
        self.dtype = dtype_name(dtype, "dtype")
        if self.dtype not in SUPPORTED_DTYPES:
            raise UserError(f"unsupported dtype {self.dtype!r}: the MoE op supports {', '.join(SUPPORTED_DTYPES)}")
        self.router_dtype = self.dtype if router_dtype is None else dtype_name(router_dtype, "router_dtype")
        if self.router_dtype not in SUPPORTED_DTYPES:
            raise UserError(f"unsupported router_dtype {self.router_dtype!r}: use one of {', '.join(SUPPORTED_DTYPES)}")
        from pit_tvm.ops.matmul import op_target

        self.target = op_target(target)
        self.device = device_for(self.target)
        if tuning_log is not None and not isinstance(tuning_log, (str, os.PathLike)):
            raise TypeError(f"tuning_log must be a path (str or os.PathLike) or None, got {type(tuning_log).__name__}")
        self.tuning_log = tuning_log
        self._mains = {}        # (which optional tensors are given, tiles) -> the VM function
        self._tiles_of = {}     # tile_tokens(T) (None: many) -> the grouped GEMMs' tiles

    def tiles(self, tokens=None) -> tuple:
        """The grouped GEMMs' tiles ``(fc1, fc2)`` a call of ``tokens`` tokens runs (None: the
        symbolic-T layer's, the widest; a gated FFN's fc1: the glu kernel's where
        :func:`glu_tiles` takes it), planned for :func:`tile_tokens`; ``(None, None)`` off sm_90a."""
        tokens = tile_tokens(tokens)
        if tokens not in self._tiles_of:
            E, k = self.spec.num_experts, self.spec.top_k
            fc1, fc2 = (grouped_tile_config(mode, kk, n, E, k, self.dtype, self.target, tokens, self.tuning_log)
                        for mode, kk, n in (("gather", self.d, self.f), ("scatter", self.f, self.d)))
            glu = (glu_tiles(self.d, self.f, E, k, self.dtype, self.target, tokens, self.tuning_log, fc1)
                   if self.spec.gated else None)
            self._tiles_of[tokens] = (fc1 if glu is None else glu, fc2)
        return self._tiles_of[tokens]

    def module(self, optional=(False, False, False, False), tokens=None) -> tvm.IRModule:
        """The Relax module of the layer for the optional tensors ``(b1, b2, w3, b3)`` given or
        not: ``main(x[B, S, d], router[B, S, E], w1, w2, ...)`` of :func:`emit_moe`, its T
        symbolic; ``tokens``: the token count its tiles are chosen for (None: many)."""
        from tvm import relax

        E, d, f = self.spec.num_experts, self.d, self.f
        nb, ns = tirx.Var("batch", "int64"), tirx.Var("seq", "int64")
        params = [relax.Var("x", relax.TensorType([nb, ns, d], self.dtype)),
                  relax.Var("router", relax.TensorType([nb, ns, E], self.router_dtype)),
                  relax.Var("w1", relax.TensorType([E, d, f], self.dtype)),
                  relax.Var("w2", relax.TensorType([E, f, d], self.dtype))]
        shapes = {"b1": [E, f], "b2": [E, d], "w3": [E, d, f], "b3": [E, f]}
        extra = {}
        for name, present in zip(("b1", "b2", "w3", "b3"), optional):
            if present:
                extra[name] = relax.Var(name, relax.TensorType(shapes[name], self.dtype))
        bb = relax.BlockBuilder()
        with bb.function("main", params + list(extra.values())):
            with bb.dataflow():
                y = emit_moe(bb, *params, self.spec, target=self.target, tokens=tokens,
                             tuning_log=self.tuning_log, **extra)
                out = bb.emit_output(y)
            bb.emit_func_output(out)
        return bb.get()

    def executable(self, optional=(False, False, False, False), tokens=None):
        """The layer built for ``self.target`` (:meth:`module`); on CUDA it needs no GPU."""
        return build(self.module(tuple(bool(v) for v in optional), tokens), self.target)

    def _build(self, optional: tuple, tokens=None):
        from tvm import relax

        return relax.VirtualMachine(self.executable(optional, tokens), self.device)["main"]

    def variant_tokens(self, tokens):
        """The token count the build a call of ``tokens`` tokens runs is made for: None for the
        symbolic-T layer (where the call's tiles are the widest), else :func:`tile_tokens`."""
        return None if self.tiles(tokens) == self.tiles(None) else tile_tokens(tokens)

    def _main(self, optional: tuple, tokens: int):
        """the VM function for a call of ``tokens`` tokens: the variant of the tiles they take
        (the symbolic-T layer's where those are the widest)"""
        key = (optional, self.tiles(tokens))
        main = self._mains.get(key)
        if main is None:
            # (a variant is the tiles: token counts that plan the same tiles share it)
            main = self._mains[key] = self._build(optional, self.variant_tokens(tokens))
        return main

    def _tensor(self, value, name, dtype):
        if value is None:
            raise TypeError(f"{name} must be a numpy array or a DLPack tensor, got None")
        if is_dlpack_tensor(value):
            return op_dlpack_tensor(value, f"MoE {name}", dtype, self.device, UserError)
        arr = np.asarray(value)
        check_dtype(arr.dtype, f"MoE {name}", dtype, UserError)
        return tvm.runtime.tensor(np.ascontiguousarray(arr).astype(numpy_dtype(dtype), copy=False), self.device)

    def __call__(self, x, router, w1, w2, b1=None, b2=None, w3=None, b3=None):
        names = ("x", "router", "w1", "w2", "b1", "b2", "w3", "b3")
        given = dict(zip(names, (x, router, w1, w2, b1, b2, w3, b3)))
        tensors = {n: self._tensor(v, n, self.router_dtype if n == "router" else self.dtype)
                   for n, v in given.items() if v is not None}
        shape = lambda n: None if n not in tensors else [int(s) for s in tensors[n].shape]  # noqa: E731
        self.spec.validate(shape("x"), shape("router"), shape("w1"), shape("w2"), b1_shape=shape("b1"),
                           b2_shape=shape("b2"), w3_shape=shape("w3"), b3_shape=shape("b3"))
        if shape("w1")[2] != self.f or shape("x")[-1] != self.d:
            raise UserError(f"MoE op built for d={self.d}, f={self.f}: got x {shape('x')} and w1 {shape('w1')}")
        x_shape = shape("x")
        seq = x_shape[-2] if len(x_shape) >= 3 else int(np.prod(x_shape[:-1]))
        ntok = int(np.prod(x_shape[:-1]))
        nb = ntok // seq if seq else 1
        x_t = tensors["x"]._create_view((nb, seq, self.d))
        r_t = tensors["router"]._create_view((nb, seq, self.spec.num_experts))
        optional = tuple(n in tensors for n in ("b1", "b2", "w3", "b3"))
        main = self._main(optional, ntok)
        y = main(x_t, r_t, tensors["w1"], tensors["w2"], *[tensors[n] for n in ("b1", "b2", "w3", "b3")
                                                             if n in tensors])
        y = y._create_view(tuple(x_shape))
        if isinstance(x, tvm.runtime.Tensor):
            return y
        if type(x).__module__.startswith("torch"):
            import torch

            return torch.from_dlpack(y)
        return y.numpy()


def moe_ffn(spec: MoESpec, d, f, dtype="float32", target="llvm", router_dtype=None, tuning_log=None) -> MoEFFN:
    """Compile the routed-expert FFN ``spec`` for hidden size ``d``, expert width ``f`` and
    ``dtype`` on ``target`` (``"llvm"``, ``"cuda"``, ``"cuda:sm_XY"``); the router may have its
    own ``router_dtype`` (default: ``dtype``); ``tuning_log``: tuned grouped-GEMM tiles
    (``pit-tvm tune --op moe``, sm_90a).  See :class:`MoEFFN`."""
    return MoEFFN(spec, d, f, dtype, target, router_dtype, tuning_log)
