"""AnnotateDynamicSparsity / LowerToPIT / compile_onnx on small ONNX models (CPU, llvm)."""
import warnings

import numpy as np
import onnx
import pytest
from hypothesis import given, settings, strategies as st
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax, topi

from pit_tvm.compile import compile_onnx
from pit_tvm.passes import AnnotateDynamicSparsity, LowerToPIT, annotations_of, import_onnx

ort = pytest.importorskip("onnxruntime")
RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, inits):
    g = helper.make_graph(nodes, "m", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def relu_mlp():
    """x[batch, 64] -MatMul-> h -Relu-> hidden -Gemm(transB)-> y[batch, 32]."""
    return _model(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["hidden"]),
         helper.make_node("Gemm", ["hidden", "w2", "b2"], ["y"], transB=1)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32])],
        {"w1": RNG.standard_normal((64, 128)).astype("float32"),
         "w2": RNG.standard_normal((32, 128)).astype("float32"),
         "b2": RNG.standard_normal(32).astype("float32")})


def masked_model(mask_name="mask", mask_type=TensorProto.FLOAT):
    """x[batch, seq, 32] * mask[batch, seq, 1] -> MatMul w -> Add b -> y (batch, seq symbolic)."""
    nodes = []
    mask = mask_name
    if mask_type != TensorProto.FLOAT:
        nodes.append(helper.make_node("Cast", [mask_name], ["mask_f"], to=TensorProto.FLOAT))
        mask = "mask_f"
    nodes += [helper.make_node("Unsqueeze", [mask, "axes"], ["mask3"]),
              helper.make_node("Mul", ["x", "mask3"], ["xm"]),
              helper.make_node("MatMul", ["xm", "w"], ["mm"]),
              helper.make_node("Add", ["mm", "b"], ["y"])]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 32]),
         helper.make_tensor_value_info(mask_name, mask_type, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 48])],
        {"w": RNG.standard_normal((32, 48)).astype("float32"), "b": RNG.standard_normal(48).astype("float32"),
         "axes": np.array([2], "int64")})


def batched_rhs_model():
    """relu(x)[batch, 8, 16] @ y[batch, 16, 4]: B is a runtime 3-D tensor -> PIT cannot handle."""
    return _model(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("MatMul", ["r", "y"], ["z"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 16]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16, 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 8, 4])], {})


def ort_run(model, inputs):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, inputs)


def annotate(model, **kw):
    mod = relax.transform.FoldConstant()(import_onnx(model))
    return AnnotateDynamicSparsity(**kw)(mod)


def stand_in_emit(bb, a, b, *, micro_tile=(1, 64), target="llvm", out_dtype=None):
    """Test-only stand-in with emit_pit_matmul's signature: a plain TE matmul PrimFunc."""
    return bb.emit_te(topi.matmul, a, b, primfunc_name_hint="pit_stand_in")


# ----------------------------------------------------------------------------- annotation
def test_relu_annotation_visible_in_ir():
    mod = annotate(relu_mlp())
    text = mod.script(show_meta=False)
    assert '"pit.source": "relu"' in text and '"pit.sparse_operand": "lhs"' in text
    assert '"pit.rule": "K:SRead"' in text and '"pit.micro_tile": [32, 1]' in text
    assert "cls.pit_matmul_0(hidden" in text  # the annotated matmul now calls the wrapper
    notes = annotations_of(mod)
    assert [(n["tensor"], n["source"], n["status"]) for n in notes] == [("hidden", "relu", "pit")]
    # the first matmul (dense x) is untouched
    assert text.count("R.matmul(") == 2  # one in main, one inside the wrapper


def test_passes_compose_in_sequential():
    seq = tvm.transform.Sequential([relax.transform.FoldConstant(), AnnotateDynamicSparsity(),
                                    LowerToPIT(emit=stand_in_emit), relax.transform.DeadCodeElimination()])
    model = relu_mlp()
    mod = seq(import_onnx(model))
    names = [gv.name_hint for gv in mod.get_global_vars()]
    assert "pit_stand_in" in names and not any(n.startswith("pit_matmul_") for n in names)
    assert "R.call_tir(cls.pit_stand_in, (hidden," in mod.script(show_meta=False)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    x = RNG.standard_normal((5, 64)).astype("float32")
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), ort_run(model, {"x": x})[0],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sparse", [{"h": (1, 32)}, ["hidden"]])
def test_explicit_annotation_by_name(sparse):
    mod = annotate(relu_mlp(), sparse=sparse, auto=False)
    notes = annotations_of(mod)
    assert len(notes) == 1 and notes[0]["source"] == "explicit"
    name = next(iter(sparse))
    assert notes[0]["tensor"] == name
    tile = sparse[name] if isinstance(sparse, dict) else (32, 1)
    assert notes[0]["micro_tile"] == list(tile)
    assert f'"pit.tensor": "{name}"' in mod.script(show_meta=False)


def test_explicit_overrides_auto_tile():
    notes = annotations_of(annotate(relu_mlp(), sparse={"hidden": (1, 128)}))
    assert notes[0]["source"] == "explicit+relu" and notes[0]["micro_tile"] == [1, 128]
    assert notes[0]["rule"] == "M:SRead+SWrite"  # whole rows: M permuted


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"valid tensor names: .*hidden") as err:
        annotate(relu_mlp(), sparse={"nope": (1, 64)})
    assert "'nope'" in str(err.value) and "x" in str(err.value)


def test_mask_and_padding_sources():
    notes = annotations_of(annotate(masked_model("mask")))
    assert [(n["tensor"], n["source"], n["micro_tile"]) for n in notes] == [("xm", "mask:mask", [1, 32])]
    notes = annotations_of(annotate(masked_model("attention_mask", TensorProto.INT64)))
    assert notes[0]["source"] == "padding:attention_mask" and notes[0]["rule"] == "M:SRead+SWrite"
    assert "whole rows" in notes[0]["reason"]


def test_masked_batched_product_is_recorded_without_warning():
    """(x * mask)[batch, seq, 16] @ v[batch, 16, 4] (attention's P.V shape, the attention passes'
    to lower): recorded dense with the reason, no warning; the build still matches onnxruntime"""
    model = _model(
        [helper.make_node("Unsqueeze", ["attention_mask", "axes"], ["mask3"]),
         helper.make_node("Mul", ["x", "mask3"], ["xm"]), helper.make_node("MatMul", ["xm", "v"], ["z"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 16]),
         helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT, ["batch", 8]),
         helper.make_tensor_value_info("v", TensorProto.FLOAT, ["batch", 16, 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 8, 4])], {"axes": np.array([2], "int64")})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mod = annotate(model)
    notes = [n for n in annotations_of(mod) if n["status"] != "input"]
    assert [(n["source"], n["status"]) for n in notes] == [("padding:attention_mask", "dense")]
    assert "B has rank 3" in notes[0]["reason"]
    feeds = {"x": RNG.standard_normal((2, 8, 16)).astype("float32"),
             "attention_mask": (RNG.random((2, 8)) > 0.3).astype("float32"),
             "v": RNG.standard_normal((2, 16, 4)).astype("float32")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = compile_onnx(model)
    np.testing.assert_allclose(cm.run(feeds)[0], ort_run(model, feeds)[0], rtol=1e-4, atol=1e-4)


def test_padding_input_recorded_without_mask_use():
    m = _model([helper.make_node("Relu", ["x"], ["y"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
                helper.make_tensor_value_info("seq_lens", TensorProto.INT64, ["batch"])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], {})
    notes = annotations_of(annotate(m))
    assert notes == [{"tensor": "seq_lens", "source": "padding:seq_lens", "status": "input",
                      "reason": notes[0]["reason"]}]


def test_unsupported_matmul_stays_dense_with_warning():
    model = batched_rhs_model()
    with pytest.warns(UserWarning, match="stays dense: B has rank 3"):
        mod = annotate(model)
    assert "pit_matmul" not in mod.script(show_meta=False)
    assert annotations_of(mod)[0]["status"] == "dense"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = compile_onnx(model)
    x = RNG.standard_normal((3, 8, 16)).astype("float32")
    y = RNG.standard_normal((3, 16, 4)).astype("float32")
    np.testing.assert_allclose(cm.run({"x": x, "y": y})[0], ort_run(model, {"x": x, "y": y})[0], rtol=1e-4, atol=1e-4)


def test_unsupported_dtype_stays_dense():
    m = _model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("MatMul", ["r", "w"], ["y"])],
               [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["batch", 16])],
               [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["batch", 8])],
               {"w": RNG.standard_normal((16, 8))})
    with pytest.warns(UserWarning, match="dtype float64"):
        annotate(m)


# ----------------------------------------------------------------------------- numerics
def _check(model, inputs_list, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = compile_onnx(model, **kw)
    for inputs in inputs_list:  # several shapes through one build: symbolic dims
        ref = ort_run(model, inputs)
        out = cm.run(inputs)
        assert len(out) == len(ref)
        for o, r in zip(out, ref):
            assert o.shape == r.shape
            np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-4)
    return cm


def test_numerics_relu_mlp_symbolic_batch():
    cm = _check(relu_mlp(), [{"x": RNG.standard_normal((b, 64)).astype("float32")} for b in (1, 7, 33)])
    assert cm.annotations[0]["tensor"] == "hidden"


def test_numerics_masked_symbolic_batch_and_seq():
    def inputs(b, s):
        mask = (np.arange(s)[None] < RNG.integers(1, s + 1, size=b)[:, None]).astype("int64")
        return {"x": RNG.standard_normal((b, s, 32)).astype("float32"), "attention_mask": mask}

    cm = _check(masked_model("attention_mask", TensorProto.INT64), [inputs(2, 5), inputs(3, 17)])
    assert cm.annotations[0]["source"] == "padding:attention_mask"
    assert "seq" in str(cm.ir["main"].params[0].ty) and "batch" in str(cm.ir["main"].params[0].ty)


def _has_op_layer():
    try:
        from pit_tvm.ops.matmul import emit_pit_matmul  # noqa: F401

        return True
    except ImportError:
        return False


@pytest.mark.skipif(not _has_op_layer(), reason="pit_tvm.ops.matmul.emit_pit_matmul not available yet")
def test_lower_with_op_layer_matches_onnxruntime():
    model = relu_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = compile_onnx(model)
    assert cm.annotations[0]["status"] == "pit"
    assert not any(gv.name_hint.startswith("pit_matmul_") for gv in cm.lowered.get_global_vars())
    for b in (1, 9):
        x = RNG.standard_normal((b, 64)).astype("float32")
        np.testing.assert_allclose(cm.run({"x": x})[0], ort_run(model, {"x": x})[0], rtol=1e-4, atol=1e-3)


# ----------------------------------------------------------------------------- dense matmuls on tensor cores
def fp16_mlp(k=128, hidden=256, n=128):
    """x[batch, seq, k] -MatMul-> h -Relu-> hidden -MatMul-> y, fp16, tile-aligned widths."""
    return _model(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["hidden"]),
         helper.make_node("MatMul", ["hidden", "w2"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", "seq", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["batch", "seq", n])],
        {"w1": (RNG.standard_normal((k, hidden)) / np.sqrt(k)).astype("float16"),
         "w2": (RNG.standard_normal((hidden, n)) / np.sqrt(hidden)).astype("float16")})


def fp16_biased_mlp(k=128, hidden=256, n=128, extra_use=False):
    """x -MatMul-> +b1 -Relu-> -MatMul-> +b2 -> y (fp16). ``extra_use``: the first add is also
    a graph output, so its epilogue cannot be folded into the matmul."""
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["batch", "seq", n])]
    if extra_use:
        outs.append(helper.make_tensor_value_info("pre", TensorProto.FLOAT16, ["batch", "seq", hidden]))
    return _model(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["pre"]),
         helper.make_node("Relu", ["pre"], ["hidden"]), helper.make_node("MatMul", ["hidden", "w2"], ["h2"]),
         helper.make_node("Add", ["b2", "h2"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", "seq", k])], outs,
        {"w1": (RNG.standard_normal((k, hidden)) / np.sqrt(k)).astype("float16"),
         "b1": RNG.standard_normal(hidden).astype("float16"),
         "w2": (RNG.standard_normal((hidden, n)) / np.sqrt(hidden)).astype("float16"),
         "b2": RNG.standard_normal(n).astype("float16")})


def test_bias_and_relu_run_in_the_dense_kernel_epilogue():
    """add(matmul, bias) -> relu chains become one tensor-core kernel with the epilogue; when
    the add has another use (a graph output) only the bias is folded and the relu stays."""
    off = compile_onnx(fp16_biased_mlp(), "cuda", auto=False)
    assert _tc_dense_funcs(off.lowered) == ["tc_dense_matmul_k128_n256_float16_float16_bias_relu",
                                            "tc_dense_matmul_k256_n128_float16_float16_bias"]
    main = off.lowered["main"].script()
    assert "R.nn.relu" not in main and "R.add" not in main and "R.matmul" not in main
    kept = compile_onnx(fp16_biased_mlp(extra_use=True), "cuda", auto=False)
    assert _tc_dense_funcs(kept.lowered) == ["tc_dense_matmul_k128_n256_float16_float16_bias",
                                             "tc_dense_matmul_k256_n128_float16_float16_bias"]
    assert "R.nn.relu" in kept.lowered["main"].script()


def _tc_dense_funcs(mod):
    return sorted(gv.name_hint for gv in mod.get_global_vars() if gv.name_hint.startswith("tc_dense_matmul"))


def test_dense_matmuls_on_tensor_cores_for_cuda():
    """PIT off: both matmuls on the tensor-core dense kernel; PIT on (relu source): the first
    stays dense on tensor cores, the second is the PIT kernel. The CUDA compiles with nvcc."""
    from pit_tvm.nvcc import check_cuda_compiles, cuda_sources, find_nvcc

    off = compile_onnx(fp16_mlp(), "cuda", auto=False)
    assert _tc_dense_funcs(off.lowered) == ["tc_dense_matmul_k128_n256_float16_float16",
                                            "tc_dense_matmul_k256_n128_float16_float16"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on = compile_onnx(fp16_mlp(), "cuda")
    assert _tc_dense_funcs(on.lowered) == ["tc_dense_matmul_k128_n256_float16_float16"]
    assert any(gv.name_hint.startswith("pit_kernel_") for gv in on.lowered.get_global_vars())
    # the default "cuda" (sm_90a) runs the dense layers on wgmma, sm_90 on mma.sync
    assert "wgmma.mma_async" in "\n".join(cuda_sources(off.executable))
    off_sm90 = compile_onnx(fp16_mlp(), "cuda:sm_90", auto=False)
    assert "mma.sync" in "\n".join(cuda_sources(off_sm90.executable))
    if find_nvcc() is not None:
        assert check_cuda_compiles(off.executable, archs=("sm_90a",)) >= 1
        assert check_cuda_compiles(off_sm90.executable, archs=("sm_90",)) >= 1


def test_dense_pass_leaves_what_it_cannot_take():
    """CUDA: fp32 matmuls and a batched (runtime 3-D) right operand stay; CPU: the batched one
    stays."""
    from pit_tvm.passes import DenseMatmulToPITKernels

    for model in (relu_mlp(), batched_rhs_model()):
        m = relax.transform.FoldConstant()(import_onnx(model))
        assert _tc_dense_funcs(DenseMatmulToPITKernels("cuda")(m)) == []
    m = DenseMatmulToPITKernels("llvm")(relax.transform.FoldConstant()(import_onnx(batched_rhs_model())))
    assert not any(gv.name_hint.startswith("cpu_dense") for gv in m.get_global_vars())
    assert "R.matmul(" in m["main"].script()


def test_cpu_builds_share_the_dense_twin():
    """CPU: the PIT-off build's matmuls (and the PIT build's dense first one) run the PIT CPU
    schedule's dense twin, not LegalizeOps' unscheduled loops; the Gemm's bias follows as an
    op; both builds match onnxruntime."""
    model = relu_mlp()
    x = RNG.standard_normal((5, 64)).astype("float32")
    ref = ort_run(model, {"x": x})[0]
    for auto, dense_kernels in ((False, ["cpu_dense_matmul_k128_n32_float32_float32",
                                         "cpu_dense_matmul_k64_n128_float32_float32"]),
                                (True, ["cpu_dense_matmul_k64_n128_float32_float32"])):
        cm = compile_onnx(model, "llvm", auto=auto)
        names = sorted(gv.name_hint for gv in cm.lowered.get_global_vars() if gv.name_hint.startswith("cpu_dense"))
        assert names == dense_kernels
        assert "R.matmul(" not in cm.lowered["main"].script()
        np.testing.assert_allclose(cm.run({"x": x})[0], ref, rtol=1e-4, atol=1e-4)


def test_dense_matmul_workload_cpu_numerics():
    """The unscheduled dense workload (what the tensor-core schedule computes) on llvm."""
    from pit_tvm.schedules.tensorcore import dense_matmul_func
    from pit_tvm.target import build

    for bias, relu in ((False, False), (True, True), (True, False)):
        ex = build(tvm.IRModule({"main": dense_matmul_func(64, 48, "float16", "float32", bias, relu)}), "llvm")
        for m in (1, 37):
            a = RNG.standard_normal((m, 64)).astype("float16")
            b = RNG.standard_normal((64, 48)).astype("float16")
            bv = RNG.standard_normal(48).astype("float16")
            c = tvm.runtime.empty((m, 48), "float32")
            ex["main"](*[tvm.runtime.tensor(v) for v in ([a, b, bv] if bias else [a, b])], c)
            ref = a.astype("float32") @ b.astype("float32") + (bv.astype("float32") if bias else 0)
            ref = np.maximum(ref, 0) if relu else ref
            np.testing.assert_allclose(c.numpy(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype,out_dtype", [("float16", "float16"), ("bfloat16", "float32")])
def test_gpu_dense_tensor_core_kernel(in_dtype, out_dtype):
    import ml_dtypes

    from pit_tvm.schedules.tensorcore import (TensorCoreConfig, dense_matmul_func,
                                              schedule_dense_matmul)
    from pit_tvm.target import build

    np_in = ml_dtypes.bfloat16 if in_dtype == "bfloat16" else np.float16
    k, n = 512, 256
    ex = build(tvm.IRModule({"main": schedule_dense_matmul(
        dense_matmul_func(k, n, in_dtype, out_dtype), TensorCoreConfig())}), "cuda")
    dev = tvm.cuda(0)
    for m in (1, 300, 1000):
        a = RNG.standard_normal((m, k)).astype(np_in)
        b = (RNG.standard_normal((k, n)) / np.sqrt(k)).astype(np_in)
        c = tvm.runtime.empty((m, n), out_dtype, dev)
        ex["main"](tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev), c)
        ref = a.astype(np.float32) @ b.astype(np.float32)
        np.testing.assert_allclose(c.numpy().astype(np.float32), ref, rtol=3e-2, atol=3e-2)


def test_lowered_module_keeps_only_the_kernels_it_calls():
    """LowerToPIT lowers a matmul at its binding and again with its epilogue chain; the first
    lowering's kernels carry a global symbol, so DeadCodeElimination keeps them, and
    DropUnusedPrimFuncs (run by compile_onnx) drops them before the build compiles them."""
    from pit_tvm.passes.lower import DropUnusedPrimFuncs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = compile_onnx(fp16_biased_mlp(), "cuda")
    called = {gv.name_hint for gv in relax.analysis.all_global_vars(cm.lowered["main"])}
    prims = {gv.name_hint: f for gv, f in cm.lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert any(name.startswith("pit_kernel_") and "_bias" in name for name in prims)   # the chain's kernel
    assert set(prims) <= called
    # a kernel no Relax function calls: DeadCodeElimination keeps it, DropUnusedPrimFuncs does not
    kernel = next(f for name, f in prims.items() if name.startswith("pit_kernel_"))
    mod = tvm.IRModule(dict(cm.lowered.functions_items()))
    mod[tvm.ir.GlobalVar("pit_kernel_unused")] = kernel.with_attr("global_symbol", "pit_kernel_unused")
    kept = relax.transform.DeadCodeElimination()(mod)
    assert "pit_kernel_unused" in {gv.name_hint for gv in kept.get_global_vars()}
    assert "pit_kernel_unused" not in {gv.name_hint for gv in DropUnusedPrimFuncs(kept).get_global_vars()}
    assert set(prims) <= {gv.name_hint for gv in DropUnusedPrimFuncs(kept).get_global_vars()}


@pytest.mark.gpu
@pytest.mark.parametrize("model_fn", [fp16_mlp, fp16_biased_mlp])
def test_gpu_fp16_mlp_pit_and_dense_match_onnxruntime(model_fn):
    model = model_fn()
    x = RNG.standard_normal((3, 50, 128)).astype("float16")
    ref = ort_run(model, {"x": x})[0].astype(np.float32)
    for auto in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cm = compile_onnx(model, "cuda", auto=auto)
        got = cm.run({"x": x})[0].astype(np.float32)
        np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


# ----------------------------------------------------------------------------- one rows index per padding mask
def two_layer_padded_model():
    """Two linear layers, each reading ``h * mask`` ([batch, seq, 1]): both are padding rows."""
    return _model(
        [helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
         helper.make_node("Unsqueeze", ["mask_f", "axes"], ["rows"]),
         helper.make_node("Mul", ["x", "rows"], ["xm"]),
         helper.make_node("MatMul", ["xm", "w1"], ["h"]),
         helper.make_node("Mul", ["h", "rows"], ["hm"]),
         helper.make_node("MatMul", ["hm", "w2"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 32]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 16])],
        {"w1": RNG.standard_normal((32, 48)).astype("float32"),
         "w2": RNG.standard_normal((48, 16)).astype("float32"), "axes": np.array([2], "int64")})


def _padded_inputs(b, s, lengths=None):
    lengths = RNG.integers(1, s + 1, size=b) if lengths is None else np.asarray(lengths)
    return {"x": RNG.standard_normal((b, s, 32)).astype("float32"),
            "attention_mask": (np.arange(s)[None] < lengths[:, None]).astype("int64")}


def test_padding_matmuls_share_one_rows_index_from_the_mask():
    """Both matmuls are masked by the same [batch, seq, 1] tensor: the wrapper gets it as a
    third argument, and the lowered main builds one rows index (from the mask, M values)
    instead of one per matmul (from each activation, M x K values)."""
    model = two_layer_padded_model()
    ir = annotate(model).script()
    assert ir.count('"pit.row_mask_arg": 1') == 2
    cm = _check(model, [_padded_inputs(2, 5), _padded_inputs(3, 17), _padded_inputs(2, 4, [0, 0]),
                        _padded_inputs(2, 4, [4, 4])])
    main = cm.lowered["main"].script()
    assert main.count("R.call_tir(pit_row_index_") == 1
    assert "pit_index_" not in main
    assert [a["status"] for a in cm.annotations] == ["pit", "pit"]
    assert all("rows index built from the mask" in a["reason"] for a in cm.annotations)


def test_row_mask_not_used_through_a_transpose():
    """A mask whose rows are not A's rows (A is transposed after masking) builds no shared
    index: the matmul keeps its own index over A (never a wrong answer)."""
    model = _model(
        [helper.make_node("Unsqueeze", ["mask", "axes"], ["rows"]),
         helper.make_node("Mul", ["x", "rows"], ["xm"]),
         helper.make_node("Transpose", ["xm"], ["xt"], perm=[1, 0, 2]),
         helper.make_node("MatMul", ["xt", "w"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6, 32]),
         helper.make_tensor_value_info("mask", TensorProto.FLOAT, [4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 4, 16])],
        {"w": RNG.standard_normal((32, 16)).astype("float32"), "axes": np.array([2], "int64")})
    assert "pit.row_mask_arg" not in annotate(model).script()
    mask = (RNG.random((4, 6)) < 0.5).astype("float32")
    _check(model, [{"x": RNG.standard_normal((4, 6, 32)).astype("float32"), "mask": mask}])


# ----------------------------------------------------------------------------- static shapes
def test_static_shapes_match_symbolic_build():
    model = two_layer_padded_model()
    inputs = _padded_inputs(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = compile_onnx(model, shapes={"x": [3, 8, 32], "attention_mask": [3, 8]})
    assert [i["shape"] for i in cm.inputs] == [[3, 8, 32], [3, 8]]
    assert "batch" not in str(cm.lowered["main"].params[0].ty)
    np.testing.assert_allclose(cm.run(inputs)[0], ort_run(model, inputs)[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"input 'x' has shape \[2, 8, 32\].*\[3, 8, 32\]"):
        cm.run(_padded_inputs(2, 8))


@pytest.mark.parametrize("shapes,match", [
    ({"y": [1, 2]}, r"unknown input 'y'.*\['attention_mask', 'x'\]"),
    ({"x": [3, 8]}, r"'x' is \['batch', 'seq', 32\] in the model, cannot be \[3, 8\]"),
    ({"x": [3, 8, 31]}, r"cannot be \[3, 8, 31\]"),
])
def test_static_shapes_bad_input(shapes, match):
    with pytest.raises(ValueError, match=match):
        compile_onnx(two_layer_padded_model(), shapes=shapes)


# ----------------------------------------------------------------------------- parallel matmuls
def qkv_model(with_bias=(True, True, True), k=32, n=(48, 48, 16)):
    """Three MatMuls of one masked input (attention's Q, K, V projections), each with an
    optional bias Add; a fourth MatMul of another input stays apart."""
    nodes = [helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["mask_f", "axes"], ["rows"]),
             helper.make_node("Mul", ["x", "rows"], ["xm"])]
    inits, outs = {"axes": np.array([2], "int64"), "wo": RNG.standard_normal((k, 8)).astype("float32")}, []
    for i, (nb, b) in enumerate(zip(n, with_bias)):
        inits[f"w{i}"] = RNG.standard_normal((k, nb)).astype("float32")
        nodes.append(helper.make_node("MatMul", ["xm", f"w{i}"], [f"mm{i}" if b else f"y{i}"]))
        if b:
            inits[f"b{i}"] = RNG.standard_normal(nb).astype("float32")
            nodes.append(helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"y{i}"]))
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["batch", "seq", nb]))
    nodes.append(helper.make_node("MatMul", ["x", "wo"], ["yo"]))
    outs.append(helper.make_tensor_value_info("yo", TensorProto.FLOAT, ["batch", "seq", 8]))
    return _model(nodes,
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", k]),
                   helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])],
                  outs, inits)


def _matmul_widths(mod):
    """The N of every R.matmul left in ``mod``'s main."""
    out = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: out.append(int(e.ty.shape[-1])) if (
        isinstance(e, relax.Call) and e.op.same_as(tvm.ir.Op.get("relax.matmul"))) else None)
    return out


@pytest.mark.parametrize("with_bias", [(True, True, True), (False, False, False), (True, False, True)])
def test_parallel_matmuls_become_one(with_bias):
    """The three projections of one input are one matmul on the concatenated constant weights
    (biases concatenated where every branch has one), both with PIT and without; the results
    equal onnxruntime's, and PIT annotates the one matmul once."""
    from pit_tvm.passes import CombineParallelMatmuls

    model = qkv_model(with_bias)
    mod = CombineParallelMatmuls()(relax.transform.FoldConstant()(import_onnx(model)))
    assert sorted(_matmul_widths(mod)) == [8, 112]
    # one slice per branch, each fusable with its consumer (a split would be a kernel of its own)
    script = mod["main"].script()
    assert "R.split" not in script and script.count("R.strided_slice") == 3
    # the concatenated bias in one add where every branch has one (the matmul's epilogue)
    assert script.count("R.add") == (1 if all(with_bias) else sum(with_bias))
    inputs = [_padded_inputs(2, 5), _padded_inputs(3, 4, [0, 2, 4])]
    for auto in (True, False):
        cm = _check(model, inputs, auto=auto)
        assert [a["tensor"] for a in cm.annotations if a["status"] == "pit"] == (["xm"] if auto else [])


def test_matmuls_of_distinct_inputs_stay_apart():
    """A lone matmul (no other matmul of its input) is left as it is."""
    from pit_tvm.passes import CombineParallelMatmuls

    mod = relax.transform.FoldConstant()(import_onnx(masked_model()))
    assert _matmul_widths(CombineParallelMatmuls()(mod)) == [48]
    assert CombineParallelMatmuls()(mod)["main"].same_as(mod["main"])


def test_split_to_slices_keeps_other_splits():
    """Splits into equal sections or along a symbolic axis stay splits; listed indices on a
    static axis become slices with the same values."""
    from pit_tvm.passes.combine import _split_to_slices

    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 12), "float32"))
    y = relax.Var("y", relax.TensorType((n, 12), "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            sx = bb.emit(relax.op.split(x, 2, axis=1))
            sy = bb.emit(relax.op.split(y, [3], axis=0))
            sl = bb.emit(relax.op.split(x, [5], axis=1))
            out = bb.emit_output(relax.Tuple([relax.TupleGetItem(s, i) for s in (sx, sy, sl) for i in (0, 1)]))
        bb.emit_func_output(out)
    script = _split_to_slices(bb.get())["main"].script()
    assert script.count("R.split") == 2 and script.count("R.strided_slice") == 2
    ex = relax.build(_split_to_slices(bb.get()), "llvm")
    xv, yv = RNG.standard_normal((4, 12)).astype("float32"), RNG.standard_normal((6, 12)).astype("float32")
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(yv))
    want = [xv[:, :6], xv[:, 6:], yv[:3], yv[3:], xv[:, :5], xv[:, 5:]]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w)


def test_expected_density_is_checked_before_lowering():
    """A fraction of rows outside (0, 1] is the caller's error, raised by name, not a dense
    fallback with a warning; a valid one reaches the op layer's emit."""
    for bad in (0, 1.01, "many"):
        with pytest.raises((ValueError, TypeError)):
            LowerToPIT(expected_density=bad)
    seen = []

    def emit(bb, a, b, expected_density=None, row_mask=None, **kw):
        seen.append(expected_density)
        return stand_in_emit(bb, a, b, **kw)

    LowerToPIT(emit=emit, expected_density=0.25)(annotate(relu_mlp()))
    assert seen and set(seen) == {0.25}


# ----------------------------------------------------------------------------- padding from a sequence-length input
def seq_len_model():
    """x[batch, seq, 32] where arange(seq) < seq_len[:, None] (else 0) -MatMul-> y: the padding
    mask computed in the graph from the lengths (Shape -> Gather -> Range -> Less -> Where)."""
    return _model(
        [helper.make_node("Shape", ["x"], ["x_shape"]),
         helper.make_node("Gather", ["x_shape", "one"], ["seq"], axis=0),
         helper.make_node("Range", ["zero", "seq", "one"], ["positions"]),
         helper.make_node("Unsqueeze", ["seq_len", "axis1"], ["lengths"]),
         helper.make_node("Less", ["positions", "lengths"], ["valid"]),
         helper.make_node("Unsqueeze", ["valid", "axis2"], ["rows"]),
         helper.make_node("Where", ["rows", "x", "zero_f"], ["xm"]),
         helper.make_node("MatMul", ["xm", "w"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 32]),
         helper.make_tensor_value_info("seq_len", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 48])],
        {"w": RNG.standard_normal((32, 48)).astype("float32"), "zero": np.array(0, "int64"),
         "one": np.array(1, "int64"), "axis1": np.array([1], "int64"), "axis2": np.array([2], "int64"),
         "zero_f": np.array(0, "float32")})


@pytest.fixture(scope="module")
def seq_len_build():
    """(the model, its build for a batch of 4 x 12)"""
    model = seq_len_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, compile_onnx(model, shapes={"x": [4, 12, 32], "seq_len": [4]})


def test_sequence_length_padding_is_found_with_static_shapes(seq_len_build):
    """with the batch fixed (``shapes=``) the range folds to a constant, and the masked matmul
    is a padding-rows PIT matmul whose index is built from the mask"""
    notes = seq_len_build[1].annotations
    assert [(n["tensor"], n["source"], n["status"]) for n in notes] == [("xm", "padding:seq_len", "pit")]
    assert "pit_row_index_" in seq_len_build[1].lowered["main"].script()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=4, max_size=4))
def test_sequence_length_padding_matches_onnxruntime(seq_len_build, lengths):
    model, cm = seq_len_build
    inputs = {"x": RNG.standard_normal((4, 12, 32)).astype("float32"), "seq_len": np.array(lengths, "int64")}
    np.testing.assert_allclose(cm.run(inputs)[0], ort_run(model, inputs)[0], rtol=1e-4, atol=1e-4)


def test_sequence_length_padding_over_symbolic_dims_matches_onnxruntime():
    """over symbolic batch / seq dims the Range over ``Shape(x)[1]`` keeps the length ``seq``
    (not one computed from data), so what it masks keeps its shape: one build, right at two
    sizes, the masked matmul still a padding-rows PIT matmul"""
    model = seq_len_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = compile_onnx(model)
    assert [(n["tensor"], n["source"], n["status"]) for n in cm.annotations] == [("xm", "padding:seq_len", "pit")]
    for batch, seq, lengths in ((4, 12, [12, 0, 5, 7]), (2, 7, [3, 7])):
        inputs = {"x": RNG.standard_normal((batch, seq, 32)).astype("float32"), "seq_len": np.array(lengths, "int64")}
        np.testing.assert_allclose(cm.run(inputs)[0], ort_run(model, inputs)[0], rtol=1e-4, atol=1e-4)


def test_fold_shape_computations_folds_shape_arithmetic_only():
    from pit_tvm.passes.frontend import FOLD_MAX_ELEMENTS, fold_shape_computations

    folded = fold_shape_computations(seq_len_model(), {"x": [4, 12, 32], "seq_len": [4]})
    ops = [n.op_type for n in folded.graph.node]
    assert ops == ["Unsqueeze", "Less", "Unsqueeze", "Where", "MatMul"]     # Shape, Gather, Range folded
    positions = next(t for t in folded.graph.initializer if t.name == "positions")
    np.testing.assert_array_equal(numpy_helper.to_array(positions), np.arange(12))
    # the model keeps its symbolic input dims (only the inference saw them fixed)
    assert folded.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    # symbolic seq: Shape stays, so does everything after it
    assert [n.op_type for n in fold_shape_computations(seq_len_model()).graph.node][:3] == ["Shape", "Gather", "Range"]
    # a weight's transpose is left for TVM (not shape arithmetic)
    side = int(FOLD_MAX_ELEMENTS ** 0.5) + 1
    big = _model([helper.make_node("Transpose", ["w"], ["wt"]), helper.make_node("MatMul", ["x", "wt"], ["y"])],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", side])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", side])],
                 {"w": RNG.standard_normal((side, side)).astype("float32")})
    assert [n.op_type for n in fold_shape_computations(big).graph.node] == ["Transpose", "MatMul"]


@pytest.mark.parametrize("scale_dtype", [TensorProto.FLOAT, TensorProto.INT64])
def test_mul_feeding_a_matmul_is_classified_without_crashing(scale_dtype):
    """A Mul before a MatMul asks whether its other factor is a mask: an input's dtype is a
    PrimType in TVM 0.27 (it crashed with AttributeError). A float scale is data, not a mask;
    an int64 input is a mask; both compile and match numpy."""
    np_scale = np.array(0.5 if scale_dtype == TensorProto.FLOAT else 1, onnx.helper.tensor_dtype_to_np_dtype(scale_dtype))
    nodes = [helper.make_node("Mul", ["x", "sf"], ["xs"]), helper.make_node("MatMul", ["xs", "w"], ["y"])]
    inits = [numpy_helper.from_array(np.ones((64, 32), np.float32), "w")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 64])]
    if scale_dtype == TensorProto.FLOAT:
        nodes.insert(0, helper.make_node("Identity", ["s"], ["sf"]))
        inits.append(numpy_helper.from_array(np_scale, "s"))
    else:
        nodes.insert(0, helper.make_node("Cast", ["keep"], ["sf"], to=TensorProto.FLOAT))
        inputs.append(helper.make_tensor_value_info("keep", TensorProto.INT64, ["M", 1]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 32])], initializer=inits)
    model = compile_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), "llvm")
    x = np.random.default_rng(0).random((5, 64), np.float32)
    feeds = {"x": x}
    if scale_dtype == TensorProto.INT64:
        keep = np.array([[1], [0], [1], [1], [0]], np.int64)
        feeds["keep"] = keep
        expected = (x * keep) @ np.ones((64, 32), np.float32)
        assert [a["status"] for a in model.annotations] == ["pit"], model.annotations
    else:
        expected = (x * 0.5) @ np.ones((64, 32), np.float32)
    np.testing.assert_allclose(model.run(feeds)[0], expected, rtol=1e-5)
