"""PIT's on-device sparse index: the compact, ascending list of non-zero micro-tiles.

Kept as one module: the builders of every index kind, :class:`IndexBuilder` and the numpy
references the tests compare against all follow the one layout below; the kernels' bodies are
in ``_tile_kernels``.

Layout (CSR over groups) shared by every consumer (matmul kernels, Relax passes):

* ``offsets`` int32 ``[G + 1]``: group ``g``'s entries are ``ids[offsets[g]:offsets[g+1]]``,
  ``offsets[0] = 0``, ``offsets[G]`` = total count.
* ``ids`` int32 ``[capacity]`` (capacity = worst case, never read back to the host), ascending
  within each group, unused tail filled with ``-1`` -- except with a single group (``group="col"``
  and one tile-column: the rows index of a matmul), where the tail lists the *unlisted* ids: a
  kernel zeroes exactly ``ids[count:]`` without searching ``ids[:count]``.  On CUDA that index
  is one kernel which places each CTA's ids with one atomic add, so both parts come in the
  order the CTAs finish (the consumers are permutation invariant: PIT's premise); on the CPU
  both are ascending.  It keeps a counter in a device word that must be zero before a call and
  is left zero by it (:func:`index_state`).

``group="row"``: G = ceil(R/mr) tile-rows, ids are tile-column ids.
``group="col"``: G = ceil(cols/mc) tile-columns, ids are tile-row ids.

Each ``*_func`` returns a PrimFunc already scheduled for its target (see ``_kernels``).
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import tirx
from tvm.script import tirx as T
from tvm.sym.analyzer import Analyzer

from pit_tvm.target import build, device_for, is_gpu, make_target
from pit_tvm._args import dtype_name, micro_tile_pair
from pit_tvm.runtime.loader import dlpack_to_tvm

from ._kernels import make_expert_lists, make_pipeline, num_chunks, schedule_cpu, schedule_cuda
from ._tile_kernels import STATE_DTYPE, STATE_WORDS, make_tile_kernels

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16", "bool")
GROUPS = ("row", "col")

__all__ = [
    "SUPPORTED_DTYPES",
    "GROUPS",
    "tile_index_func",
    "seqlen_row_index_func",
    "expert_index_func",
    "expert_capacity_index_func",
    "IndexBuilder",
    "build_tile_index",
    "tiles_from_index",
    "reference_tile_index",
    "tile_grid",
    "reference_seqlen_row_index",
    "reference_expert_index",
    "reference_expert_capacity_index",
    "strip_positions",
    "strip_column",
    "strip_micro_tile",
    "column_of_id",
    "index_state",
]


# --------------------------------------------------------------------------- validation
def strip_positions(offsets, g, mk):
    """K positions strip ``g`` of a ``group="row"`` index lists: its non-zero micro-tiles x
    ``mk`` (a TIR expression over the ``offsets`` buffer; for the kernels that read the index)."""
    return (offsets[g + 1] - offsets[g]) * mk


def strip_column(offsets, ids, g, q, mk, last):
    """The K column of strip ``g``'s position ``q`` in a ``group="row"`` index; ``last`` is the
    last index of ``ids``: reads are clamped into ``ids`` and never return its ``-1`` tail."""
    return column_of_id(strip_micro_tile(offsets, ids, g, q, mk, last), q, mk)


def strip_micro_tile(offsets, ids, g, q, mk, last):
    """The raw ``ids`` entry behind :func:`strip_column` (the one global load; a kernel that
    loads it ahead of use finishes the column with :func:`column_of_id`)."""
    return ids[T.min(offsets[g] + q // mk, last)]


def column_of_id(micro_tile_id, q, mk):
    """K column of position ``q`` in micro-tile ``micro_tile_id`` (``-1``, past the count, reads
    column 0: its loads are zero-filled or masked by the caller)."""
    return T.max(micro_tile_id, 0) * mk + q % mk


def _check_pos_int(name, v):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or int(v) <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def _check_micro_tile(micro_tile, cols=None):
    mr, mc = micro_tile_pair(micro_tile)
    if cols is not None and mc > cols:
        raise ValueError(f"micro_tile columns {mc} larger than the tensor's {cols} columns")
    return mr, mc


def _check_group(group):
    if group not in GROUPS:
        raise ValueError(f"group must be 'row' or 'col', got {group!r}")
    return group


def _check_dtype(dtype):
    dtype = dtype_name(dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: expected one of {SUPPORTED_DTYPES}")
    return dtype


def _strategy(target, emulate_gpu=False):
    return schedule_cuda() if is_gpu(target) else schedule_cpu(emulate_gpu)


def index_state(func: tirx.PrimFunc):
    """``(words, dtype)`` of the device state an index PrimFunc takes after its inputs (a
    one-group CUDA index: zero before each call, left zero by it), or None."""
    if func.attrs is None or "pit.index.state" not in func.attrs:
        return None
    return int(func.attrs["pit.index.state"]), STATE_DTYPE


def _finish(func, name, target, num_inputs=1):
    func = func.with_attr("global_symbol", name).with_attr("pit.index.num_inputs", num_inputs)
    if is_gpu(target):
        func = func.with_attr("tirx.is_scheduled", True)
    return func


def tile_grid(rows: int, cols: int, micro_tile) -> tuple[int, int]:
    """(tile-rows, tile-cols) of a rows x cols tensor cut into ``micro_tile`` tiles."""
    mr, mc = micro_tile
    return -(-rows // mr), -(-cols // mc)


# --------------------------------------------------------------------------- tile index
def _nz_fn(dtype):
    if dtype == "bool":
        return lambda v: T.Select(v, T.int32(1), T.int32(0))
    # compare the bits with the sign masked off: -0.0 is zero, NaN is non-zero, and no
    # fast-math flag (LLVM's nnan) can fold the test away; integer ops are also cheaper.
    bits, mask = ("uint32", 0x7FFFFFFF) if dtype == "float32" else ("uint16", 0x7FFF)
    return lambda v: T.Select(
        T.bitwise_and(T.reinterpret(bits, v), tirx.const(mask, bits)) != tirx.const(0, bits),
        T.int32(1),
        T.int32(0),
    )


def tile_index_func(cols: int, micro_tile, group: str, dtype: str, target,
                    density_threshold: float | None = None) -> tirx.PrimFunc:
    """PrimFunc ``(data[R, cols], offsets[G+1], ids[G*P])`` building the tile index of ``data``.

    A micro-tile (mr rows x mc columns, partial at the edges) is non-zero if any element
    is != 0 (``True`` for a bool mask). R is symbolic: one build serves every row count.

    ``density_threshold`` (None: off): when more than this fraction of all micro-tiles is
    non-zero, the index lists every micro-tile instead (``offsets[g] = g * P``, ``ids`` the
    tile ids of each group in order), decided on the device inside the same kernels; a PIT
    kernel consuming it then computes densely.
    """
    return _tile_index_func(cols, micro_tile, group, dtype, target, density_threshold=density_threshold)


def _tile_index_func(cols, micro_tile, group, dtype, target, emulate_gpu=False, density_threshold=None):
    """``emulate_gpu``: on llvm, generate the CUDA kernel structure with serial thread loops."""
    C = _check_pos_int("cols", cols)
    mr, mc = _check_micro_tile(micro_tile, C)
    group = _check_group(group)
    dtype = _check_dtype(dtype)
    if density_threshold is not None:
        if isinstance(density_threshold, bool) or not 0.0 <= float(density_threshold) <= 1.0:
            raise ValueError(f"density_threshold must be in [0, 1] or None, got {density_threshold!r}")
        density_threshold = float(density_threshold)
    target = make_target(target)
    st = _strategy(target, emulate_gpu)
    gpu = st.gpu_layout
    NTC = -(-C // mc)
    row_group = group == "row"
    # the flag kernel can count per CTA when its units follow the flat (group) order
    row_major_flat = row_group or NTC == 1
    nz = _nz_fn(dtype)

    def ntr(R):
        return (R + (mr - 1)) // mr

    def flat(tr, tc, R):
        return tr * NTC + tc if row_group else tc * ntr(R) + tr

    one_group = not row_group and NTC == 1
    geo, NU, flags_gpu, count, compact, list_units = make_tile_kernels(
        st, C, mr, mc, dtype, row_major_flat and gpu, density_threshold, complement=one_group,
    )
    TPV = geo.tpv
    name = f"pit_tile_index_{group}_{dtype}_c{C}_t{mr}x{mc}" + ("_emu" if emulate_gpu else "")
    if density_threshold is not None:
        name += f"_d{int(round(density_threshold * 1000))}"
    if gpu and one_group:
        assert TPV == 1 and NU == 1  # one tile column: a unit is a tile-row

        @T.prim_func(s_tir=True)
        def one_group_index(d: T.handle, s: T.handle, o: T.handle, i: T.handle):
            T.func_attr({"tirx.noalias": True})
            R = T.int64()
            D = T.match_buffer(d, (R, C), dtype)
            ST = T.match_buffer(s, (STATE_WORDS,), STATE_DTYPE)
            OFF = T.match_buffer(o, (2,), "int32")
            IDS = T.match_buffer(i, (ntr(R),), "int32")
            list_units(D, ST, OFF, IDS, R, ntr(R))

        return _finish(one_group_index, name, target).with_attr("pit.index.state", STATE_WORDS)
    fused = gpu and row_major_flat
    CHC = geo.chc

    def unit_flat(un, j, R):
        if row_major_flat:
            return un * TPV + j
        return flat(un // NU, (un % NU) * TPV + j, R)

    @T.macro
    def flags_cpu(D, FL, R):
        # one tile-row per task, rows read contiguously
        for tr in st.bx(ntr(R)):
            acc = T.alloc_buffer((NTC,), "int32", scope="local")
            for tc in range(NTC):
                acc[tc] = 0
            for ri in range(mr):
                if tr * mr + ri < R:
                    for c in range(C):
                        acc[c // mc] = T.max(acc[c // mc], nz(D[tr * mr + ri, c]))
            for tc in range(NTC):
                FL[flat(tr, tc, R)] = T.Cast("int8", acc[tc])

    if row_group:
        G_of = ntr
        P_of = lambda R: NTC  # noqa: E731
    else:
        G_of = lambda R: NTC  # noqa: E731
        P_of = ntr

    def nb(R):
        # entries of CNT: one per flag CTA (fused) or per compaction chunk
        if fused:
            return T.max((ntr(R) * NU + (geo.upb - 1)) // geo.upb, 1)
        return T.max((ntr(R) * NTC + (CHC - 1)) // CHC, 1)

    @T.prim_func(s_tir=True)
    def tile_index(d: T.handle, o: T.handle, i: T.handle):
        T.func_attr({"tirx.noalias": True})
        R = T.int64()
        D = T.match_buffer(d, (R, C), dtype)
        OFF = T.match_buffer(o, (G_of(R) + 1,), "int32")
        IDS = T.match_buffer(i, (ntr(R) * NTC,), "int32")
        # (whole compaction chunks: the compaction reads its threads' flags as 16-byte vectors)
        FL = T.sblock_alloc_buffer((T.max((ntr(R) * NTC + (CHC - 1)) // CHC * CHC, CHC),), "int8")
        CNT = T.sblock_alloc_buffer((nb(R),), "int32")
        if gpu:
            flags_gpu(D, FL, CNT, R, ntr(R) * NU, unit_flat)
        else:
            flags_cpu(D, FL, R)
        if not fused:
            count(FL, ntr(R) * NTC, CNT)
        compact(FL, ntr(R) * NTC, P_of(R), G_of(R), CNT, nb(R), OFF, IDS)

    return _finish(tile_index, name, target)


# --------------------------------------------------------------------------- seqlen index
def seqlen_row_index_func(max_len: int, target) -> tirx.PrimFunc:
    """PrimFunc ``(lengths[B], row_ids[B*max_len], count[1])``.

    ``row_ids`` lists the flat rows ``b*max_len + s`` with ``s < clamp(lengths[b], 0, max_len)``
    in ascending order, tail ``-1``; ``count[0]`` is their number.
    """
    L = _check_pos_int("max_len", max_len)
    target = make_target(target)
    st = _strategy(target)

    def flag_fn(LEN, f):
        n = T.max(T.min(LEN[T.truncdiv(f, L)], T.int32(L)), T.int32(0))
        return T.Select(T.truncmod(f, L) < T.Cast("int64", n), T.int32(1), T.int32(0))

    id_fn = lambda f, P: f  # noqa: E731
    chunk_count, chunk_scan, compact = make_pipeline(st, flag_fn, id_fn)

    @T.prim_func(s_tir=True)
    def seqlen_index(l: T.handle, r: T.handle, c: T.handle):
        T.func_attr({"tirx.noalias": True})
        B = T.int64()
        LEN = T.match_buffer(l, (B,), "int32")
        ROWS = T.match_buffer(r, (B * L,), "int32")
        COUNT = T.match_buffer(c, (1,), "int32")
        CNT = T.sblock_alloc_buffer((T.max(num_chunks(B * L), 1),), "int32")
        COFF = T.sblock_alloc_buffer((T.max(num_chunks(B * L), 1),), "int32")
        chunk_count(LEN, B * L, CNT)
        chunk_scan(B * L, CNT, COFF, COUNT, 0)
        compact(LEN, B * L, L, B * L, COFF, COUNT, 0, ROWS)

    return _finish(seqlen_index, f"pit_seqlen_row_index_l{L}", target)


# --------------------------------------------------------------------------- expert index
def expert_index_func(num_experts: int, top_k: int, target) -> tirx.PrimFunc:
    """PrimFunc ``(expert_ids[T, top_k], offsets[E+1], assignments[T*top_k])``.

    For each expert e (in order) the ascending flat assignment ids ``t*top_k + j`` with
    ``expert_ids[t, j] == e``; ids outside ``[0, E)`` are dropped; tail ``-1``.  One kernel of
    one CTA an expert (``make_expert_lists``).
    """
    E = _check_pos_int("num_experts", num_experts)
    TK = _check_pos_int("top_k", top_k)
    target = make_target(target)

    def expert_of(X, a):
        return X[T.truncdiv(a, TK), T.truncmod(a, TK)]

    expert_lists = make_expert_lists(_strategy(target), E, expert_of)

    @T.prim_func(s_tir=True)
    def expert_index(x: T.handle, o: T.handle, a: T.handle):
        T.func_attr({"tirx.noalias": True})
        NTOK = T.int64()
        X = T.match_buffer(x, (NTOK, TK), "int32")
        OFF = T.match_buffer(o, (E + 1,), "int32")
        ASG = T.match_buffer(a, (NTOK * TK,), "int32")
        with T.sblock("root"):   # Relax's op-pattern analysis expects a root block
            expert_lists(X, NTOK * TK, OFF, ASG)

    return _finish(expert_index, f"pit_expert_index_e{E}_k{TK}", target)


def expert_capacity_index_func(num_experts: int, top_k: int, capacity: int, target) -> tirx.PrimFunc:
    """PrimFunc ``(expert_ids[B, S, top_k], offsets[E+1], assignments[B*S*top_k], kept[B*S*top_k])``.

    :func:`expert_index_func`'s lists with HF Switch's expert capacity: in each sequence ``b``
    (``S`` tokens), an expert keeps only its first ``capacity`` assignments in token order
    (flat id ``t*top_k + j``, ``t = b*S + s``); ``kept[a]`` is 1 for an assignment that stays
    listed, else 0 (also for ids outside ``[0, E)``).  Three passes on the device, no atomics:
    the full index (as :func:`expert_index_func`), each listed assignment's rank within its
    (expert, sequence) by a binary search in its expert's ascending list, then the index again
    over the kept assignments only (four kernels)."""
    E = _check_pos_int("num_experts", num_experts)
    TK = _check_pos_int("top_k", top_k)
    CAP = _check_pos_int("capacity", capacity)
    target = make_target(target)
    st = _strategy(target)

    def expert_of(X, a):
        t = T.truncdiv(a, TK)
        return X[T.truncdiv(t, X.shape[1]), T.truncmod(t, X.shape[1]), T.truncmod(a, TK)]

    def kept_expert_of(src, a):
        X, KEEP = src
        return T.Select(KEEP[a] != 0, expert_of(X, a), T.int32(-1))

    lists_all = make_expert_lists(st, E, expert_of)
    lists_kept = make_expert_lists(st, E, kept_expert_of)
    NTH = 256

    @T.macro
    def rank_and_keep(X, OFF_F, ASG_F, KEEP, p):
        # KEEP[a] = 1 for position p's assignment a when fewer than CAP assignments of its
        # expert in its sequence come before it (its expert's list is ascending: a lower bound)
        lo = T.alloc_buffer((2,), "int64", scope="local")
        if p < T.Cast("int64", OFF_F[E]):
            lo[0] = T.Cast("int64", OFF_F[expert_of(X, T.Cast("int64", ASG_F[p]))])
            lo[1] = p
            for _ in range(32):
                if lo[0] < lo[1]:
                    if T.Cast("int64", ASG_F[(lo[0] + lo[1]) // 2]) < (
                            T.Cast("int64", ASG_F[p]) // (X.shape[1] * TK)) * (X.shape[1] * TK):
                        lo[0] = (lo[0] + lo[1]) // 2 + 1
                    else:
                        lo[1] = (lo[0] + lo[1]) // 2
            if p - lo[0] < CAP:
                KEEP[ASG_F[p]] = 1

    @T.prim_func(s_tir=True)
    def expert_capacity_index(x: T.handle, o: T.handle, a: T.handle, k: T.handle):
        T.func_attr({"tirx.noalias": True})
        NB = T.int64()
        NS = T.int64()
        X = T.match_buffer(x, (NB, NS, TK), "int32")
        OFF = T.match_buffer(o, (E + 1,), "int32")
        ASG = T.match_buffer(a, (NB * NS * TK,), "int32")
        KEEP = T.match_buffer(k, (NB * NS * TK,), "int32")
        OFF_F = T.sblock_alloc_buffer((E + 1,), "int32")
        ASG_F = T.sblock_alloc_buffer((NB * NS * TK,), "int32")
        lists_all(X, NB * NS * TK, OFF_F, ASG_F)
        for b in st.bx((NB * NS * TK + (NTH - 1)) // NTH):
            for tx in st.tx(NTH):
                if b * NTH + tx < NB * NS * TK:
                    KEEP[b * NTH + tx] = 0
        for b in st.bx((NB * NS * TK + (NTH - 1)) // NTH):
            for tx in st.tx(NTH):
                if b * NTH + tx < NB * NS * TK:
                    rank_and_keep(X, OFF_F, ASG_F, KEEP, b * NTH + tx)
        lists_kept((X, KEEP), NB * NS * TK, OFF, ASG)

    return _finish(expert_capacity_index, f"pit_expert_capacity_index_e{E}_k{TK}_c{CAP}", target)


# --------------------------------------------------------------------------- runtime helpers
def _target_key(target) -> str:
    return str(make_target(target))


class IndexBuilder:
    """An index PrimFunc compiled once; each call allocates the outputs on the device and runs it.

    Output sizes are derived from the input shapes (the PrimFunc's output buffer shapes are
    expressions of the inputs' symbolic dims), never from the data.
    """

    def __init__(self, func: tirx.PrimFunc, target):
        self.func = func
        self.target = make_target(target)
        self.device = device_for(self.target)
        attrs = func.attrs if func.attrs is not None else {}
        self.name = str(attrs["global_symbol"]) if "global_symbol" in attrs else "main"
        self.num_inputs = int(attrs["pit.index.num_inputs"]) if "pit.index.num_inputs" in attrs else 1
        bufs = [p for p in func.params if isinstance(p, tirx.Buffer)]
        self.in_bufs = bufs[: self.num_inputs]
        # a one-group CUDA index's counter: zeroed once here, left zero by every call
        state = index_state(func)
        self.state = None if state is None else tvm.runtime.tensor(np.zeros(*state), self.device)
        self.out_bufs = bufs[self.num_inputs + (self.state is not None):]
        self.executable = build(tvm.IRModule({self.name: func}), self.target)
        self._kernel = self.executable[self.name]

    def _to_device(self, x, buf):
        want = str(buf.dtype)
        if isinstance(x, tvm.runtime.Tensor):
            have = str(x.dtype)
            if have != want:
                raise ValueError(f"input {buf.name!r}: dtype {have} given, {want} expected")
            if x.device.dlpack_device_type() != self.device.dlpack_device_type():
                x = tvm.runtime.tensor(x.numpy(), self.device)
            return dlpack_to_tvm(x, buf.name)   # a strided or misaligned view: a compact copy
        arr = np.asarray(x)
        have = dtype_name(arr.dtype)
        if have != want:
            raise ValueError(f"input {buf.name!r}: dtype {have} given, {want} expected")
        return tvm.runtime.tensor(np.ascontiguousarray(arr), self.device)

    def output_shapes(self, *input_shapes) -> list[tuple[int, ...]]:
        ana = Analyzer()
        bound: dict = {}
        for buf, shape in zip(self.in_bufs, input_shapes):
            shape = tuple(int(s) for s in shape)
            if len(shape) != len(buf.shape):
                raise ValueError(
                    f"input {buf.name!r}: rank {len(shape)} (shape {shape}) given, "
                    f"rank {len(buf.shape)} expected (shape {list(buf.shape)})"
                )
            for axis, (dim, n) in enumerate(zip(buf.shape, shape)):
                if isinstance(dim, tirx.Var):
                    if dim in bound and bound[dim] != n:
                        raise ValueError(f"input {buf.name!r}: inconsistent size {n} for {dim}")
                    if dim not in bound:
                        bound[dim] = n
                        ana.bind(dim, tirx.const(n, "int64"))
                else:
                    want = int(ana.simplify(dim))
                    if want != n:
                        raise ValueError(
                            f"input {buf.name!r}: axis {axis} has size {n}, {want} expected "
                            f"(shape {shape}, expected {list(buf.shape)})"
                        )
        out = []
        for buf in self.out_bufs:
            dims = [ana.simplify(d) for d in buf.shape]
            if not all(isinstance(d, tirx.IntImm) for d in dims):
                raise ValueError(f"cannot derive the shape of output {buf.name!r} from the inputs")
            out.append(tuple(int(d) for d in dims))
        return out

    def __call__(self, *inputs):
        if len(inputs) != self.num_inputs:
            raise ValueError(f"{self.name} takes {self.num_inputs} input(s), {len(inputs)} given")
        args = [self._to_device(x, b) for x, b in zip(inputs, self.in_bufs)]
        shapes = self.output_shapes(*[a.shape for a in args])
        outs = [
            tvm.runtime.empty(s, str(b.dtype), self.device) for s, b in zip(shapes, self.out_bufs)
        ]
        self._kernel(*args, *([] if self.state is None else [self.state]), *outs)
        return tuple(outs)


_BUILDERS: dict = {}


def _cached_builder(key, make):
    b = _BUILDERS.get(key)
    if b is None:
        b = _BUILDERS[key] = make()
    return b


def build_tile_index(data, micro_tile, group="row", target="llvm"):
    """Build (on the device) the tile index of ``data``; returns device tensors (offsets, ids).

    Kernels are cached per (cols, micro_tile, group, dtype, target): one build serves every R.
    """
    if isinstance(data, tvm.runtime.Tensor):
        shape, dtype = tuple(data.shape), str(data.dtype)
    else:
        data = np.asarray(data)
        shape, dtype = data.shape, dtype_name(data.dtype)
    if len(shape) != 2:
        raise ValueError(f"data must be 2-D [rows, cols], got shape {tuple(shape)}")
    rows, cols = int(shape[0]), int(shape[1])
    if cols <= 0:
        raise ValueError(f"data must have at least one column, got shape {tuple(shape)}")
    mr, mc = _check_micro_tile(micro_tile, cols)
    if rows > 0 and mr > rows:
        raise ValueError(f"micro_tile rows {mr} larger than the tensor's {rows} rows")
    group = _check_group(group)
    dtype = _check_dtype(dtype)
    key = (cols, (mr, mc), group, dtype, _target_key(target))
    builder = _cached_builder(
        key, lambda: IndexBuilder(tile_index_func(cols, (mr, mc), group, dtype, target), target)
    )
    return builder(data)


def _np(x):
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def tiles_from_index(offsets, ids, group) -> np.ndarray:
    """Host-side inspection: (count, 2) int array of (tile_row, tile_col) in index order."""
    group = _check_group(group)
    offsets = _np(offsets).astype(np.int64)
    ids = _np(ids).astype(np.int64)
    out = []
    for g in range(len(offsets) - 1):
        for t in ids[offsets[g] : offsets[g + 1]]:
            out.append((g, t) if group == "row" else (t, g))
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def reference_tile_index(data, micro_tile, group):
    """Numpy reference of :func:`tile_index_func` -> (offsets int32 [G+1], ids int32 [cap])."""
    data = np.asarray(data)
    if data.ndim != 2:
        raise ValueError(f"data must be 2-D, got shape {data.shape}")
    mr, mc = _check_micro_tile(micro_tile)
    group = _check_group(group)
    rows, cols = data.shape
    ntr, ntc = tile_grid(rows, cols, (mr, mc))
    nz = data != 0
    padded = np.zeros((ntr * mr, ntc * mc), dtype=bool)
    padded[:rows, :cols] = nz
    flags = padded.reshape(ntr, mr, ntc, mc).any(axis=(1, 3))  # [ntr, ntc]
    if group == "col":
        flags = flags.T
    counts = flags.sum(axis=1)
    offsets = np.zeros(flags.shape[0] + 1, dtype=np.int32)
    offsets[1:] = np.cumsum(counts)
    ids = np.full(ntr * ntc, -1, dtype=np.int32)
    listed = np.nonzero(flags)[1].astype(np.int32)  # row-major nonzero: group order, ascending
    ids[: len(listed)] = listed
    if group == "col" and ntc == 1:  # one group whatever the rows: the unlisted ids follow
        ids[len(listed):] = np.nonzero(~flags[0])[0]
    return offsets, ids


def reference_seqlen_row_index(lengths, max_len):
    lengths = np.clip(np.asarray(lengths, dtype=np.int64), 0, max_len)
    rows = [b * max_len + s for b in range(len(lengths)) for s in range(lengths[b])]
    out = np.full(len(lengths) * max_len, -1, dtype=np.int32)
    out[: len(rows)] = rows
    return out, np.array([len(rows)], dtype=np.int32)


def reference_expert_index(expert_ids, num_experts):
    x = np.asarray(expert_ids).reshape(-1)
    offsets = np.zeros(num_experts + 1, dtype=np.int32)
    out = np.full(x.size, -1, dtype=np.int32)
    pos = 0
    for e in range(num_experts):
        sel = np.nonzero(x == e)[0]
        out[pos : pos + len(sel)] = sel
        pos += len(sel)
        offsets[e + 1] = pos
    return offsets, out


def reference_expert_capacity_index(expert_ids, num_experts, capacity):
    """Numpy reference of :func:`expert_capacity_index_func`: ``expert_ids[B, S, k]`` ->
    ``(offsets, assignments, kept)``."""
    x = np.asarray(expert_ids)
    nb, ns, tk = x.shape
    flat = x.reshape(-1)
    kept = np.zeros(flat.size, dtype=np.int32)
    for b in range(nb):
        seen = np.zeros(num_experts, dtype=np.int64)
        for a in range(b * ns * tk, (b + 1) * ns * tk):
            e = flat[a]
            if 0 <= e < num_experts:
                if seen[e] < capacity:
                    kept[a] = 1
                seen[e] += 1
    offsets, assignments = reference_expert_index(np.where(kept == 1, flat, -1), num_experts)
    return offsets, assignments, kept
