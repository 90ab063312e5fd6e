"""``ListStripsInProducer``: build a tiles-kind PIT matmul's one-pass strips index in the
epilogue of the dense kernel that produces its sparse operand, instead of reading that
operand again.

Why: an FFN's fc2 reads fc1's ReLU output (``[tokens, 4d]``, ~90 % zeros); its index
(:func:`pit_tvm.schedules.wgmma_strips.strip_list_func`: which 128-row strips of which
columns hold a non-zero, and for thin micro-tiles the compacted columns) is one more pass over
that tensor (docs/design/measurements.md#graph-passes).  fc1's wgmma
kernel has each 128 x 256 tile of it in shared memory already; listing its columns there
costs a few flags, a ballot and one atomic add per CTA.

Rewritten, in a dataflow block::

    c = call_tir(dense wgmma kernel, args)                  (any epilogue; fp16/bf16 C)
    a = reshape...(c)                                       (the same [M, K], through reshapes)
    listed = call_tir(strip list kernel, (a, state))
 -> fused = call_tir(the dense kernel listing C's strips, args + (state,))
    c = fused[0]; listed = (fused[1], fused[2][, fused[3]])

``c`` keeps its other uses (the tiles kind's dense fallback reads it).  A state that is a
per-call ``R.zeros`` (a symbolic row count) is emitted again before the fused call.  Run after
:class:`~pit_tvm.passes.DenseMatmulToPITKernels`, on CUDA builds.
"""
from __future__ import annotations

import tvm
from tvm import relax

from .graph import FuncGraph, call_tir_parts, op_name, rewrite_functions


def _default_make():
    from pit_tvm.ops.matmul import strips_listing_producer  # noqa: PLC0415 - the op layer's

    return strips_listing_producer


def _same_shape(x, y) -> bool:
    from pit_tvm.ops.matmul import same_dims  # noqa: PLC0415

    return same_dims(getattr(x.ty, "shape", None), getattr(y.ty, "shape", None))


@tvm.transform.module_pass(opt_level=0, name="ListStripsInProducer")
class ListStripsInProducer:
    """Module pass; ``make``: replacement for ``strips_listing_producer`` (same signature), for
    tests."""

    def __init__(self, make=None):
        self.make = make

    def transform_module(self, mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
        make = self.make or _default_make()
        plans = {}     # producer var -> (listing var, fused PrimFunc, state value or constant)
        fused_calls = {}   # listing var -> the fused call's var (filled while rewriting)

        def plan(func):
            g = FuncGraph(func)
            for var, value in g.bound.items():
                parts = call_tir_parts(value)
                if parts is None or not isinstance(var, relax.DataflowVar) or len(parts[1]) != 2:
                    continue
                listing, (a, state) = mod[parts[0]], parts[1]
                passed, producer = g.chain(a, ("relax.reshape",))
                made = call_tir_parts(producer)
                source = passed[-1] if passed else None     # the var bound to the producer's call
                if (made is None or not isinstance(source, relax.DataflowVar) or source in plans
                        or not _same_shape(source, a)):
                    continue
                if isinstance(state, relax.Var):
                    state = g.bound.get(state)
                    if op_name(state) != "relax.zeros":
                        continue
                elif not isinstance(state, tvm.ir.GenericConst):
                    continue
                fused = make(mod[made[0]], listing)
                if fused is not None:
                    plans[source] = (var, fused, state)

        @relax.expr_functor.mutator
        class _Fuse(relax.PyExprMutator):
            def visit_var_binding_(self, binding):
                var = binding.var
                if var in plans:
                    listing_var, fused, state = plans[var]
                    call = self.visit_expr(binding.value)
                    gv, args = call_tir_parts(call)
                    name = f"{gv.name_hint}_strips"
                    fused_gv = self.builder_.add_func(fused.with_attr("global_symbol", name), name)
                    state_arg = state if isinstance(state, tvm.ir.GenericConst) else self.builder_.emit(state)
                    out = self.builder_.emit(relax.call_tir(fused_gv, args + [state_arg],
                                                            [var.ty] + list(listing_var.ty.fields)))
                    self.set_var_remap(var, self.builder_.emit(relax.TupleGetItem(out, 0)))
                    fused_calls[listing_var] = out
                    return
                if var in fused_calls:
                    out = fused_calls[var]
                    fields = [relax.TupleGetItem(out, i + 1) for i in range(len(var.ty.fields))]
                    self.set_var_remap(var, self.builder_.emit(relax.Tuple(fields)))
                    return
                super().visit_var_binding_(binding)

        for func in mod.functions.values():
            if isinstance(func, relax.Function):
                plan(func)
        if not plans:
            return mod
        # (the listing calls are dead then)
        return relax.transform.DeadCodeElimination()(rewrite_functions(mod, _Fuse(mod)))
