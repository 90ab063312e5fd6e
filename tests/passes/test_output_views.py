"""ReshapeOutputsAsViews: a model whose output is a reshape returns a view, not a copy (CPU)."""
import warnings

import numpy as np
import pytest
import tvm
import tvm_ffi
from onnx import TensorProto, helper
from tvm import relax

from pit_tvm.compile import compile_onnx
from pit_tvm.passes.output_views import ReshapeOutputsAsViews
from test_passes import _model

ort = pytest.importorskip("onnxruntime")
RNG = np.random.default_rng(0)


X = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 32])


def reshaped_mlp():
    """x[2, 8, 32] -> [16, 32] -MatMul-> Relu -MatMul-> [2, 8, 32] (the last matmul, PIT's, is a
    kernel nothing fuses into, so the output reshape is a kernel of its own unless it is a view)"""
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["x2"]),
             helper.make_node("MatMul", ["x2", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["hidden"]),
             helper.make_node("MatMul", ["hidden", "w2"], ["y2"]),
             helper.make_node("Reshape", ["y2", "shape3"], ["y"])]
    return _model(nodes, [X], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 32])],
                  {"w1": RNG.standard_normal((32, 64)).astype("float32"),
                   "w2": RNG.standard_normal((64, 32)).astype("float32"),
                   "flat": np.array([16, 32], "int64"), "shape3": np.array([2, 8, 32], "int64")})


def reshaped_input():
    """y = x reshaped to [16, 32]: a view would alias the caller's input"""
    return _model([helper.make_node("Reshape", ["x", "flat"], ["y"])], [X],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 32])],
                  {"flat": np.array([16, 32], "int64")})


def _reshape_kernels_called(mod):
    """names of the reshape PrimFuncs main still calls through call_tir"""
    names = []

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.call_tir":
            callee = mod[e.args[0]]
            if relax.analysis.has_reshape_pattern(callee):
                names.append(e.args[0].name_hint)

    relax.analysis.post_order_visit(mod["main"], visit)
    return names


def _reshape_copies(executable) -> list[str]:
    """the reshape kernels (copies, not ``vm.builtin.reshape`` views) a built model calls"""
    calls = [line.split()[1] for line in executable.as_text().splitlines() if line.strip().startswith("call ")]
    assert "vm.builtin.reshape" in calls
    return [c for c in calls if "reshape" in c and c != "vm.builtin.reshape"]


def _legalized(model):
    """the model as the CPU pipeline has it before RewriteDataflowReshape (legalized, its
    bindings canonicalized: the output var is bound to the reshape call itself)"""
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    from pit_tvm.passes import import_onnx
    from pit_tvm.target import make_target

    tgt = make_target("llvm")
    with tgt, tvm.transform.PassContext(opt_level=3):
        return tvm.transform.Sequential(cpu.library_dispatch_passes(tgt) + cpu.legalize_passes(tgt))(
            relax.transform.FoldConstant()(import_onnx(model)))


@pytest.mark.parametrize("model, copies_left", [(reshaped_mlp, 0), (reshaped_input, 1)])
def test_output_reshape_becomes_a_view(model, copies_left):
    mod = _legalized(model())
    kept = mod["main"]
    before = _reshape_kernels_called(relax.transform.RewriteDataflowReshape()(mod))
    after = _reshape_kernels_called(relax.transform.RewriteDataflowReshape()(ReshapeOutputsAsViews(mod)))
    # without the pass the output reshape is a kernel (a copy); with it only a reshape of the input is
    assert len(before) == 1
    assert len(after) == copies_left
    assert mod["main"].same_as(kept)      # the pass's input module is not changed


def test_output_view_numerics_and_no_aliasing_across_calls():
    model = reshaped_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = compile_onnx(model, "llvm", auto=True)
    assert _reshape_copies(cm.executable) == []
    main = cm._machine()["main"]
    xs = [RNG.standard_normal((2, 8, 32)).astype("float32") for _ in range(3)]
    kept = []
    for x in xs:
        out = main(tvm.runtime.tensor(x, cm.device))
        kept.append((x, out.numpy().copy(), out))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for x, first_read, out in kept:    # the outputs of earlier calls are not overwritten by later ones
        np.testing.assert_array_equal(out.numpy(), first_read)
        np.testing.assert_allclose(first_read, sess.run(None, {"x": x})[0], rtol=1e-4, atol=1e-4)


def test_reshape_not_returned_stays():
    """A block output that a later block reads, not the function's result, is left alone."""
    from tvm.script import ir as I
    from tvm.script import relax as R

    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((4, 4), "float32")) -> R.Tensor((16,), "float32"):
            with R.dataflow():
                a = R.add(x, x)
                y = R.reshape(a, R.shape([16]))
                R.output(y)
            with R.dataflow():
                z = R.add(y, y)
                R.output(z)
            return z

    mod = relax.transform.LegalizeOps()(Module)
    assert len(_reshape_kernels_called(mod)) == 1
    after = ReshapeOutputsAsViews(mod)
    assert tvm_ffi.structural_equal(after["main"], mod["main"])


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_gpu_ffn_outputs_are_views_and_stay_apart(cuda_graph):
    """The OPT FFN on the GPU (its output reshape a view), with and without CUDA graphs: three
    calls' outputs, all kept, each matches onnxruntime on its own input after the last call."""
    from pit_tvm.testing import opt_ffn, opt_ffn_inputs, to_float16

    model = opt_ffn(256)
    shapes = {"x": [4, 64, 256]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = compile_onnx(to_float16(model), "cuda", shapes=shapes, cuda_graph=cuda_graph)
    assert _reshape_copies(cm.executable) == []
    main = cm._machine()["main"]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    kept = []
    for seed in range(3):
        x = opt_ffn_inputs(256, batch=4, seq=64, seed=seed)["x"]
        kept.append((x, main(tvm.runtime.tensor(x.astype(np.float16), cm.device))))
    for x, out in kept:
        np.testing.assert_allclose(out.numpy().astype(np.float32), sess.run(None, {"x": x})[0], rtol=2e-2, atol=2e-2)


def test_returned_kernel_with_host_code_is_left_alone():
    """A returned ``call_tir`` of a hand-written kernel whose body is not one block (the wgmma
    dense kernel encodes its TMA descriptors on the host) on a tensor computed in the block: the
    pass leaves it as it is (Relax's reshape analysis would fail on it)."""
    from pit_tvm.schedules.wgmma import wgmma_row_gather_func

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([256, 128], "float16"))
    w = relax.Var("w", relax.TensorType([128, 256], "float16"))
    gv = bb.add_func(wgmma_row_gather_func(128, 256, dense=True), "dense")
    with bb.function("main", [x, w]):
        with bb.dataflow():
            x2 = bb.emit(relax.op.add(x, x))
            out = bb.emit_output(relax.call_tir(gv, [x2, w], relax.TensorType([256, 256], "float16")))
        bb.emit_func_output(out)
    mod = bb.get()
    tvm.ir.assert_structural_equal(ReshapeOutputsAsViews(mod), mod)
