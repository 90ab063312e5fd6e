"""ONNX's own node test cases (``onnx.backend.test.case.node``: a one-node model with stored
inputs and outputs) through ``compile_onnx`` on llvm, for the op types transformer exports use.

Each selected case either matches ONNX's stored outputs or raises :class:`UnsupportedOnnxError`
with the reason listed for it in ``UNSUPPORTED`` (never another exception).  A case unsupported
only because a parameter input (axes, shape, k, pads, ...) is a graph input is also compiled with
that input made an initializer, as exports have it, and must then match.

CI runs a representative subset (``PER_OP`` supported and ``PER_OP`` unsupported cases per op
type, plus ``ALWAYS``: about a minute on 2 cores); ``PIT_ONNX_NODE_CASES=all`` runs every case
(1.5 to 2.5 minutes).  Below: the regression tests of issue 32 (scalar inputs, bf16 batched matmul,
LayerNormalization's statistics, import errors).
"""
from __future__ import annotations

import os
import re
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pit_tvm.compile import compile_onnx
from pit_tvm.passes.frontend import UnsupportedOnnxError

#: the op types compile_onnx meets in transformer exports
OPS = (
    "MatMul Gemm Einsum LayerNormalization Relu Gelu Erf Tanh Sigmoid Softplus LeakyRelu Elu HardSigmoid HardSwish "
    "Selu Mish Softsign PRelu ThresholdedRelu Celu Softmax LogSoftmax Add Sub Mul Div Pow Sqrt Where Equal Less "
    "LessOrEqual Greater GreaterOrEqual Not And Or Xor Cast CastLike Neg Exp Log Abs Reciprocal Min Max Clip Sign "
    "Floor Ceil Round Mod IsNaN IsInf Sin Cos Reshape Transpose Unsqueeze Squeeze Concat Split Slice Expand Shape "
    "Size Gather Flatten ConstantOfShape Range Identity Tile Constant Dropout ReduceMean ReduceSum ReduceMax "
    "ReduceMin ReduceProd ReduceL2 ArgMax ArgMin GatherElements GatherND ScatterND ScatterElements NonZero TopK "
    "CumSum OneHot Trilu Pad Sum Mean").split()
PER_OP = 2
RUN_ALL = os.environ.get("PIT_ONNX_NODE_CASES") == "all"

#: cases in every run: the regressions of issue 32 and the fixed converters
ALWAYS = {
    "test_gemm_default_scalar_bias", "test_einsum_scalar", "test_einsum_batch_matmul_bfloat16",
    "test_layer_normalization_3d_axis1_epsilon", "test_layer_normalization_4d_axis_negative_2",
    "test_expand_dim_changed", "test_isinf_positive", "test_isinf_negative", "test_dropout_default_mask",
    "test_shape_start_greater_than_end", "test_slice", "test_clip_default_int8_min",
    "test_range_int32_type_negative_delta",
    "test_tril_zero", "test_matmul_4d",
}

_RUNTIME_PARAM = r"graph inputs, known only at run time"
_FLOAT8_ETC = r"element type (FLOAT8|FLOAT4|INT4|UINT4|INT2|UINT2)"

#: ``{reason regex: case names}``: the cases compile_onnx refuses, each with its reason
_UNSUPPORTED_BY_REASON = {
    r"no converter for Celu": ["test_celu", "test_celu_float16", "test_celu_bfloat16"],
    r"ConstantOfShape.*shape computed at run time": [
        "test_constantofshape_float_ones", "test_constantofshape_int_zeros", "test_constantofshape_int_shape_zero"],
    r"CumSum.*non-constant axis.*" + _RUNTIME_PARAM: [
        "test_cumsum_1d", "test_cumsum_1d_exclusive", "test_cumsum_1d_reverse", "test_cumsum_1d_reverse_exclusive",
        "test_cumsum_2d_axis_0", "test_cumsum_2d_axis_1", "test_cumsum_2d_negative_axis", "test_cumsum_2d_int32",
        "test_cumsum_1d_int32_exclusive"],
    r"Dropout's training_mode must be a constant": [
        "test_training_dropout_default", "test_training_dropout_default_mask", "test_training_dropout",
        "test_training_dropout_mask", "test_training_dropout_zero_ratio", "test_training_dropout_zero_ratio_mask"],
    r"element type STRING": ["test_equal_string", "test_equal_string_broadcast"],
    r"graph input '\w+' is a (sequence|optional)_type": ["test_identity_sequence", "test_identity_opt"],
    r"OneHot.*Only constant depth.*" + _RUNTIME_PARAM: [
        "test_onehot_without_axis", "test_onehot_with_axis", "test_onehot_negative_indices",
        "test_onehot_out_of_range_indices", "test_onehot_with_negative_axis", "test_onehot_with_bfloat16_values"],
    r"Pad.*(Dynamic pads|'Var' object has no attribute 'value').*" + _RUNTIME_PARAM: [
        "test_constant_pad", "test_edge_pad", "test_reflect_pad", "test_wrap_pad", "test_constant_pad_axes",
        "test_constant_pad_negative_axes"],
    r"Pow.*(same datatype|Pow of int\d+ tensors)": [
        "test_pow_types_int64_float32", "test_pow_types_int32_float32", "test_pow_types_int64_int64",
        "test_pow_types_int32_int32"],
    r"Reshape.*new shape to be Shape.*" + _RUNTIME_PARAM: [
        "test_reshape_reordered_all_dims", "test_reshape_reordered_last_dims", "test_reshape_reduced_dims",
        "test_reshape_extended_dims", "test_reshape_one_dim", "test_reshape_negative_dim",
        "test_reshape_negative_extended_dims", "test_reshape_zero_dim", "test_reshape_zero_and_negative_dim",
        "test_reshape_allowzero_reordered"],
    r"Split.*Dynamic Split.*" + _RUNTIME_PARAM: [
        f"test_split_{kind}_opset{v}" for v in (13, 18)
        for kind in ("variable_parts_1d", "variable_parts_2d", "variable_parts_default_axis", "zero_size_splits")],
    r"TopK.*k must be a constant.*" + _RUNTIME_PARAM: [
        "test_top_k", "test_top_k_same_values", "test_top_k_same_values_largest",
        "test_top_k_same_values_2d", "test_top_k_smallest", "test_top_k_negative_axis"],
    r"TopK of uint64 is not supported": ["test_top_k_uint64"],
    r"Reduce(Max|Min) of bool tensors is not supported": [
        "test_reduce_max_bool_inputs", "test_reduce_min_bool_inputs", "test_reduce_max_empty_set_bool"],
    r"Reduce\w+.*Only constant axes.*" + _RUNTIME_PARAM: [],  # filled below (by name)
    _FLOAT8_ETC: [],  # filled below (by name)
}


def _cases_by_name() -> dict:
    """ONNX's node test cases of one node (not the ``_expanded`` function bodies) whose op is in
    :data:`OPS`, by name."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = collect_testcases(None)
    return {c.name: c for c in cases if len(c.model.graph.node) == 1 and c.model.graph.node[0].op_type in OPS
            and "_expanded" not in c.name}


CASES = _cases_by_name()
_LISTED = {name for names in _UNSUPPORTED_BY_REASON.values() for name in names}
for _name in CASES:
    if (re.fullmatch(r"test_reduce_(l2|max|mean|min|prod|sum)_.*", _name) and len(CASES[_name].model.graph.input) > 1
            and _name not in _LISTED):
        _UNSUPPORTED_BY_REASON[r"Reduce\w+.*Only constant axes.*" + _RUNTIME_PARAM].append(_name)
    if re.fullmatch(r"test_cast(like)?_.*(FLOAT8|FLOAT4|INT4|UINT4|INT2|UINT2).*", _name):
        _UNSUPPORTED_BY_REASON[_FLOAT8_ETC].append(_name)
#: ``{case name: the reason its UnsupportedOnnxError must give}``
UNSUPPORTED = {name: reason for reason, names in _UNSUPPORTED_BY_REASON.items() for name in names}

#: ONNX's inputs that exports make constants, by op type (input positions)
PARAMETER_INPUTS = {"Reshape": (1,), "Expand": (1,), "Slice": (1, 2, 3, 4), "Squeeze": (1,), "Unsqueeze": (1,),
                    "TopK": (1,), "OneHot": (1, 2), "Split": (1,), "Pad": (1, 2, 3), "CumSum": (1,), "Tile": (1,),
                    "ReduceMean": (1,), "ReduceSum": (1,), "ReduceMax": (1,), "ReduceMin": (1,),
                    "ReduceProd": (1,), "ReduceL2": (1,)}


def _select() -> tuple[list, list]:
    """(supported cases, unsupported cases) to run: all of them with ``RUN_ALL``, else the first
    :data:`PER_OP` of each kind per op type and :data:`ALWAYS`."""
    supported, unsupported, taken = [], [], {}
    for name, case in CASES.items():
        op = case.model.graph.node[0].op_type
        kind = name in UNSUPPORTED
        count = taken.get((op, kind), 0)
        if RUN_ALL or name in ALWAYS or count < PER_OP:
            (unsupported if kind else supported).append(name)
            taken[(op, kind)] = count + 1
    return supported, unsupported


SUPPORTED_RUN, UNSUPPORTED_RUN = _select()


def as_array(value) -> np.ndarray:
    return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else np.asarray(value)


def _divergence_mask(name, inputs, want):
    """Where TVM is known to differ from ONNX: float Mod (``fmod=0``) by an infinite divisor gives
    NaN (numpy gives the dividend or an infinity).  The other positions must match."""
    if name.startswith("test_mod_") and want.dtype.kind == "f":
        return np.isfinite(np.broadcast_to(as_array(inputs[1]), want.shape))
    return np.ones(want.shape, bool)


def assert_outputs_match(name, got, inputs, outputs, rtol, atol):
    assert len(got) == len(outputs), f"{name}: {len(got)} outputs, ONNX has {len(outputs)}"
    for i, (g, want) in enumerate(zip(got, outputs)):
        want = as_array(want)
        assert g.shape == want.shape and g.dtype == want.dtype, \
            f"{name} output {i}: {g.shape} {g.dtype}, ONNX has {want.shape} {want.dtype}"
        keep = _divergence_mask(name, inputs, want)
        if want.dtype.kind in "iub":
            np.testing.assert_array_equal(g[keep], want[keep], err_msg=f"{name} output {i}")
        else:
            np.testing.assert_allclose(g.astype(np.float64)[keep], want.astype(np.float64)[keep],
                                       rtol=max(rtol, 1e-3), atol=max(atol, 1e-5), err_msg=f"{name} output {i}")


def run_case(model, data_sets, name, rtol, atol):
    compiled = compile_onnx(model, "llvm")
    names = [i["name"] for i in compiled.inputs]
    for inputs, outputs in data_sets:
        given = {i.name: as_array(v) for i, v in zip(model.graph.input, inputs)}
        got = compiled.run({n: given[n] for n in names})
        assert_outputs_match(name, got, inputs, outputs, rtol, atol)


@pytest.mark.parametrize("name", SUPPORTED_RUN)
def test_node_case_matches_onnx(name):
    case = CASES[name]
    run_case(case.model, case.data_sets, name, case.rtol, case.atol)


@pytest.mark.parametrize("name", UNSUPPORTED_RUN)
def test_node_case_unsupported_is_a_clear_error(name):
    case = CASES[name]
    node = case.model.graph.node[0]
    with pytest.raises(UnsupportedOnnxError) as info:
        compile_onnx(case.model, "llvm")
    message = str(info.value)
    assert re.search(UNSUPPORTED[name], message), message
    if info.value.op_type is not None:  # a node's error: it names the node's op type
        assert info.value.op_type == node.op_type and f"({node.op_type}" in message
        assert info.value.__cause__ is not None


def _with_constant_parameters(case):
    """``case.model`` with its parameter inputs (:data:`PARAMETER_INPUTS`) made initializers from
    the first data set, and the data sets without them; None when the data sets differ there."""
    node = case.model.graph.node[0]
    positions = PARAMETER_INPUTS.get(node.op_type, ())
    graph_inputs = [i.name for i in case.model.graph.input]
    params = {node.input[p] for p in positions if p < len(node.input) and node.input[p] in graph_inputs}
    if not params:
        return None
    values = [{n: as_array(v) for n, v in zip(graph_inputs, inputs)} for inputs, _ in case.data_sets]
    if any(not np.array_equal(v[p], values[0][p]) for v in values for p in params):
        return None
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    kept = [i for i in model.graph.input if i.name not in params]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    model.graph.initializer.extend(numpy_helper.from_array(values[0][p], p) for p in sorted(params))
    data_sets = [([v[i.name] for i in kept], outputs) for v, (_, outputs) in zip(values, case.data_sets)]
    return model, data_sets


CONSTANT_PARAMETER_RUN = [n for n in UNSUPPORTED_RUN if _RUNTIME_PARAM in UNSUPPORTED[n]
                          and _with_constant_parameters(CASES[n]) is not None]


#: ``{case name: reason}``: the cases refused even with constant parameters
CONSTANT_PARAMETERS_UNSUPPORTED = {
    **{f"test_reduce_{op}_empty_set": r"Reduce\w+ over an axis of size 0"
       for op in ("l2", "max", "min", "prod", "sum")},
    **{f"test_split_zero_size_splits_opset{v}": r"Split into a part of size 0" for v in (13, 18)},
}


@pytest.mark.parametrize("name", CONSTANT_PARAMETER_RUN)
def test_node_case_with_constant_parameters_matches_onnx(name):
    """Matches ONNX, or (:data:`CONSTANT_PARAMETERS_UNSUPPORTED`) is refused with its reason."""
    case = CASES[name]
    model, data_sets = _with_constant_parameters(case)
    if name in CONSTANT_PARAMETERS_UNSUPPORTED:
        with pytest.raises(UnsupportedOnnxError, match=CONSTANT_PARAMETERS_UNSUPPORTED[name]) as info:
            compile_onnx(model, "llvm")
        assert info.value.op_type == case.model.graph.node[0].op_type
        return
    run_case(model, data_sets, name, case.rtol, case.atol)


def test_every_listed_unsupported_case_exists():
    """The lists name real cases (a renamed ONNX case would otherwise drop out silently)."""
    assert set(UNSUPPORTED) <= set(CASES), sorted(set(UNSUPPORTED) - set(CASES))
    assert set(CONSTANT_PARAMETERS_UNSUPPORTED) <= set(UNSUPPORTED)


# --- regressions (issue 32) ------------------------------------------------------------------

def _model(nodes, inputs, outputs, initializers=(), opset=18):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def test_scalar_input_runs_compiled_and_loaded(tmp_path):
    """A 0-d input stays 0-d on its way to the VM (it was made 1-d and rejected), in
    ``CompiledModel.run`` and in ``runtime.load(...).run``, as an array or a Python scalar."""
    from pit_tvm.runtime import load

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 4)).astype("float32")
    model = _model([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "c"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8]),
                    helper.make_tensor_value_info("c", TensorProto.FLOAT, [])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])],
                   [numpy_helper.from_array(w, "w")])
    x = rng.standard_normal((3, 8)).astype("float32")
    compiled = compile_onnx(model, "llvm")
    path = compiled.export(tmp_path / "scalar.so")
    loaded = load(path)
    for c in (np.float32(1.5), np.array(-2.0, "float32"), 0.25):
        want = x @ w + np.float32(c)
        np.testing.assert_allclose(compiled.run({"x": x, "c": c})[0], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(loaded.run({"x": x, "c": c})[0], want, rtol=1e-5, atol=1e-5)


def test_bfloat16_batched_matmul_builds_and_matches():
    """bf16 batched MatMul on llvm: the CPU batched-matmul schedule vectorised the bf16 zero-init,
    which TVM's bf16 legalisation rejected (``dtype mismatch on BufferStore``)."""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    model = _model([helper.make_node("MatMul", ["a", "b"], ["c"])],
                   [helper.make_tensor_value_info("a", TensorProto.BFLOAT16, [4, 6, 16]),
                    helper.make_tensor_value_info("b", TensorProto.BFLOAT16, [4, 16, 5])],
                   [helper.make_tensor_value_info("c", TensorProto.BFLOAT16, [4, 6, 5])])
    rng = np.random.default_rng(1)
    a = rng.standard_normal((4, 6, 16)).astype(bf16)
    b = rng.standard_normal((4, 16, 5)).astype(bf16)
    got = compile_onnx(model, "llvm").run({"a": a, "b": b})[0]
    assert got.dtype == bf16
    want = a.astype(np.float32) @ b.astype(np.float32)
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-2, atol=5e-2)


def test_layer_norm_mean_and_inv_std_dev_are_computed():
    """LayerNormalization's ``Mean`` and ``InvStdDev`` outputs (TVM's importer made them 0-d
    zeros) against numpy, over the normalised axes."""
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=4, deadline=None)
    @given(shape=st.lists(st.integers(1, 5), min_size=2, max_size=4), data=st.data())
    def check(shape, data):
        axis = data.draw(st.integers(-len(shape), len(shape) - 1))
        norm_shape = shape[axis:]
        model = _model([helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"], axis=axis,
                                         epsilon=1e-3)],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                       [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "mean", "inv")],
                       [numpy_helper.from_array(np.linspace(0.5, 1.5, int(np.prod(norm_shape)), dtype="float32")
                                                .reshape(norm_shape), "s"),
                        numpy_helper.from_array(np.full(norm_shape, 0.1, "float32"), "b")])
        x = np.random.default_rng(len(shape)).standard_normal(shape).astype("float32")
        y, mean, inv = compile_onnx(model, "llvm").run({"x": x})
        axes = tuple(range(axis % len(shape), len(shape)))
        want_mean = x.mean(axis=axes, keepdims=True)
        want_inv = 1 / np.sqrt(((x - want_mean) ** 2).mean(axis=axes, keepdims=True) + 1e-3)
        np.testing.assert_allclose(mean, want_mean, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(inv, want_inv, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(y, (x - want_mean) * want_inv * np.linspace(0.5, 1.5, int(np.prod(norm_shape)),
                                   dtype="float32").reshape(norm_shape) + 0.1, rtol=1e-4, atol=1e-4)

    check()


def test_importer_error_names_the_node_op_and_reason():
    """An importer failure in the second node (ReduceMean whose axes are a graph input): one
    UnsupportedOnnxError naming that node, its op type and the reason, the importer's
    AssertionError as its cause; also a ValueError and a NotImplementedError."""
    model = _model([helper.make_node("Relu", ["x"], ["h"], name="act"),
                    helper.make_node("ReduceMean", ["h", "axes"], ["y"], name="pool")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                    helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    with pytest.raises(UnsupportedOnnxError) as info:
        compile_onnx(model, "llvm")
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, NotImplementedError)
    assert (err.node_name, err.op_type) == ("pool", "ReduceMean")
    assert "'pool' (ReduceMean" in str(err) and "constant axes" in str(err) and "['axes']" in str(err)
    assert isinstance(err.__cause__, AssertionError)


def test_unsupported_operator_is_named():
    """An op TVM has no converter for: the error names the first node using it."""
    model = _model([helper.make_node("Relu", ["x"], ["h"], name="act"),
                    helper.make_node("Celu", ["h"], ["y"], name="odd")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    with pytest.raises(UnsupportedOnnxError, match=r"'odd' \(Celu\).*no converter for Celu") as info:
        compile_onnx(model, "llvm")
    assert info.value.op_type == "Celu" and info.value.__cause__ is not None
