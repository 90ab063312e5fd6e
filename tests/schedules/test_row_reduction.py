"""RowReduction: the warp-per-row dlight rule for softmax / layer norm with static shapes."""
import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from pit_tvm.testing import build_with_cuda_rules, cuda_schedules_on_cpu, legalized_cuda_module
from pit_tvm.nvcc import check_cuda_compiles, cuda_kernels, cuda_sources, find_nvcc
from pit_tvm.schedules.row_reduction import RowReduction
from pit_tvm.target import cuda_schedule_rules, make_target

CUDA = make_target("cuda")


def _prim(mod):
    return [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)][0]


def softmax_mod(shape=(4, 3, 40, 40), dtype="float16"):
    return legalized_cuda_module(lambda x: relax.op.nn.softmax(x, axis=-1), shape, dtype=dtype)[0]


def layer_norm_mod(rows=(4, 40), d=96, dtype="float16"):
    return legalized_cuda_module(lambda x, g, b: relax.op.nn.layer_norm(x, g, b, axes=[-1]),
                                 (*rows, d), (d,), (d,), dtype=dtype)[0]


def test_applies_to_softmax_and_layer_norm_with_static_shapes():
    for mod in (softmax_mod(), layer_norm_mod()):
        sch = RowReduction().apply(_prim(mod), CUDA, False)
        assert sch is not None
        script = sch.mod["main"].script()
        assert 'thread="threadIdx.y"' in script and 'thread="threadIdx.x"' in script
        assert "T.int64(32), thread=\"threadIdx.x\"" in script


def test_declines_symbolic_rows_and_long_rows():
    n = tirx.Var("n", "int64")
    assert RowReduction().apply(_prim(softmax_mod((n, 64))), CUDA, False) is None
    assert RowReduction().apply(_prim(softmax_mod((8, 8192))), CUDA, False) is None
    assert RowReduction().apply(_prim(softmax_mod()), make_target("llvm"), False) is None


def test_declines_multi_block_spatial_functions():
    """A split (one spatial block per output, no reduction) is not a row reduction."""
    mod, prim = legalized_cuda_module(lambda x: relax.op.split(x, [64, 128], axis=-1), (8, 192))
    assert RowReduction().apply(prim, CUDA, False) is None
    build_with_cuda_rules(mod)


def test_is_ahead_of_general_reduction():
    names = [type(r).__name__ for r in cuda_schedule_rules()]
    assert names.index("RowReduction") < names.index("GeneralReduction")


@pytest.mark.parametrize("mod_fn", [softmax_mod, layer_norm_mod])
def test_cuda_build(mod_fn):
    ex = build_with_cuda_rules(mod_fn())
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(ex, archs=("sm_80", "sm_90")) >= 1


@pytest.mark.gpu
def test_gpu_softmax_and_layer_norm_match_numpy():
    rng = np.random.default_rng(0)
    dev = tvm.cuda(0)
    # rows not a multiple of the CTA's rows (40 % 8 == 0, 3 heads) and a row of 40 (not 32k)
    x = rng.standard_normal((4, 3, 40, 40)).astype("float16")
    vm = relax.VirtualMachine(build_with_cuda_rules(softmax_mod()), dev)
    got = vm["main"](tvm.runtime.tensor(x, dev)).numpy().astype("float32")
    e = np.exp(x.astype("float32") - x.astype("float32").max(-1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(-1, keepdims=True), atol=3e-3)
    x = rng.standard_normal((4, 40, 96)).astype("float16")
    g, b = rng.standard_normal(96).astype("float16"), rng.standard_normal(96).astype("float16")
    vm = relax.VirtualMachine(build_with_cuda_rules(layer_norm_mod()), dev)
    got = vm["main"](*(tvm.runtime.tensor(v, dev) for v in (x, g, b))).numpy().astype("float32")
    xf = x.astype("float32")
    ref = (xf - xf.mean(-1, keepdims=True)) / np.sqrt(xf.var(-1, keepdims=True) + 1e-5) * g + b
    np.testing.assert_allclose(got, ref, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("mod_fn", [lambda: softmax_mod((2, 2, 64, 64), "float32"),
                                    lambda: layer_norm_mod((2, 64), 32, "float32"),
                                    lambda: layer_norm_mod((2, 64), 768, "float32")], ids=["softmax", "layer_norm32", "layer_norm768"])
def test_fp32_row_results_stay_in_each_lanes_registers(mod_fn):
    """fp32 (the dtype whose kernels failed): no kernel keeps a row's max / sum / variance in shared
    memory.  There lane 0 stored it and the other 31 lanes of its warp read it with no barrier
    between (TVM's ThreadSync took the common index [threadIdx.y] for one thread), and nvcc
    (sm_90a) issued their loads before lane 0's store: a stale mean and variance, NaN or a wrong
    scale, on the GPU only (the encoder of test_longformer's GPU test)"""
    ex = build_with_cuda_rules(mod_fn())
    kernels = {name: body for src in cuda_sources(ex) for name, (_, body) in cuda_kernels(src).items()}
    assert kernels
    for name, body in kernels.items():
        assert "__shared__" not in body, name
        assert "__shfl_sync" in body, name          # the warp all-reduce's broadcast to every lane


def test_cuda_schedule_run_on_the_cpu_matches_numpy():
    """The RowReduction schedules (softmax over 40 columns: 8 lanes past the row; layer norm over
    768) run on the CPU with their thread loops serial (pit_tvm.testing.cuda_schedules_on_cpu)"""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 40, 40)).astype("float32") * 4
    vm = relax.VirtualMachine(cuda_schedules_on_cpu(softmax_mod(x.shape, "float32")), tvm.cpu())
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), e / e.sum(-1, keepdims=True), atol=1e-6)
    x = rng.standard_normal((2, 8, 768)).astype("float32") + 3
    g, b = rng.standard_normal(768).astype("float32"), rng.standard_normal(768).astype("float32")
    vm = relax.VirtualMachine(cuda_schedules_on_cpu(layer_norm_mod((2, 8), 768, "float32")), tvm.cpu())
    got = vm["main"](*(tvm.runtime.tensor(v) for v in (x, g, b))).numpy()
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g + b
    np.testing.assert_allclose(got, ref, atol=2e-4)


def test_serial_thread_loops_refuses_a_tiled_kernel():
    """a kernel whose threads meet inside one thread loop (the generic CUDA grouped GEMM: each
    thread loads part of a shared tile, then reads all of it) cannot run serially: refused with
    the shared buffer's name, not run into garbage"""
    from pit_tvm.schedules.grouped_gemm import grouped_gemm_generic_func
    from pit_tvm.testing import serial_thread_loops

    func = grouped_gemm_generic_func("scatter", 32, 16, 4, 1, "float32", "float32", False, None, "cuda:sm_80")
    with pytest.raises(ValueError, match="writes and reads shared buffer"):
        serial_thread_loops(func)
