"""``ReshapeOutputsAsViews``: a reshape that produces a model output becomes a view, not a copy.

Why: Relax's ``RewriteDataflowReshape`` turns a legalized reshape (``call_tir`` of a PrimFunc
with the reshape pattern) back into ``R.reshape``, which the VM runs as a view of the same
storage, but only where the result is a ``DataflowVar``.  A model whose last op is a reshape
(the OPT FFN's ``[tokens, d] -> [batch, seq, d]``) binds it to the block's output var, so it
stays a kernel that copies the whole output.

Rewritten, in a dataflow block, where ``out`` is a block output::

    out = call_tir(reshape, (x,))
 -> view = call_tir(reshape, (x,))        (a DataflowVar: RewriteDataflowReshape's to rewrite)
    out = view

Only a reshape whose result the function returns (alone or in its output tuple), of tensors
computed in the block, is taken: the returned view keeps the storage of ``x`` alive after the
call and nothing in the call runs after it, while a view of a parameter would alias the
caller's input.  Run after legalization and before ``RewriteDataflowReshape`` (both Relax
pipelines of :mod:`pit_tvm.target` do).
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.s_tir import SBlockRealize

from .graph import call_tir_parts


@relax.expr_functor.mutator
class _OutputReshapeRewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod_ = mod
        self.returned = set()      # the vars the function being rewritten returns

    def _reshapes_own_tensor(self, value) -> bool:
        """``call_tir`` of a reshape PrimFunc on tensors computed in the block (a view of a
        function parameter would alias the caller's input).  Only a PrimFunc whose body is one
        block is looked at: Relax's reshape analysis fails on any other (a hand-written kernel
        with host code, such as a TMA descriptor's encoding)."""
        parts = call_tir_parts(value)
        if parts is None:
            return False
        callee = self.mod_[parts[0]]
        return (isinstance(callee, tvm.tirx.PrimFunc) and isinstance(callee.body, SBlockRealize)
                and all(isinstance(a, relax.DataflowVar) for a in parts[1])
                and relax.analysis.has_reshape_pattern(callee))

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if (self.builder_.current_block_is_dataflow() and not isinstance(binding.var, relax.DataflowVar)
                and binding.var in self.returned and self._reshapes_own_tensor(binding.value)):
            view = self.builder_.emit(self.visit_expr(binding.value), name_hint=f"{binding.var.name}_view")
            self.builder_.emit_normalized(relax.VarBinding(binding.var, view))
            return
        super().visit_var_binding_(binding)


@tvm.transform.module_pass(opt_level=0, name="ReshapeOutputsAsViews")
def ReshapeOutputsAsViews(mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:  # noqa: N802 - a pass
    """Module pass: bind each reshape a function returns to a DataflowVar first."""
    rewriter = _OutputReshapeRewriter(mod)
    out = mod.clone()     # (the caller's module is left as it was)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
            result = func.body.body
            fields = result.fields if isinstance(result, relax.Tuple) else [result]
            rewriter.returned = {f for f in fields if isinstance(f, relax.Var)}
            if rewriter.returned:
                out[gv] = rewriter.visit_expr(func)
    return out
