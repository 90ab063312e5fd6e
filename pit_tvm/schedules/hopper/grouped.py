"""The grouped GEMM of a mixture-of-experts layer on the H100 (sm_90a): each CTA computes one
128 x block_n tile of one expert's rows, the rows kernel's body (:mod:`.gemm_body`) with the
expert's weight as B.  Checks the arguments, builds the body in mode "gather" or "scatter" and
lowers it.  Contract: docs/design/moe.md ("Grouped GEMM kernel")::

    gather  (fc1): grouped_gemm(X[T, K], assignments[P], offsets[E+1], W[E, K, N], [bias[E, N]], [G[P, N]],
                                H[P, N])
        H[p, :] = act(X[assignments[p] // top_k, :] @ W[e] + bias[e])   p in [offsets[e], offsets[e+1])
                  (* G[p, :] with a gate, in H's dtype: a gated FFN's up half times its gate half)
        H[p, :] = 0                                                      p >= offsets[E]
    glu (a gated FFN's fc1, both halves in one GEMM):
        grouped_gemm(X[T, K], assignments[P], offsets[E+1], W1[E, K, N], W3[E, K, N], [b1[E, N], b3[E, N]], H[P, N])
        H[p, :] = act(X[t] @ W1[e] + b1[e]) * (X[t] @ W3[e] + b3[e])   in fp32, rounded once to H's dtype
    scatter (fc2): grouped_gemm(H[P, K], assignments[P], offsets[E+1], W[E, K, N], [bias[E, N]],
                                route_weight[P] (fp32), Y[P, N])
        Y[assignments[p], :] = route_weight[assignments[p]] * act(H[p, :] @ W[e] + bias[e])
        Y[f, :] = 0                          for the flat ids f that no assignments[p < offsets[E]] lists

(``act`` is the identity in fc2 as the op uses it; any of the activations is taken.)  The grid
has ``ceil(P / 128) + E`` CTAs per N tile: CTA ``bt`` computes the ``bt``-th (expert, row tile)
pair (:mod:`.experts`), the CTAs past the last pair store the rows no pair does.  A's rows
come by cp.async through the index (the loader warpgroup), B = W[e]'s K tiles by TMA from a
tensor map over W viewed as ``[E * K, N]``.
"""
from __future__ import annotations

import functools
import math

from tvm import tirx

from pit_tvm.schedules.hopper.config import BLOCK_K, BLOCK_M, MAX_SMEM_BYTES, TARGET, THREADS, WgmmaConfig
from pit_tvm.schedules.hopper.gemm_body import gemm_kernel
from pit_tvm.schedules.hopper.lowering import lower_tirx
from pit_tvm.schedules.hopper.planner import wgmma_config
from pit_tvm.schedules.limits import IN_DTYPES, OUT_DTYPES

__all__ = ["wgmma_grouped_gemm_func", "grouped_config", "glu_config", "planned_config", "check_grouped_config",
           "GROUPED_ATTR", "GROUPED_ACTIVATIONS", "GROUPED_MODES", "MAX_EXPERTS"]

#: the kernel's modes: fc1 ("gather"), fc2 ("scatter"), a gated FFN's fc1 with both halves in one
#: GEMM ("glu": a gather over two weights)
GROUPED_MODES = ("gather", "scatter", "glu")

#: the attr of a grouped GEMM kernel: its mode, experts, top_k and :class:`WgmmaConfig`'s knobs
GROUPED_ATTR = "pit.wgmma_grouped"
#: the epilogue activations the kernel takes (None: none)
GROUPED_ACTIVATIONS = (None, "relu", "gelu", "silu")
#: experts the in-CTA scan of tile counts takes (one a consumer thread)
MAX_EXPERTS = THREADS


def _activation(activation):
    act = None if activation in (None, "none", "identity") else activation
    if act not in GROUPED_ACTIVATIONS:
        raise ValueError(f"the grouped GEMM's epilogue takes activation none / relu / gelu / silu, "
                         f"got {activation!r} (gated ones: two GEMMs, the second with the first as its gate)")
    return act


def expected_pairs(num_experts: int, top_k: int, tokens: int) -> int:
    """The (expert, 128-row tile) pairs that ``tokens`` tokens routed uniformly at random make:
    one a receiving expert while an expert receives under 128 rows (decode), else ``P / 128``
    plus half a tile a receiving expert (its last tile's rows)."""
    p = int(tokens) * int(top_k)
    active = num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** p)
    if p < BLOCK_M * active:
        return max(1, math.ceil(active))
    return math.ceil(p / BLOCK_M + active / 2)


def grouped_config(n: int, num_experts: int, top_k: int = 1, tokens: int | None = None,
                   block_n: int | None = None) -> WgmmaConfig | None:
    """The tiles for N: :func:`.planner.wgmma_config` for the rows of the pairs that ``tokens``
    make (:func:`expected_pairs`; None: many tokens, the widest tile).  Few tokens (decode) make
    about one pair an expert, so the planner's whole-wave cost narrows the tile until the
    experts' N tiles fill the SMs, with the few-rows tier's deeper ring: the kernel is then
    bound by reading the active experts' weights, and more CTAs with more K tiles in flight
    read them faster (docs/design/moe.md).  ``block_n``: that width instead of the chosen one
    (:func:`.planner.wgmma_config`'s)."""
    rows = None if tokens is None else BLOCK_M * expected_pairs(num_experts, top_k, tokens)
    return wgmma_config(n, rows, block_n)


def glu_config(n: int, num_experts: int, top_k: int = 1, tokens: int | None = None) -> WgmmaConfig | None:
    """The tiles of the glu kernel (both halves of a gated FFN's fc1, N columns each): the
    planner's for 2 N accumulator columns (:func:`grouped_config`), narrowed to the widths whose
    halves are whole 64-column atoms (256 or 128); None where neither divides 2 N."""
    config = grouped_config(2 * n, num_experts, top_k, tokens)
    if config is not None and config.block_n in (128, 256):
        return config
    return grouped_config(2 * n, num_experts, top_k, tokens, block_n=128)


def planned_config(mode: str, n: int, num_experts: int, top_k: int = 1,
                   tokens: int | None = None) -> WgmmaConfig | None:
    """The planner's tiles of the kernel of ``mode``: :func:`glu_config` for "glu", else
    :func:`grouped_config`."""
    return (glu_config if mode == "glu" else grouped_config)(n, num_experts, top_k, tokens)


def check_grouped_config(mode: str, k: int, n: int, num_experts: int, top_k: int, in_dtype: str, out_dtype: str,
                         config: WgmmaConfig | None) -> None:
    """Raise ValueError where the grouped kernel does not take these arguments and tiles (the
    checks of :func:`wgmma_grouped_gemm_func`; the tuning space's filter)."""
    if mode not in GROUPED_MODES:
        raise ValueError(f"the grouped GEMM's mode is 'gather' (fc1), 'scatter' (fc2) or 'glu' (a gated fc1's "
                         f"both halves), got {mode!r}")
    glu = mode == "glu"
    if not 0 < int(num_experts) <= MAX_EXPERTS:
        raise ValueError(f"the grouped GEMM takes 1..{MAX_EXPERTS} experts, got {num_experts}")
    if int(top_k) < 1 or int(top_k) > int(num_experts):
        raise ValueError(f"top_k must be in 1..num_experts={num_experts}, got {top_k}")
    if in_dtype not in IN_DTYPES or out_dtype not in OUT_DTYPES:
        raise ValueError(f"wgmma takes {IN_DTYPES} in and {OUT_DTYPES} out, got {in_dtype} -> {out_dtype}")
    if (config is None or k % BLOCK_K or (2 if glu else 1) * n % config.block_n or config.block_n % 64
            or config.block_k != BLOCK_K):
        raise ValueError(f"the grouped GEMM's tiles need K % {BLOCK_K} == 0 and N % block_n == 0 (block_n a "
                         f"multiple of 64, block_k {BLOCK_K}; glu: 2 N), got K={k}, N={n}, {config}")
    if glu and config.block_n % 128:
        raise ValueError(f"the glu kernel (both halves of a gated FFN) takes block_n 128 or 256, got {config}")
    if config.stages < 3 or config.smem_bytes(out_dtype) > MAX_SMEM_BYTES:
        raise ValueError(f"{config} needs >= 3 stages and at most {MAX_SMEM_BYTES} B of shared memory")


@functools.lru_cache(maxsize=64)
def wgmma_grouped_gemm_func(mode: str, k: int, n: int, num_experts: int, top_k: int, in_dtype: str = "float16",
                            out_dtype: str = "float16", bias: bool = False, activation: str | None = None,
                            config: WgmmaConfig | None = None, gate: bool = False) -> tirx.PrimFunc:
    """The lowered grouped GEMM PrimFunc (the module docstring's contract), mode "gather" (fc1),
    "scatter" (fc2) or "glu" (both halves of a gated FFN's fc1, ``activation`` on W1's), for
    ``num_experts`` weights ``[E, k, n]``; ``T`` and ``P`` symbolic.  ``config``: the tiles
    (default :func:`planned_config` for many tokens; 64-deep K tiles).  ``gate`` (gather): the
    output times a gate tensor ``G[P, N]`` (the contract above).  Raises ValueError when the
    shape, dtypes or config do not fit."""
    act = _activation(activation)
    config = config or planned_config(mode, n, num_experts, top_k)
    check_grouped_config(mode, k, n, num_experts, top_k, in_dtype, out_dtype, config)
    glu = mode == "glu"
    body_mode = "gather" if glu else mode      # (glu: the gather body over two weights)
    func = gemm_kernel(int(k), int(n), in_dtype, out_dtype, bool(bias), act, body_mode, config,
                       row_scale=mode == "scatter", num_experts=int(num_experts), top_k=int(top_k), gate=bool(gate),
                       glu=glu)
    func = lower_tirx(func, TARGET)
    # (a name of its own: a module holding fc1 and fc2, or two layers' kernels, adds each once by name)
    name = (f"wgmma_grouped_{body_mode}_k{k}_n{n}_e{num_experts}_top{top_k}_{in_dtype}_{out_dtype}"
            f"{'_bias' if bias else ''}{'_' + act if act else ''}{'_gated' if gate else ''}{'_glu' if glu else ''}"
            f"_bn{config.block_n}s{config.stages}")
    return func.with_attrs({"global_symbol": name,
                            GROUPED_ATTR: {"mode": mode, "num_experts": int(num_experts), "top_k": int(top_k),
                                           "block_n": config.block_n, "stages": config.stages,
                                           "gate": bool(gate), "glu": glu}})
