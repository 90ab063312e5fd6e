"""Find PIT axes in TensorIR blocks.

PIT (Zheng et al., SOSP'23) computes a sparse tensor expression densely on *micro-tiles*
gathered along a **permutation-invariant** axis: an axis whose iterations can be reordered
(and a subset selected) without changing the result, once the output is put back in place.
Reading a permuted slice of the inputs is ``SRead`` (gather), writing it back is ``SWrite``
(scatter).

Per block iteration variable ``v`` of a TensorIR ``sblock`` we decide:

* **spatial** ``v`` is a PIT axis when every buffer index that mentions ``v`` is ``v`` itself,
  alone in one dimension, and ``v`` indexes every written buffer. Then iteration ``v = p``
  only touches "row" ``p`` of each buffer, so computing rows in a permuted order is a gather
  of input rows (``SRead``) and a scatter of output rows (``SWrite``).
* **reduction** ``v`` is a PIT axis under the same index condition, when it indexes at least
  one read buffer and no written one, *and* the block's update is ``acc = acc (op) rhs`` with
  a commutative, associative ``op`` (sum, product, max, min): reordering or skipping the terms
  of such a fold leaves the result unchanged, so only a gather is needed (``SRead``).

An axis is rejected (``is_pit=False`` with a ``reason``) when it appears in a compound index
(``h + r``, ``2 * i``, ``i // 4``: the mapping between iterations and buffer rows is no longer
one to one, e.g. neighbouring output pixels share input pixels), in an indirect index
(``A[IDX[i], k]``: the row it reaches is data dependent), in a condition (``T.where``, ``if``,
``if_then_else``, ``Select``: the condition compares positions, which a permutation changes),
in a value (``B[i] = float(i)``: the value depends on the position itself), when a reduction's
update is not a recognised commutative fold, or when its iterator type is neither spatial nor
reduction (such axes keep their own ``kind``: ``"ordered"`` for ``T.axis.scan``, ``"opaque"``...).

Two boundary cases, decided on purpose:

* a spatial axis that indexes the output but **no read buffer** (a broadcast, ``C[i, j] = A[j]``
  along ``i``) is PIT with primitives ``("SWrite",)`` only: there is nothing to gather, but the
  rows of the output may still be computed in any order and scattered;
* a reduction axis that indexes **no read buffer** (``C[i] = C[i] + 1``) is *not* PIT: it
  touches no data, so there is no sparsity to exploit along it.

``PitRule.full_overwrite`` (spatial axes only) records whether the block writes every element
of its output and never depends on the output's previous content (apart from a reduction
accumulator reset by ``T.init``). When it is ``True``, a PIT kernel that skips rows must fill
the skipped output rows itself (e.g. with zeros); when ``False`` the scatter must preserve or
merge the old content.

``PitRule.accesses`` lists every (buffer, dim, role) where the axis is the bare index, in
visiting order (store indices, then the stored value); the accumulator read ``C[i, j]`` of a
``T.init`` reduction is part of the fold and is left out. Let/bind variables and block-local
scalars (``t = vi * 2`` in TVMScript) are followed: an index through them is compound. The
indirect rule is conservative: ``C[i] = A[IDX[i]]`` could be gathered through ``IDX``, but not
as a slice of ``A`` along ``i``, which is what the PIT micro-tile gather reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import tvm_ffi
from tvm import ir, s_tir, tirx
from tvm.sym import Analyzer

__all__ = ["AxisAccess", "PitRule", "find_pit_rules", "format_rules"]


@dataclass(frozen=True)
class AxisAccess:
    """One place where an axis is the bare index of a buffer dimension."""

    buffer: str  # buffer name
    dim: int  # which dimension of the buffer the axis indexes
    role: str  # "read" or "write"


@dataclass(frozen=True)
class PitRule:
    """Whether one block iteration variable is a PIT axis, and why (not)."""

    block: str
    axis: str  # iter var name
    position: int  # index among the block's iter vars
    kind: str  # "spatial", "reduction"; other iter types keep their own name and are never PIT
    is_pit: bool
    primitives: tuple[str, ...]  # spatial -> ("SRead", "SWrite"); reduction -> ("SRead",)
    accesses: tuple[AxisAccess, ...]
    reason: str | None  # why not PIT; None when it is
    # Spatial axes only (None otherwise): the block overwrites its whole output, never
    # reading the old content (see the module docstring).
    full_overwrite: bool | None = field(default=None)


# IterVar.iter_type codes (tvm.tirx.IterVar.DataPar ...).
_ITER_KINDS = {
    tirx.IterVar.DataPar: "spatial",
    tirx.IterVar.ThreadIndex: "thread",
    tirx.IterVar.CommReduce: "reduction",
    tirx.IterVar.Ordered: "ordered",
    tirx.IterVar.Opaque: "opaque",
    tirx.IterVar.Unrolled: "unrolled",
    tirx.IterVar.Vectorized: "vectorized",
    tirx.IterVar.Parallelized: "parallelized",
    tirx.IterVar.Tensorized: "tensorized",
}

# Folds `acc = acc (op) rhs` whose result does not depend on the order of the terms.
# Sub counts as a sum of negated terms, but only as `acc - rhs`.
_COMBINERS = (
    (tirx.Add, "sum", True),
    (tirx.Mul, "product", True),
    (tirx.Max, "max", True),
    (tirx.Min, "min", True),
    (tirx.Sub, "sum", False),
)

_SKIP_FIELDS = frozenset({"span", "ty", "op", "attrs", "ty_args"})


# --------------------------------------------------------------------------- public API


def find_pit_rules(func: tirx.PrimFunc, block: str | None = None) -> dict[str, list[PitRule]]:
    """Return ``{block name: [PitRule per iteration variable, in order]}`` for ``func``.

    Every ``sblock`` is listed in pre-order (the implicit ``root`` block maps to ``[]``: it
    has no iteration variables). With ``block``, only that block is analysed; an unknown
    name raises ``ValueError`` listing the block names.
    """
    if isinstance(func, ir.IRModule):
        names = [gv.name_hint for gv, f in func.functions_items() if isinstance(f, tirx.PrimFunc)]
        raise TypeError(
            f"find_pit_rules takes one PrimFunc, got an IRModule; pick one of {names}, "
            "e.g. find_pit_rules(mod[name])"
        )
    if not isinstance(func, tirx.PrimFunc):
        raise TypeError(f"find_pit_rules takes a tvm.tirx.PrimFunc, got {type(func).__name__}")
    if block is not None and not isinstance(block, str):
        raise TypeError(f"block must be an sblock's name (str) or None, got {type(block).__name__}")
    realizes = _collect_blocks(func.body)
    names = [r.block.name_hint for r in realizes]
    if block is not None:
        if block not in names:
            raise ValueError(f"no sblock named {block!r}; the blocks are {names}")
        realizes = [r for r in realizes if r.block.name_hint == block]
    result: dict[str, list[PitRule]] = {}
    for realize in realizes:
        key = realize.block.name_hint
        n = 2
        while key in result:  # block names are unique in valid TensorIR; stay total anyway
            key, n = f"{realize.block.name_hint}#{n}", n + 1
        result[key] = _analyze_block(realize)
    return result


def format_rules(rules: dict[str, list[PitRule]]) -> str:
    """Render ``find_pit_rules`` output as a plain-text table, one row per axis."""
    header = ("block", "axis", "kind", "PIT", "primitives", "accesses", "reason / note")
    rows = []
    for name, block_rules in rules.items():
        if not block_rules:
            rows.append((name, "-", "-", "-", "-", "-", "no iteration variables"))
            continue
        for r in block_rules:
            accesses = ", ".join(
                f"{a.buffer}[{a.dim}]{'w' if a.role == 'write' else 'r'}" for a in r.accesses
            )
            if r.reason is not None:
                note = r.reason
            elif r.full_overwrite is not None:
                note = "full overwrite" if r.full_overwrite else "partial / in-place write"
            else:
                note = ""
            rows.append(
                (
                    r.block,
                    r.axis,
                    r.kind,
                    "yes" if r.is_pit else "no",
                    "+".join(r.primitives) or "-",
                    accesses or "-",
                    note,
                )
            )
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, *rows]:
        cells = [str(c).ljust(w) for c, w in zip(row[:-1], widths)]
        lines.append("  ".join([*cells, str(row[-1])]).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- IR walking


def _field_names(obj) -> list[str]:
    info = type(obj).__tvm_ffi_type_info__
    names: list[str] = []
    while info is not None:
        names = [f.name for f in info.fields] + names
        info = info.parent_type_info
    return names


def _children(obj):
    """IR nodes held by ``obj`` (generic walk through reflected fields)."""
    for name in _field_names(obj):
        if name in _SKIP_FIELDS:
            continue
        value = getattr(obj, name)
        items = value if isinstance(value, (list, tuple, tvm_ffi.Array)) else [value]
        for item in items:
            if isinstance(item, (ir.Expr, tirx.Stmt)):
                yield item


def _collect_blocks(stmt) -> list[s_tir.SBlockRealize]:
    found: list[s_tir.SBlockRealize] = []

    def visit(node):
        if isinstance(node, s_tir.SBlockRealize):
            found.append(node)
        for child in _children(node):
            visit(child)

    visit(stmt)
    return found


def _vars_in(expr) -> list[ir.Var]:
    out: list[ir.Var] = []

    def visit(node):
        if isinstance(node, ir.Var):
            out.append(node)
            return
        for child in _children(node):
            visit(child)

    visit(expr)
    return out


def _is_op_call(expr, name: str) -> bool:
    return isinstance(expr, ir.Call) and isinstance(expr.op, ir.Op) and expr.op.name.endswith(name)


@dataclass
class _Access:
    buffer: ir.Var
    role: str  # "read" / "write"
    indices: list
    nested: bool  # this load sits inside another access's index (an index buffer)


class _BodyCollector:
    """Collect the accesses of one block body and where its iteration variables occur.

    Each expression is visited in a context: ``value`` (computed data), ``cond`` (a branch
    or select condition), ``index`` (a buffer index; analysed per access afterwards) or
    ``bound`` (the value of a let/bind or block-local scalar, whose uses count only where
    the bound name itself is used: ``t = vi * 2; A[t]`` is an index use, not a value use).
    """

    def __init__(self, iter_vars, local_buffers=()):
        self.iter_vars = iter_vars
        # Block-local temporaries (`t = vi * 2` in TVMScript is a local scalar buffer): a
        # store to one is a binding, a load of one is a use of the bound value, not an access.
        self.local = set(local_buffers)
        self.accesses: list[_Access] = []
        self.value_uses: dict[ir.Var, list] = {}
        self.cond_uses: dict[ir.Var, list] = {}
        # let/bind var -> iteration variables its value depends on (for indices through it)
        self.lets: dict[ir.Var, set] = {}
        # let/bind var -> [(iteration variable, bound value)] used directly in its value
        self.bound_uses: dict[ir.Var, list] = {}
        self.stores: list[tuple[tirx.BufferStore, bool]] = []  # (store, guarded by a condition)
        self.nested_blocks: list[str] = []
        self._guard = 0

    def deps(self, expr) -> set:
        """Iteration variables ``expr`` depends on (through let bindings too)."""
        out = set()
        for var in _vars_in(expr):
            if var in self.iter_vars:
                out.add(var)
            elif var in self.lets:
                out |= self.lets[var]
        return out

    def _bind(self, key, value):
        self.lets[key] = self.lets.get(key, set()) | self.deps(value)
        self.expr(value, ("bound", key, value))

    def _use(self, var, ctx):
        """Record an occurrence of ``var`` (an iteration or a bound variable) in ``ctx``."""
        if ctx[0] == "index":
            return
        if var in self.iter_vars:
            uses = [(var, ctx[-1])]
        elif var in self.bound_uses:
            uses = self.bound_uses[var]
        else:
            return
        if ctx[0] == "bound":
            self.bound_uses.setdefault(ctx[1], []).extend(uses)
            return
        table = self.value_uses if ctx[0] == "value" else self.cond_uses
        for iter_var, expr in uses:
            table.setdefault(iter_var, []).append(expr if ctx[0] == "value" else ctx[1])

    def stmt(self, node):
        if isinstance(node, tirx.AllocBuffer):
            self.local.add(node.buffer)
        elif isinstance(node, tirx.BufferStore) and node.buffer in self.local:
            for idx in node.indices:
                self.expr(idx, ("index", None), nested=True)
            self._bind(node.buffer, node.value)
        elif isinstance(node, tirx.BufferStore):
            self.stores.append((node, self._guard > 0))
            self.accesses.append(_Access(node.buffer, "write", list(node.indices), False))
            for idx in node.indices:
                self.expr(idx, ("index", None), nested=True)
            self.expr(node.value, ("value", node.value))
        elif isinstance(node, tirx.IfThenElse):
            self.expr(node.condition, ("cond", node.condition))
            self._guard += 1
            for case in (node.then_case, node.else_case):
                if case is not None:
                    self.stmt(case)
            self._guard -= 1
        elif isinstance(node, tirx.For):
            for bound in (node.min, node.extent):
                self.expr(bound, ("cond", bound))
            self._guard += 1  # a loop inside a block may run zero times
            self.stmt(node.body)
            self._guard -= 1
        elif isinstance(node, tirx.Bind):
            self._bind(node.var, node.value)
        elif isinstance(node, s_tir.SBlockRealize):
            self.nested_blocks.append(node.block.name_hint)
        else:
            for child in _children(node):
                if isinstance(child, tirx.Stmt):
                    self.stmt(child)
                else:
                    self.expr(child, ("value", child))

    def expr(self, node, ctx, nested=False):
        if isinstance(node, ir.TensorLoad) and node.source in self.local:
            for idx in node.indices:
                self.expr(idx, ("index", None), nested=True)
            self._use(node.source, ctx)
        elif isinstance(node, ir.TensorLoad):
            self.accesses.append(_Access(node.source, "read", list(node.indices), nested))
            for idx in node.indices:
                self.expr(idx, ("index", None), nested=True)
        elif isinstance(node, ir.Var):
            self._use(node, ctx)
        elif _is_op_call(node, "if_then_else"):
            cond, *branches = node.args
            self.expr(cond, ("cond", cond), nested)
            for b in branches:
                self.expr(b, ctx, nested)
        elif isinstance(node, tirx.Select):
            self.expr(node.condition, ("cond", node.condition), nested)
            self.expr(node.true_value, ctx, nested)
            self.expr(node.false_value, ctx, nested)
        elif isinstance(node, tirx.Let):
            self._bind(node.var, node.value)
            self.expr(node.body, ctx, nested)
        else:
            for child in _children(node):
                self.expr(child, ctx, nested)


# --------------------------------------------------------------------------- per block


def _is_acc(expr, store) -> bool:
    """``expr`` is a load of the store's destination element (the accumulator)."""
    return (
        isinstance(expr, ir.TensorLoad)
        and expr.source.same_as(store.buffer)
        and len(expr.indices) == len(store.indices)
        and all(tvm_ffi.structural_equal(a, b) for a, b in zip(expr.indices, store.indices))
    )


def _reads_buffer(expr, buffer) -> bool:
    if isinstance(expr, ir.TensorLoad) and expr.source.same_as(buffer):
        return True
    return any(_reads_buffer(c, buffer) for c in _children(expr))


def _combiner(block) -> tuple[str | None, str]:
    """Name of the commutative fold in ``block``'s update, or ``(None, why not)``."""
    store = block.body
    if not isinstance(store, tirx.BufferStore):
        return None, f"the update is not a single buffer store (got {type(store).__name__})"
    value = store.value
    for cls, name, commutative in _COMBINERS:
        if not isinstance(value, cls):
            continue
        pairs = [(value.a, value.b)] + ([(value.b, value.a)] if commutative else [])
        for acc, rhs in pairs:
            if _is_acc(acc, store) and not _reads_buffer(rhs, store.buffer):
                return name, ""
    buf = store.buffer.name
    return None, (
        f"update `{buf}[...] = {value}` is not `{buf}[...] <op> rhs` with a commutative, "
        "associative op (sum, product, max, min)"
    )


def _bare(idx, var, analyzer) -> bool:
    """``idx`` is ``var`` itself (up to simplification such as ``var * 1 + 0``)."""

    def is_var(e):
        if isinstance(e, tirx.Cast):  # a widening cast of the axis is still one-to-one
            e = e.value
        return isinstance(e, ir.Var) and e.same_as(var)

    # Check before simplifying: an extent-1 axis simplifies to the constant 0.
    return is_var(idx) or is_var(analyzer.simplify(idx))


def _has_load(expr, local) -> ir.TensorLoad | None:
    """The first load of a non-local buffer inside ``expr``."""
    if isinstance(expr, ir.TensorLoad) and expr.source not in local:
        return expr
    for child in _children(expr):
        found = _has_load(child, local)
        if found is not None:
            return found
    return None


def _is_true(expr) -> bool:
    return isinstance(expr, tirx.IntImm) and expr.value != 0


def _full_overwrite(block, realize, collector, analyzer) -> bool:
    """Every store covers its whole buffer with bare spatial axes and ignores old content."""
    if not _is_true(realize.predicate) or not collector.stores:
        return False
    doms = {iv.var: iv for iv in block.iter_vars}
    for store, guarded in collector.stores:
        if guarded:
            return False
        if _reads_buffer(store.value, store.buffer) and block.init is None:
            return False
        shape = list(store.buffer.ty.shape)
        seen = set()
        for dim, idx in enumerate(store.indices):
            if not isinstance(idx, ir.Var) or idx not in doms or idx in seen:
                return False
            seen.add(idx)
            iv = doms[idx]
            if iv.iter_type != tirx.IterVar.DataPar:
                return False
            if not analyzer.can_prove_equal(iv.dom.min, 0):
                return False
            if not analyzer.can_prove_equal(iv.dom.extent, shape[dim]):
                return False
    return True


def _analyze_block(realize) -> list[PitRule]:
    block = realize.block
    name = block.name_hint
    iter_vars = [iv.var for iv in block.iter_vars]
    if not iter_vars:
        return []
    analyzer = Analyzer()
    for iv in block.iter_vars:
        analyzer.bind(iv.var, iv.dom)

    collector = _BodyCollector(set(iter_vars), block.alloc_buffers)
    collector.stmt(block.body)

    # T.where(...) refers to loop variables; map them back through the block bindings.
    predicate_vars = set() if _is_true(realize.predicate) else set(_vars_in(realize.predicate))
    has_reduction = any(iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars)
    combiner, combiner_why = _combiner(block) if has_reduction else (None, "")
    full_overwrite = _full_overwrite(block, realize, collector, analyzer)

    # The accumulator read `C[i, j]` of `C[i, j] = C[i, j] + ...` under T.init is part of
    # the fold, not an input: leave it out of the accesses.
    acc_store = block.body if block.init is not None else None
    if not isinstance(acc_store, tirx.BufferStore):
        acc_store = None

    rules = []
    for pos, iv in enumerate(block.iter_vars):
        var = iv.var
        kind = _ITER_KINDS.get(iv.iter_type, f"iter_type {iv.iter_type}")
        reasons: list[str] = []
        reads: list[AxisAccess] = []
        writes: list[AxisAccess] = []
        for acc in collector.accesses:
            buf = acc.buffer.name
            if acc.role == "read" and acc_store is not None and _same_element(acc, acc_store):
                continue
            for dim, idx in enumerate(acc.indices):
                if var not in collector.deps(idx):
                    continue
                if _bare(idx, var, analyzer):
                    (reads if acc.role == "read" else writes).append(AxisAccess(buf, dim, acc.role))
                elif (load := _has_load(idx, collector.local)) is not None:
                    reasons.append(
                        f"indirect index `{idx}` in dim {dim} of {buf} "
                        f"(through buffer {load.source.name})"
                    )
                else:
                    reasons.append(f"compound index `{idx}` in dim {dim} of {buf}")
        for cond in collector.cond_uses.get(var, []):
            reasons.append(f"appears in a condition `{cond}`")
        binding_vars = set(_vars_in(realize.iter_values[pos]))
        if predicate_vars & binding_vars:
            reasons.append(f"appears in the block predicate `T.where({realize.predicate})`")
        for value in collector.value_uses.get(var, []):
            reasons.append(f"used as a value in `{value}`")
        if collector.nested_blocks:
            reasons.append(
                f"block contains nested blocks {collector.nested_blocks}; analyse those instead"
            )

        written = {a.buffer.name for a in collector.accesses if a.role == "write"}
        if kind == "spatial":
            missing = sorted(written - {a.buffer for a in writes})
            if missing and not any(r.startswith(("compound", "indirect")) for r in reasons):
                names = ", ".join(missing)
                reasons.append(f"does not index the written buffer {names} (no scatter possible)")
            primitives = ("SRead", "SWrite") if reads else ("SWrite",)
        elif kind == "reduction":
            if writes:
                w = writes[0]
                reasons.append(f"reduction axis indexes the written buffer {w.buffer} (dim {w.dim})")
            if not reads and not any(r.startswith(("compound", "indirect")) for r in reasons):
                reasons.append("indexes no buffer read: no data (and no sparsity) along it")
            if combiner is None:
                reasons.append(combiner_why)
            primitives = ("SRead",)
        else:
            reasons.append(f"iterator type {kind!r} is neither spatial nor reduction")
            primitives = ()

        is_pit = not reasons
        rules.append(
            PitRule(
                block=name,
                axis=var.name,
                position=pos,
                kind=kind,
                is_pit=is_pit,
                primitives=primitives if is_pit else (),
                accesses=tuple(_dedupe(reads + writes)),
                reason=None if is_pit else "; ".join(_dedupe(reasons)),
                full_overwrite=full_overwrite if kind == "spatial" else None,
            )
        )
    return rules


def _same_element(access: _Access, store) -> bool:
    return (
        access.buffer.same_as(store.buffer)
        and len(access.indices) == len(store.indices)
        and all(tvm_ffi.structural_equal(a, b) for a, b in zip(access.indices, store.indices))
    )


def _dedupe(items):
    seen = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen
