"""SmallMatmulTensorization: attention's small static fp16 matmuls on tensor cores (wmma)."""
import numpy as np
import pytest
import tvm
from tvm import relax

from pit_tvm.testing import build_with_cuda_rules, legalized_cuda_module
from pit_tvm.nvcc import check_cuda_compiles, cuda_sources, find_nvcc
from pit_tvm.schedules.small_matmul import SmallMatmulTensorization
from pit_tvm.target import cuda_schedule_rules, make_target

CUDA = make_target("cuda")


def scores(q, kt, mask):
    """BERT's attention scores: (q @ k^T) * scale + additive mask, one fused function."""
    return relax.op.add(relax.op.multiply(relax.op.matmul(q, kt), relax.const(0.125, "float16")), mask)


def context(p, v):
    return relax.op.matmul(p, v)


#: (operator, input shapes): BERT's two attention matmuls, and extents that are not tile multiples
CASES = [(scores, ((2, 3, 128, 64), (2, 3, 64, 128), (2, 1, 1, 128))),
         (context, ((2, 3, 128, 128), (2, 3, 128, 64))),
         (context, ((3, 40, 24), (3, 24, 56)))]


@pytest.mark.parametrize("fn,shapes", CASES)
def test_applies_and_compiles(fn, shapes):
    mod, prim = legalized_cuda_module(fn, *shapes)
    assert SmallMatmulTensorization().apply(prim, CUDA, False) is not None
    ex = build_with_cuda_rules(mod)
    assert "wmma::mma_sync" in cuda_sources(ex)[0]
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert check_cuda_compiles(ex, archs=("sm_80", "sm_90")) >= 1


@pytest.mark.parametrize("shapes,dtype,target", [
    (((1, 1, 64), (1, 64, 128)), "float16", CUDA),     # one output row: a GEMV
    (((8, 64), (64, 8)), "float16", CUDA),             # 8 output columns
    (((4, 64, 64), (4, 64, 64)), "float32", CUDA),     # not fp16
    (((4, 64, 64), (4, 64, 64)), "float16", make_target("llvm")),
])
def test_declines(shapes, dtype, target):
    _, prim = legalized_cuda_module(context, *shapes, dtype=dtype)
    assert SmallMatmulTensorization().apply(prim, target, False) is None


def test_is_ahead_of_matmul():
    names = [type(r).__name__ for r in cuda_schedule_rules()]
    assert names.index("SmallMatmulTensorization") == names.index("NumericArchMatmul") - 1


def test_matmul_with_symbolic_rows_gets_tensor_cores_on_sm_90a():
    """A batched fp16 matmul with a symbolic extent is dlight Matmul's; on the default
    ``sm_90a`` it must still tensorize (dlight alone reads ``sm_90a`` as no tensor cores)."""
    from tvm.s_tir import dlight as dl
    from tvm.tirx import Var

    from pit_tvm.schedules.small_matmul import NumericArchMatmul

    n = Var("n", "int64")
    _, prim = legalized_cuda_module(context, (4, n, 128), (4, 128, 128))
    assert SmallMatmulTensorization().apply(prim, CUDA, False) is None     # not static
    assert dl.gpu.Matmul().apply(prim, CUDA, False) is not None
    sch = NumericArchMatmul().apply(prim, CUDA, False)
    assert "wmma" in sch.mod.script() or "mma" in sch.mod.script()
    assert "wmma" not in dl.gpu.Matmul().apply(prim, CUDA, False).mod.script()
    mod, _ = legalized_cuda_module(context, (4, n, 128), (4, 128, 128))
    src = "\n".join(cuda_sources(build_with_cuda_rules(mod)))
    assert "wmma::mma_sync" in src
    if find_nvcc() is not None:
        assert check_cuda_compiles(build_with_cuda_rules(mod), archs=("sm_90a",)) >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("fn,shapes", CASES)
def test_gpu_matches_numpy(fn, shapes):
    rng = np.random.default_rng(0)
    dev = tvm.cuda(0)
    xs = [(rng.standard_normal(s) / 4).astype("float16") for s in shapes]
    vm = relax.VirtualMachine(build_with_cuda_rules(legalized_cuda_module(fn, *shapes)[0]), dev)
    got = vm["main"](*(tvm.runtime.tensor(x, dev) for x in xs)).numpy().astype("float32")
    f = [x.astype("float32") for x in xs]
    ref = f[0] @ f[1] if fn is context else f[0] @ f[1] * 0.125 + f[2]
    np.testing.assert_allclose(got, ref, atol=2e-2, rtol=2e-2)
