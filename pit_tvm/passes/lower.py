"""``LowerToPIT``: replace each annotated matmul with the on-device index build + PIT kernel.

Input: a module after :class:`~pit_tvm.passes.AnnotateDynamicSparsity`, where each annotated
matmul is a call to a private function carrying ``"pit.rule"`` attrs. Each such call becomes
whatever ``pit_tvm.ops.matmul.emit_pit_matmul(bb, a, b, micro_tile=, target=, out_dtype=)`` emits
(``call_tir`` of the index-build and PIT-kernel PrimFuncs, with the device-side density check);
the wrapper functions are then removed. Everything else is left to the normal TVM path (on CUDA,
``tvm.compile`` applies the dlight default schedules to the unannotated operators).

A wrapper with a third argument (a row mask, see ``pit.row_mask_arg``) passes it on as
``row_mask=``: the op layer builds the rows index from the mask, so every matmul masked by it
emits the same index call, which ``EliminateCommonSubexpr`` (run by ``compile_onnx``) merges
into one build per call of the model.

If the op layer raises for one matmul (on CUDA: no tensor-core kernel fits its dtype or shape),
that matmul is emitted dense with a warning, and its record in ``main``'s ``pit.annotations``
says so: status ``dense``, with the op layer's reason.
"""
from __future__ import annotations

import warnings

import tvm
from tvm import relax

from .annotate import ANNOTATIONS_ATTR, PIT_RULE_ATTR
from .epilogue import epilogue_chains


def _default_emit():
    from pit_tvm.ops.matmul import emit_pit_matmul  # noqa: PLC0415 - written by the op layer

    return emit_pit_matmul


def _is_pit_func(func) -> bool:
    return isinstance(func, relax.Function) and func.attrs is not None and PIT_RULE_ATTR in func.attrs


@tvm.transform.module_pass(opt_level=0, name="LowerToPIT")
class LowerToPIT:
    """Module pass: lower ``pit_matmul_*`` wrapper calls to PIT kernels.

    Parameters
    ----------
    target : str | dict | tvm.target.Target
        Passed through to ``emit_pit_matmul`` (``"llvm"`` or ``"cuda"``).
    tuning_log : str | None
        MetaSchedule log passed to ``emit_pit_matmul`` (picks the tuned tensor-core schedule).
    emit : callable | None
        Replacement for ``pit_tvm.ops.matmul.emit_pit_matmul`` (same signature); for tests.
    fuse_epilogues : bool | None
        Pass a bias / activation / row-scale / residual chain after a PIT matmul
        (:mod:`pit_tvm.passes.epilogue`) to the op layer, which runs it in the kernel where it
        can; default: with the op layer's ``emit``.
    expected_density : float | None
        The fraction of rows a rows-kind PIT matmul is expected to list, passed to
        ``emit_pit_matmul`` (which plans the CUDA kernel's tile width for it).
    """

    def __init__(self, target="llvm", tuning_log=None, emit=None, fuse_epilogues=None, expected_density=None):
        self.target = target
        self.tuning_log = tuning_log
        if expected_density is not None:   # (a bad value is the caller's error, not a dense fallback)
            from pit_tvm.ops.matmul import planned_density  # noqa: PLC0415

            expected_density = planned_density(expected_density)
        self.expected_density = expected_density
        self.emit = emit
        # the op layer takes bias= / activation= / row_scale=; a stand-in ``emit`` may not
        self.fuse_epilogues = emit is None if fuse_epilogues is None else fuse_epilogues

    def transform_module(self, mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
        pit = {gv.name_hint: f for gv, f in mod.functions_items() if _is_pit_func(f)}
        if not pit:
            return mod
        emit = self.emit or _default_emit()
        extra = {key: value for key, value in (("tuning_log", self.tuning_log),
                                               ("expected_density", self.expected_density)) if value is not None}
        target = self.target

        def is_pit_call(call):
            return isinstance(call.op, tvm.ir.GlobalVar) and call.op.name_hint in pit

        chains = {}
        # wrapper name -> why its PIT lowering fell back to a dense matmul (one that also lowered
        # to PIT, e.g. the head of an epilogue chain lowered again with it, is not listed)
        fell_back, lowered_names = {}, set()

        @relax.expr_functor.mutator
        class _Lower(relax.PyExprMutator):
            def visit_call_(self, op):
                chain = chains.get(op)
                # bias / activation / row scale / residual after a PIT matmul: lowered again with
                # the chain (the head's own lowering, emitted at its binding for the case the chain
                # is not taken, is then dead code: DeadCodeElimination drops its bindings and
                # DropUnusedPrimFuncs its kernels)
                if chain is not None:
                    epilogue = {"bias": chain.bias, "activation": chain.activation,
                                "row_scale": None if chain.row_scale is None else self.visit_expr(chain.row_scale),
                                "residual": None if chain.residual is None else self.visit_expr(chain.residual)}
                    new = self.lower(chain.head, epilogue)
                    if new is not None:
                        return new
                if is_pit_call(op):
                    return self.lower(op, {})
                return self.visit_expr_post_order(op)

            def lower(self, op, epilogue):
                """the PIT matmul of wrapper call ``op`` (with ``epilogue``); a dense matmul with
                a warning when the op layer fails; None for an epilogue the fallback does not take"""
                f = pit[op.op.name_hint]
                a, b, *row_mask = (self.visit_expr(x) for x in op.args)
                # the row mask the wrapper was given (AnnotateDynamicSparsity), if any
                extra_args = dict(extra, row_mask=row_mask[0]) if row_mask else extra
                tile = tuple(int(x) for x in f.attrs["pit.micro_tile"])
                inner = f.body.body if isinstance(f.body, relax.SeqExpr) else f.body
                if isinstance(inner, relax.Var):  # the wrapper returns its single binding
                    inner = f.body.blocks[-1].bindings[-1].value
                out_dtype = None
                attrs = getattr(inner, "attrs", None)
                if attrs is not None and getattr(attrs, "out_dtype", None):
                    out_dtype = str(attrs.out_dtype)
                try:
                    new = emit(self.builder_, a, b, micro_tile=tile, target=target,
                               out_dtype=out_dtype, **extra_args, **epilogue)
                    lowered_names.add(op.op.name_hint)
                    fell_back.pop(op.op.name_hint, None)
                    return new
                except Exception as err:  # noqa: BLE001 - keep the model compiling
                    if epilogue:       # the matmul alone, then the chain as it was
                        return None
                    if op.op.name_hint not in lowered_names:
                        fell_back[op.op.name_hint] = str(err).splitlines()[0] if str(err) else type(err).__name__
                    warnings.warn(
                        f"PIT lowering of {op.op.name_hint} ({f.attrs['pit.tensor']}) failed, "
                        f"stays dense: {err}"
                    )
                    return relax.op.matmul(a, b, out_dtype=out_dtype) if out_dtype else relax.op.matmul(a, b)

        lowerer = _Lower(mod)
        for gv, f in mod.functions_items():
            if isinstance(f, relax.Function) and gv.name_hint not in pit:
                chains.clear()
                if self.fuse_epilogues:
                    chains.update(epilogue_chains(f, is_pit_call))
                lowerer.builder_.update_func(gv, lowerer.visit_expr(f))
        new = lowerer.builder_.get()
        out = tvm.IRModule({gv: f for gv, f in new.functions_items() if gv.name_hint not in pit}, attrs=new.attrs)
        return _record_dense_fallbacks(out, fell_back)


def _record_dense_fallbacks(mod: tvm.IRModule, fell_back: dict) -> tvm.IRModule:
    """``mod`` with each ``pit`` record of ``main``'s ``pit.annotations`` whose wrapper
    function fell back to a dense matmul turned into status ``dense``, the reason saying why."""
    names = {gv.name_hint: gv for gv in mod.get_global_vars()}
    main = mod[names["main"]] if "main" in names else None
    if not fell_back or main is None or main.attrs is None or ANNOTATIONS_ATTR not in main.attrs:
        return mod
    records = []
    for rec in main.attrs[ANNOTATIONS_ATTR]:
        record = dict(rec)
        why = fell_back.get(str(record.get("function", "")))
        if why is not None and str(record.get("status")) == "pit":
            record["status"] = "dense"
            record["reason"] = f"{record.get('reason', '')}; no PIT kernel, stays dense: {why}"
        records.append(record)
    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    mod[names["main"]] = main.with_attr(ANNOTATIONS_ATTR, records)
    return mod


@tvm.transform.module_pass(opt_level=0, name="DropUnusedPrimFuncs")
def DropUnusedPrimFuncs(mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:  # noqa: N802 - a pass, named like TVM's
    """Drop the PrimFuncs no Relax function calls (run after ``DeadCodeElimination``).

    Why: :class:`LowerToPIT` lowers a matmul at its own binding and again with its epilogue
    chain; DeadCodeElimination removes the dead binding but keeps its kernels, which carry a
    ``global_symbol`` (so the build would compile them: nvcc time, and binary size)."""
    used = set()
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            used.update(gv.name_hint for gv in relax.analysis.all_global_vars(func))
    return tvm.IRModule({gv: f for gv, f in mod.functions_items()
                         if not isinstance(f, tvm.tirx.PrimFunc) or gv.name_hint in used}, attrs=mod.attrs)
