"""SRead and SWrite: make a TensorIR block read or write *through a sparse index*.

PIT permutes a permutation-invariant axis of a block so that it walks *compact positions*
instead of the original coordinates: position ``p`` of the axis stands for coordinate
``orig(p) = ids[base + p // micro] * micro + p % micro`` where ``ids`` lists the non-zero
micro-tiles (ascending, from :mod:`pit_tvm.index`) and ``base`` is the start of the group
the block is in (``offsets[g]``; one group when the index is not grouped). Positions past
the group's count (or past the axis extent, for partial edge tiles) are *invalid*.

``cache_read`` cannot read through an index buffer (it copies all of the buffer), so each
primitive inserts its own stage, written as an ordinary sblock so every later schedule
primitive (``compute_at``, ``set_scope``, tensorize, ...) works on it:

* :func:`sread` adds a gather block ``X_sread[.., p, ..] = X[.., orig(p), ..]`` (zero when
  ``p`` is invalid) and points the block's reads of ``X`` at ``X_sread`` (affine again).
  When the gather depends on a group axis that ``X`` is not indexed by (``B[k, n]`` gathered
  per row strip of ``A``), ``X_sread`` gets a leading group dimension.
* :func:`swrite` makes the block write a compact ``Y_swrite`` and adds a scatter block
  ``Y[.., orig(p), ..] = Y_swrite[.., p, ..]`` for valid ``p`` (``mode="store"``), or
  ``+=`` (``"accumulate"``), or a CUDA ``atomicAdd`` (``"atomic_add"``: when a permuted
  reduction is split across thread blocks). Elements of ``Y`` no valid position reaches
  must be zero: :func:`lower_pit` puts a zero fill of ``Y`` first, after scheduling.

Both take a schedule and return a **new** schedule of the rewritten function (a TensorIR
schedule cannot add function parameters; the index buffers become parameters placed before
the outputs). Apply them before the tiling primitives; the old schedule is left untouched.
A spatial PIT axis needs SRead on every input it indexes and SWrite on the output; a
reduction axis needs SRead on every input it indexes: :func:`apply_pit_axis` does both from
the rule :func:`pit_tvm.rules.find_pit_rules` derives.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import ir, tirx
from tvm.s_tir import SBlock, SBlockRealize, Schedule
from tvm.s_tir.analysis import get_sblock_read_write_region

__all__ = ["PitIndex", "sread", "swrite", "apply_pit_axis", "guard_compact_loop", "lower_pit"]

SWRITE_MODES = ("store", "accumulate", "atomic_add")


@dataclass(frozen=True)
class PitIndex:
    """The device index a PIT axis walks (the layout :mod:`pit_tvm.index` builds).

    ``ids``: int32 ``[capacity]`` micro-tile ids, ascending within each group.
    ``offsets``: int32 ``[groups + 1]`` CSR pointers (``offsets[-1]`` is the count).
    ``micro``: micro-tile extent along the permuted axis.
    ``group_axis``/``group_micro``: the block axis whose tile (``var // group_micro``)
    selects the group, or None for a single group.
    """

    ids: tirx.Buffer
    offsets: tirx.Buffer
    micro: int
    group_axis: str | None = None
    group_micro: int = 1

    @staticmethod
    def create(name: str, capacity, groups, micro: int, group_axis=None, group_micro: int = 1):
        """Declare fresh int32 index buffers ``<name>_ids``/``<name>_offsets``."""
        ids = tirx.decl_buffer((capacity,), "int32", name=f"{name}_ids")
        offsets = tirx.decl_buffer((groups + 1,), "int32", name=f"{name}_offsets")
        return PitIndex(ids, offsets, int(micro), group_axis, int(group_micro))


def _dtype(x) -> str:
    return str(x.ty.dtype)


def _i64(x):
    if isinstance(x, int):
        return tirx.const(x, "int64")
    return x if _dtype(x) == "int64" else tirx.Cast("int64", x)


class _AxisMap:
    """orig(p) and valid(p) for one permuted axis of one block."""

    def __init__(self, index: PitIndex, extent, group_var):
        self.index = index
        self.extent = extent
        self.group_var = group_var

    def _group(self):
        if self.group_var is None:
            return tirx.const(0, "int64")
        return tirx.floordiv(_i64(self.group_var), self.index.group_micro)

    def base_and_count(self):
        off = self.index.offsets
        g = self._group()
        base = _i64(tirx.BufferLoad(off, [g]))
        count = _i64(tirx.BufferLoad(off, [g + 1])) - base
        return base, count

    def orig(self, p):
        base, _ = self.base_and_count()
        micro = self.index.micro
        tile = _i64(tirx.BufferLoad(self.index.ids, [base + tirx.floordiv(_i64(p), micro)]))
        return tile * micro + tirx.floormod(_i64(p), micro)

    def valid(self, p):
        _, count = self.base_and_count()
        ok = tirx.floordiv(_i64(p), self.index.micro) < count
        return tirx.And(ok, self.orig(p) < _i64(self.extent))


def _working_func(sch: Schedule) -> tirx.PrimFunc:
    return sch.mod[sch.func_working_on] if sch.func_working_on is not None else sch.mod["main"]


def _block(sch: Schedule, block) -> SBlock:
    """The SBlock statement of ``block`` (a name or a block RV)."""
    return sch.get(sch.get_sblock(block) if isinstance(block, str) else block)


def _iter_var(blk: SBlock, axis: str):
    for iv in blk.iter_vars:
        if iv.var.name == axis:
            return iv
    names = [iv.var.name for iv in blk.iter_vars]
    raise ValueError(f"block {blk.name_hint!r} has no iteration variable {axis!r}; it has {names}")


def _uses(expr, var) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, (ir.Var, lambda v: found.append(v) if v.same_as(var) else None))
    return bool(found)


def _first_access_dim(blk, buf, buffer: str, axis: str, var, write: bool):
    """The first load (``write``: store) of ``buf`` in ``blk`` and the one dimension of it that
    ``axis`` (iter var ``var``) indexes; a ValueError when there is none or it is not one."""
    node_type, verb = (tirx.BufferStore, "write") if write else (ir.TensorLoad, "read")
    found = []
    tvm_ffi.structural_walk(blk.body, (node_type, lambda n: found.append(n)
                                       if (n.buffer if write else n.source).same_as(buf) else None))
    if not found:
        raise ValueError(f"block {blk.name_hint!r} does not {verb} {buffer!r}")
    dims = _axis_dims(found[0].indices, var)
    if len(dims) != 1:
        raise ValueError(f"axis {axis!r} must index exactly one dimension of {buffer!r}, got {dims}")
    return found[0], dims[0]


def _axis_dims(indices, var):
    """Dimensions of an access whose index is exactly ``var`` (the PIT form)."""
    dims = []
    for d, idx in enumerate(indices):
        if isinstance(idx, ir.Var) and idx.same_as(var):
            dims.append(d)
        elif _uses(idx, var):
            raise ValueError(
                f"axis {var.name!r} appears in the compound index {idx} of dimension {d}: "
                "it is not a PIT axis for this access"
            )
    return dims


def _find_buffer(blk: SBlock, name: str) -> tirx.Buffer:
    for region in list(blk.reads) + list(blk.writes):
        if region.source.name == name:
            return region.source
    names = sorted({r.source.name for r in list(blk.reads) + list(blk.writes)})
    raise ValueError(f"block {blk.name_hint!r} does not access a buffer named {name!r}; it accesses {names}")


def _check_rule(func, blk: SBlock, axis: str):
    """Refuse an axis that the PIT rule analysis rejects (it would give wrong answers)."""
    from pit_tvm.rules import find_pit_rules

    for rule in find_pit_rules(func, blk.name_hint)[blk.name_hint]:
        if rule.axis == axis and not rule.is_pit:
            raise ValueError(f"axis {axis!r} of block {blk.name_hint!r} is not a PIT axis: {rule.reason}")


def _rebuild(func: tirx.PrimFunc, blk: SBlock, new_blk: SBlock, before=(), after=(), new_allocs=(), index=None):
    """Replace ``blk`` by ``new_blk`` and insert stage statements around the loop nest holding it.

    Returns the new PrimFunc; ``index`` buffers are added as parameters before the outputs.
    """
    root_realize = func.body
    root = root_realize.block

    def replace_realize(realize):
        if realize.block.same_as(blk):
            return SBlockRealize(list(realize.iter_values), realize.predicate, new_blk)
        return realize

    # Find the top-level statement (a child of the root block's SeqStmt) that holds blk.
    top = list(root.body.seq) if isinstance(root.body, tirx.SeqStmt) else [root.body]
    out = []
    for stmt in top:
        holds = []
        tvm_ffi.structural_walk(stmt, (SBlock, lambda b: holds.append(b) if b.same_as(blk) else None))
        if holds:
            new_stmt = tvm_ffi.structural_map(stmt, (SBlockRealize, replace_realize))
            out.extend(before)
            out.append(new_stmt)
            out.extend(after)
        else:
            out.append(stmt)
    new_root = SBlock(
        list(root.iter_vars), list(root.reads), list(root.writes), root.name_hint,
        tirx.SeqStmt(out) if len(out) > 1 else out[0], root.init,
        list(root.alloc_buffers) + list(new_allocs), list(root.match_buffers), root.annotations,
    )
    params = list(func.params)
    if index is not None:
        have = {p.name for p in params if isinstance(p, tirx.Buffer)}
        extra = [b for b in (index.offsets, index.ids) if b.name not in have]
        written = set()
        tvm_ffi.structural_walk(func.body, (tirx.BufferStore, lambda st: written.add(st.buffer.name)))
        first_out = next((i for i, p in enumerate(params) if isinstance(p, tirx.Buffer) and p.name in written), len(params))
        params = params[:first_out] + extra + params[first_out:]
    body = SBlockRealize(list(root_realize.iter_values), root_realize.predicate, new_root)
    return tirx.PrimFunc(params, body, func.ret_type, func.attrs)


def _with_regions(func, blk: SBlock, extra=()) -> SBlock:
    """Recompute a block's read/write regions after its body changed."""
    known = [p for p in func.params if isinstance(p, tirx.Buffer)]
    known += list(func.body.block.alloc_buffers) + list(extra)
    buffers = {b: b for b in known}
    reads, writes = get_sblock_read_write_region(blk, buffers)
    return SBlock(list(blk.iter_vars), reads, writes, blk.name_hint, blk.body, blk.init,
                  list(blk.alloc_buffers), list(blk.match_buffers), blk.annotations)


def _stage(name, extents, make_body):
    """A loop nest with one spatial sblock ``name`` over ``extents``; ``make_body(vars)``."""
    loop_vars = [tirx.Var(f"{name}_l{d}", "int64") for d in range(len(extents))]
    ivars = [tirx.IterVar(tvm.ir.Range(tirx.const(0, "int64"), _i64(e)), tirx.Var(f"v{d}", "int64"), 0)
             for d, e in enumerate(extents)]
    vars_ = [iv.var for iv in ivars]
    block = SBlock(ivars, [], [], name, make_body(vars_))
    stmt = SBlockRealize(loop_vars, tirx.const(True, "bool"), block)
    for lv, e in reversed(list(zip(loop_vars, extents))):
        stmt = tirx.For(lv, tirx.const(0, "int64"), _i64(e), tirx.ForKind.SERIAL, stmt)
    return stmt


def _replace_accesses(stmt, buffer, new_buffer, new_indices):
    """Point loads/stores of ``buffer`` at ``new_buffer`` with ``new_indices(old_indices)``."""

    def load(node):
        if node.source.same_as(buffer):
            return tirx.BufferLoad(new_buffer, new_indices(list(node.indices)))
        return node

    def store(node):
        if node.buffer.same_as(buffer):
            return tirx.BufferStore(new_buffer, node.value, new_indices(list(node.indices)))
        return node

    return tvm_ffi.structural_map(stmt, [(ir.TensorLoad, load), (tirx.BufferStore, store)])


def _fill_regions(stage_stmt, func, extra=()):
    """Give the stage's sblock correct read/write regions."""
    def fix(b):
        return _with_regions(func, b, extra) if not b.reads and not b.writes and b.name_hint != "root" else b

    return tvm_ffi.structural_map(stage_stmt, (SBlock, fix))


def sread(sch: Schedule, block, buffer: str, axis: str, index: PitIndex, *, check_rule: bool = True) -> Schedule:
    """SRead: ``block`` reads ``buffer`` through ``index`` along ``axis`` (a gather stage)."""
    func = _working_func(sch)
    blk = _block(sch, block)
    iv = _iter_var(blk, axis)
    if check_rule:
        _check_rule(func, blk, axis)
    src = _find_buffer(blk, buffer)
    group_var = _iter_var(blk, index.group_axis).var if index.group_axis else None

    # Which dims of `src` the axis (and the group axis) index in this block.
    access, dim = _first_access_dim(blk, src, buffer, axis, iv.var, write=False)
    group_dims = _axis_dims(access.indices, group_var) if group_var is not None else []
    extra_group = group_var is not None and not group_dims
    # The group dimension spans exactly what the block's group axis can reach (written the
    # way region analysis derives it, so compute_at can prove the gather covers its reader).
    n_groups = None
    if group_var is not None:
        g_extent = _iter_var(blk, index.group_axis).dom.extent
        n_groups = tirx.floordiv(_i64(g_extent) - 1, index.group_micro) + 1

    shape = list(src.shape)
    g_shape = ([n_groups] if extra_group else []) + shape
    gathered = tirx.decl_buffer(g_shape, src.dtype, name=f"{src.name}_sread")

    def gather_body(vs):
        # vs = [group?] + coordinates of `src` where dim `dim` is a compact position.
        coords = vs[1:] if extra_group else vs
        if extra_group:
            gvar = vs[0] * index.group_micro
        elif group_var is not None:
            gvar = coords[group_dims[0]]
        else:
            gvar = None
        amap = _AxisMap(index, shape[dim], gvar)
        p = coords[dim]
        src_idx = list(coords)
        src_idx[dim] = tirx.Select(amap.valid(p), amap.orig(p), tirx.const(0, "int64"))
        value = tirx.if_then_else(amap.valid(p), tirx.BufferLoad(src, src_idx), tirx.const(0, src.dtype))
        return tirx.BufferStore(gathered, value, vs)

    extra = (gathered, index.ids, index.offsets)
    stage = _fill_regions(_stage(f"{src.name}_sread", g_shape, gather_body), func, extra)

    def new_indices(old):
        if extra_group:
            return [tirx.floordiv(_i64(group_var), index.group_micro)] + old
        return old

    body = _replace_accesses(blk.body, src, gathered, new_indices)
    new_blk = _with_regions(func, SBlock(list(blk.iter_vars), [], [], blk.name_hint, body, blk.init,
                                         list(blk.alloc_buffers), list(blk.match_buffers), blk.annotations), extra)
    new_func = _rebuild(func, blk, new_blk, before=[stage], new_allocs=[gathered], index=index)
    return _new_schedule(sch, new_func)


def swrite(sch: Schedule, block, buffer: str, axis: str, index: PitIndex, *, mode: str = "store",
           check_rule: bool = True) -> Schedule:
    """SWrite: ``block`` writes a compact buffer that a scatter stage stores through ``index``."""
    if mode not in SWRITE_MODES:
        raise ValueError(f"unknown SWrite mode {mode!r}; use one of {SWRITE_MODES}")
    func = _working_func(sch)
    blk = _block(sch, block)
    iv = _iter_var(blk, axis)
    if iv.iter_type != 0:
        raise ValueError(f"SWrite needs a spatial axis; {axis!r} of {blk.name_hint!r} is a reduction axis")
    if check_rule:
        _check_rule(func, blk, axis)
    dst = _find_buffer(blk, buffer)
    _, dim = _first_access_dim(blk, dst, buffer, axis, iv.var, write=True)
    group_var = _iter_var(blk, index.group_axis).var if index.group_axis else None
    if group_var is not None:
        raise ValueError("SWrite through a grouped index is not supported: group the index by a single group")
    shape = list(dst.shape)
    compact = tirx.decl_buffer(shape, dst.dtype, name=f"{dst.name}_swrite")

    def scatter_body(vs):
        amap = _AxisMap(index, shape[dim], None)
        p = vs[dim]
        dst_idx = list(vs)
        dst_idx[dim] = amap.orig(p)
        value = tirx.BufferLoad(compact, vs)
        if mode == "store":
            store = tirx.BufferStore(dst, value, dst_idx)
        elif mode == "accumulate":
            store = tirx.BufferStore(dst, tirx.BufferLoad(dst, dst_idx) + value, dst_idx)
        else:
            addr = tirx.address_of(tirx.BufferLoad(dst, dst_idx))
            store = tirx.Evaluate(tirx.call_intrin(dst.dtype, "tirx.cuda.atomic_add", addr, value))
        return tirx.IfThenElse(amap.valid(p), store, None)

    extra = (compact, index.ids, index.offsets)
    extra = (compact, index.ids, index.offsets)
    scatter = _fill_regions(_stage(f"{dst.name}_swrite", shape, scatter_body), func, extra)
    body = _replace_accesses(blk.body, dst, compact, lambda old: old)
    init = _replace_accesses(blk.init, dst, compact, lambda old: old) if blk.init is not None else None
    new_blk = _with_regions(func, SBlock(list(blk.iter_vars), [], [], blk.name_hint, body, init,
                                         list(blk.alloc_buffers), list(blk.match_buffers), blk.annotations), extra)
    new_func = _rebuild(func, blk, new_blk, after=[scatter], new_allocs=[compact], index=index)
    # Elements of dst no valid position reaches must be zero. A fill block would make dst
    # written by two blocks (the scatter could no longer be moved into the compute's tile
    # loops), so the fill is recorded here and inserted by lower_pit after scheduling.
    fills = list(func.attrs["pit.zero_fill"]) if func.attrs and "pit.zero_fill" in func.attrs else []
    new_func = new_func.with_attr("pit.zero_fill", fills + [dst.name])
    return _new_schedule(sch, new_func)


def apply_pit_axis(sch: Schedule, block: str, axis: str, index: PitIndex, *, write_mode: str = "store") -> Schedule:
    """Apply the PIT rule of ``axis``: SRead every input it indexes, SWrite the output if spatial."""
    from pit_tvm.rules import find_pit_rules

    func = _working_func(sch)
    rule = next((r for r in find_pit_rules(func, block)[block] if r.axis == axis), None)
    if rule is None or not rule.is_pit:
        raise ValueError(f"axis {axis!r} of block {block!r} is not a PIT axis: {getattr(rule, 'reason', 'unknown axis')}")
    for access in rule.accesses:
        if access.role == "read":
            sch = sread(sch, block, access.buffer, axis, index, check_rule=False)
    if "SWrite" in rule.primitives:
        for access in rule.accesses:
            if access.role == "write":
                sch = swrite(sch, block, access.buffer, axis, index, mode=write_mode, check_rule=False)
    return sch


def _new_schedule(sch: Schedule, func: tirx.PrimFunc) -> Schedule:
    name = sch.func_working_on.name_hint if sch.func_working_on is not None else "main"
    mod = sch.mod.__class__({**{gv.name_hint: f for gv, f in sch.mod.functions.items()}, name: func})
    new = Schedule(mod)
    new.work_on(name)
    return new


# --- skipping the invalid tail of compact positions -------------------------------------

GUARD_KEY = "pit.guard"
GROUP_KEY = "pit.group_loop"


def guard_compact_loop(sch: Schedule, loop, positions_per_iter: int, offsets: str, micro: int, group_loop=None):
    """Mark ``loop`` (each iteration covers ``positions_per_iter`` compact positions of the
    index whose CSR pointer buffer is named ``offsets``, ``micro`` positions per listed tile)
    so that :func:`lower_pit` skips iterations that start past the index's count.

    This is what turns sparsity into saved work: the grid/loop stays worst-case sized (no host
    synchronisation) and iterations with nothing valid exit at once. For a grouped index,
    ``group_loop`` is the loop whose each iteration is exactly one group.
    """
    sch.annotate(loop, GUARD_KEY, tirx.IntImm("int64", positions_per_iter))
    sch.annotate(loop, GUARD_KEY + ".offsets", offsets)
    sch.annotate(loop, GUARD_KEY + ".micro", tirx.IntImm("int64", micro))
    if group_loop is not None:
        sch.annotate(group_loop, GROUP_KEY, tirx.IntImm("int64", 1))


def lower_pit(func: tirx.PrimFunc, gpu: bool) -> tirx.PrimFunc:
    """Finish a scheduled PIT function: guards, then the zero fills SWrite asked for."""
    return _insert_zero_fills(_lower_guards(func, gpu), gpu)


def _insert_zero_fills(func: tirx.PrimFunc, gpu: bool) -> tirx.PrimFunc:
    """Zero every buffer named in ``pit.zero_fill`` before the rest of the body.

    Built already scheduled: thread-bound on the GPU (256 threads per CTA), parallel rows on CPU.
    """
    if not func.attrs or "pit.zero_fill" not in func.attrs:
        return func
    bufs = {p.name: p for p in func.params if isinstance(p, tirx.Buffer)}
    fills = []
    for name in func.attrs["pit.zero_fill"]:
        buf = bufs[str(name)]
        shape = [_i64(x) for x in buf.shape]
        ivars = [tirx.IterVar(tvm.ir.Range(tirx.const(0, "int64"), e), tirx.Var(f"v{d}", "int64"), 0)
                 for d, e in enumerate(shape)]
        store = tirx.BufferStore(buf, tirx.const(0, buf.dtype), [iv.var for iv in ivars])
        region = [tvm.ir.Range.from_min_extent(iv.var, 1) for iv in ivars]
        block = SBlock(ivars, [], [tirx.BufferRegion(buf, region)], f"{name}_zero", store)
        if gpu:
            total = shape[0]
            for e in shape[1:]:
                total = total * e
            bx, tx = tirx.Var("zero_bx", "int64"), tirx.Var("zero_tx", "int64")
            flat = bx * 256 + tx
            values, rest = [], flat
            for e in reversed(shape):
                values.insert(0, tirx.floormod(rest, e))
                rest = tirx.floordiv(rest, e)
            stmt = SBlockRealize(values, flat < total, block)
            stmt = tirx.For(tx, tirx.const(0, "int64"), tirx.const(256, "int64"), tirx.ForKind.THREAD_BINDING, stmt,
                            tirx.IterVar(None, tirx.Var("threadIdx.x", "int64"), 1, "threadIdx.x"))
            stmt = tirx.For(bx, tirx.const(0, "int64"), tirx.floordiv(total + 255, 256), tirx.ForKind.THREAD_BINDING,
                            stmt, tirx.IterVar(None, tirx.Var("blockIdx.x", "int64"), 1, "blockIdx.x"))
        else:
            loop_vars = [tirx.Var(f"zero_l{d}", "int64") for d in range(len(shape))]
            stmt = SBlockRealize(loop_vars, tirx.const(True, "bool"), block)
            for d in reversed(range(len(shape))):
                kind = tirx.ForKind.PARALLEL if d == 0 else tirx.ForKind.SERIAL
                stmt = tirx.For(loop_vars[d], tirx.const(0, "int64"), shape[d], kind, stmt)
        fills.append(stmt)
    root_realize = func.body
    root = root_realize.block
    body = tirx.SeqStmt(fills + ([*root.body.seq] if isinstance(root.body, tirx.SeqStmt) else [root.body]))
    new_root = SBlock(list(root.iter_vars), list(root.reads), list(root.writes), root.name_hint, body, root.init,
                      list(root.alloc_buffers), list(root.match_buffers), root.annotations)
    new_func = func.with_body(SBlockRealize(list(root_realize.iter_values), root_realize.predicate, new_root))
    return new_func.without_attr("pit.zero_fill")


def _lower_guards(func: tirx.PrimFunc, gpu: bool) -> tirx.PrimFunc:
    """Stop each ``guard_compact_loop``-marked loop at the index's count (device-side)."""
    offsets_by_name = {p.name: p for p in func.params if isinstance(p, tirx.Buffer)}
    group_vars = []
    tvm_ffi.structural_walk(func.body, (tirx.For, lambda f: group_vars.append(f.loop_var) if GROUP_KEY in f.annotations else None))
    if len(group_vars) > 1:
        raise ValueError("lower_guards supports one group loop per function")

    def strip(ann, prefix):
        return {k: v for k, v in ann.items() if not str(k).startswith(prefix)}

    def visit(loop):
        ann = loop.annotations
        if GROUP_KEY in ann:
            return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, loop.body, loop.thread_binding,
                            strip(ann, GROUP_KEY))
        if GUARD_KEY not in ann:
            return loop
        per_iter = int(ann[GUARD_KEY])
        offsets = offsets_by_name[str(ann[GUARD_KEY + ".offsets"])]
        micro = int(ann[GUARD_KEY + ".micro"])
        g = _i64(group_vars[0]) if group_vars else tirx.const(0, "int64")
        count = _i64(tirx.BufferLoad(offsets, [g + 1])) - _i64(tirx.BufferLoad(offsets, [g]))
        rest = strip(ann, GUARD_KEY)
        if loop.kind == tirx.ForKind.THREAD_BINDING:
            # A CTA past the count returns before any barrier (a guard `if` around the body
            # would put __syncthreads under a condition, which TVM rejects).
            done = _i64(loop.loop_var) * per_iter >= count * micro
            early_exit = tirx.IfThenElse(done, tirx.Evaluate(tirx.call_intrin("int32", "tirx.thread_return")), None)
            return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, tirx.SeqStmt([early_exit, loop.body]),
                            loop.thread_binding, rest)
        if gpu:
            # In a kernel the loop holds barriers, which may not sit under a condition: the
            # loop stops at the last iteration with valid positions instead.
            needed = tirx.Max(tirx.floordiv(count * micro + per_iter - 1, per_iter), tirx.const(0, "int64"))
            extent = tirx.Min(_i64(loop.extent), needed)
            if _dtype(loop.extent) != "int64":
                extent = tirx.Cast(_dtype(loop.extent), extent)
            return tirx.For(loop.loop_var, loop.min, extent, loop.kind, loop.body, loop.thread_binding, rest)
        # On the host the extent stays static (buffer regions inside stay constant-sized) and
        # the iterations past the count are skipped.
        keep = _i64(loop.loop_var) * per_iter < count * micro
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, tirx.IfThenElse(keep, loop.body, None),
                        loop.thread_binding, rest)

    return func.with_body(tvm_ffi.structural_map(func.body, (tirx.For, visit)))
