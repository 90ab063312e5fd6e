"""Programmatic dependent launch (pit_tvm.schedules.dependent_launch) of the TIRx kernels.

CPU part: in the CUDA of each kind of TIRx kernel (wgmma, strips, attention) every kernel lets
the next one launch and waits for the one before it ahead of any access to its memory
parameters, for sm_90 and later only (the CUDA still compiles for sm_80); the launch tag
survives TVM's host / device split (before the dynamic-shared-memory tag); dlight's kernels are
launched plainly.  GPU part (``@pytest.mark.gpu``): chains of dependent kernels, PDL and plain
mixed, against numpy.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax

from pit_tvm.nvcc import cuda_kernels, cuda_sources
from pit_tvm.nvcc import check_cuda_compiles, find_nvcc
from pit_tvm.schedules.dependent_launch import ENTRY, PDL_TAG, launches_dependent, with_dependent_launch
from pit_tvm.schedules.wgmma import WgmmaConfig, wgmma_row_gather_func
from pit_tvm.target import build
from pit_tvm.testing import gemm_chain_module


TARGET = "cuda:sm_90a"
ENTRY_CALL = f"{ENTRY}();"


def _tirx_kernels():
    """one kernel of each kind written in TIRx"""
    from pit_tvm.schedules.attention import fused_attention_func
    from pit_tvm.schedules.wgmma import wgmma_compact_a_func, wgmma_tiles_gather_func
    from pit_tvm.schedules.wgmma_strips import strip_list_func, strip_pack_func

    return {"dense": wgmma_row_gather_func(256, 512, dense=True),
            "rows_tier": wgmma_row_gather_func(256, 512, rows_upto=128, config=WgmmaConfig(64, 8)),
            "tiles": wgmma_tiles_gather_func(256, 512, 64), "compact_a": wgmma_compact_a_func(256, 1),
            "strip_list": strip_list_func(256, 1), "strip_pack": strip_pack_func(256, 1),
            "attention": fused_attention_func(2, 2, 128, 64, 0.125)}


def _graph(m=256, d=768, dtype="float16"):
    """``relu(layer_norm(x) @ w1) @ w2 + x``: dlight kernels (layer norm, elementwise) around two
    wgmma GEMMs (``call_tir``), so PDL kernels follow plain ones and plain ones PDL ones"""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, d), dtype))
    gamma, beta = relax.Var("gamma", relax.TensorType((d,), dtype)), relax.Var("beta", relax.TensorType((d,), dtype))
    w1, w2 = (relax.Var(f"w{i}", relax.TensorType((d, d), dtype)) for i in (1, 2))
    gemm = wgmma_row_gather_func(d, d, dtype, dtype, dense=True)
    with bb.function("main", [x, gamma, beta, w1, w2]):
        with bb.dataflow():
            gv = bb.add_func(gemm, "gemm")
            y = bb.emit(relax.op.nn.layer_norm(x, gamma, beta, axes=[-1]))
            z = bb.emit(relax.op.nn.relu(relax.call_tir(gv, [y, w1], relax.TensorType((m, d), dtype))))
            out = bb.emit_output(relax.op.add(relax.call_tir(gv, [z, w2], relax.TensorType((m, d), dtype)), x))
        bb.emit_func_output(out)
    return bb.get()


def _kernels(source: str) -> list[tuple[str, str]]:
    """(signature, body) of each kernel defined in ``source`` (not the forward declarations)"""
    return list(cuda_kernels(source).values())


def _assert_waits_first(source: str, kernel: tuple[str, str], what: str) -> None:
    """``kernel`` (of ``source``) calls :data:`ENTRY` once, ahead of any access to a memory
    parameter, and ``source`` defines it: the trigger, then the wait, for sm_90 and later"""
    signature, body = kernel
    memory = re.findall(r"(?:\*|CUtensorMap)\s*(?:__restrict__\s*)?(\w+)(?=[,)])", signature)
    before = body.split(ENTRY_CALL)[0]
    assert memory and body.count(ENTRY_CALL) == 1, (what, signature)
    assert not any(re.search(rf"\b{p}\b", before) for p in memory), (what, before)
    entry = source[source.index(f"void {ENTRY}()"):].split("}", 1)[0]
    assert ("__CUDA_ARCH__ >= 900" in entry and entry.index("griddepcontrol.launch_dependents")
            < entry.index("griddepcontrol.wait")), entry


def test_tirx_kernels_wait_first():
    for name, func in _tirx_kernels().items():
        source = "".join(cuda_sources(build(tvm.IRModule({"main": func}), TARGET)))
        kernels = _kernels(source)
        assert kernels, name
        for kernel in kernels:
            _assert_waits_first(source, kernel, name)


def test_graph_kernels():
    """a Relax graph: its wgmma GEMMs wait first, dlight's layer norm and elementwise kernels are
    launched plainly; the CUDA, built for sm_90a, still compiles for sm_80 where it has no wgmma"""
    source = "".join(cuda_sources(build(_graph(), TARGET)))
    kernels = _kernels(source)
    waiting = [k for k in kernels if ENTRY_CALL in k[1]]
    assert len(waiting) == 1 and "wgmma" in waiting[0][1] and len(kernels) >= 3
    _assert_waits_first(source, waiting[0], "gemm")
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    for name, func in _tirx_kernels().items():
        if name.startswith("strip"):     # (no wgmma or TMA: a kernel sm_80 can run)
            assert check_cuda_compiles(build(tvm.IRModule({"main": func}), TARGET), archs=("sm_80",)) >= 1


def test_launch_tag():
    """the tag is in each device kernel's launch parameters after TVM's host / device split,
    before the dynamic-shared-memory tag (TVM requires that one last); a second application
    changes nothing; a function without kernels is refused"""
    from tvm.tirx.build import split_host_device_mods
    from tvm.tirx.compilation_pipeline import get_tir_pipeline

    func = _tirx_kernels()["dense"]
    assert launches_dependent(func) and with_dependent_launch(func).same_as(func)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}).with_host("llvm")
    mod = tvm.tirx.transform.BindTarget(target)(tvm.IRModule({"main": func}))
    kernels = [f for m in split_host_device_mods(get_tir_pipeline("default")[0](mod))[1].values()
               for f in m.functions.values()]
    assert kernels
    for kernel in kernels:
        params = [str(p) for p in kernel.attrs["tirx.kernel_launch_params"]]
        assert params.count(PDL_TAG) == 1 and params[-1] == "tirx.use_dyn_shared_memory", params
        assert str(kernel.body).count(f'func_call("{ENTRY}"') == 1
    with pytest.raises(ValueError, match="launches no kernel"):
        with_dependent_launch(tvm.tirx.PrimFunc([], tvm.tirx.Evaluate(0)))


def test_older_archs_plain():
    """lowered for sm_80, a TIRx kernel is launched plainly; for sm_90 with PDL"""
    from tvm.script import tirx as T

    from pit_tvm.schedules.wgmma import lower_tirx

    @T.prim_func(s_tir=False)
    def double(a: T.Buffer((1024,), "float32"), b: T.Buffer((1024,), "float32")):
        T.device_entry()
        cta = T.cta_id([8])
        tid = T.thread_id([128])
        b[cta * 128 + tid] = a[cta * 128 + tid] * T.float32(2)

    for arch, pdl in (("sm_80", False), ("sm_90", True), ("sm_90a", True)):
        lowered = lower_tirx(double, tvm.target.Target({"kind": "cuda", "arch": arch}))
        assert launches_dependent(lowered) == pdl and (ENTRY in str(lowered)) == pdl, arch


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_gemm_chain():
    """Eight dense wgmma GEMMs in a chain, each reading the one before's output, in one Relax
    function (launched back to back): the result equals numpy's chain of the same fp16 steps, so
    no kernel read its input before it was written."""
    m, widths = 3000, [256, 512, 256, 768, 256, 512, 256, 512, 256]
    mod = gemm_chain_module(m, widths, lambda k, n: wgmma_row_gather_func(k, n, dense=True))
    vm = relax.VirtualMachine(build(mod, TARGET), tvm.cuda())
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((m, widths[0])).astype(np.float16)
    wv = [(rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16) for k, n in zip(widths, widths[1:])]
    ref = xs
    for w in wv:
        ref = (ref.astype(np.float32) @ w.astype(np.float32)).astype(np.float16)
    args = [tvm.runtime.tensor(v, tvm.cuda()) for v in [xs] + wv]
    for _ in range(3):      # (calls back to back too)
        got = vm["main"](*args)
    np.testing.assert_allclose(got.numpy().astype(np.float32), ref.astype(np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_graph():
    """:func:`_graph` (PDL GEMMs between plain dlight kernels) against numpy, called back to back"""
    m, d = 4096, 768
    vm = relax.VirtualMachine(build(_graph(m, d), TARGET), tvm.cuda())
    rng = np.random.default_rng(1)
    x = rng.standard_normal((m, d)).astype(np.float16)
    gamma, beta = rng.standard_normal(d).astype(np.float16), rng.standard_normal(d).astype(np.float16)
    w1, w2 = ((rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float16) for _ in range(2))
    xf = x.astype(np.float32)
    y = ((xf - xf.mean(1, keepdims=True)) / np.sqrt(xf.var(1, keepdims=True) + 1e-5) * gamma.astype(np.float32)
         + beta.astype(np.float32)).astype(np.float16)
    z = np.maximum(y.astype(np.float32) @ w1.astype(np.float32), 0).astype(np.float16)
    ref = (z.astype(np.float32) @ w2.astype(np.float32)).astype(np.float16).astype(np.float32) + xf
    args = [tvm.runtime.tensor(v, tvm.cuda()) for v in (x, gamma, beta, w1, w2)]
    for _ in range(3):
        got = vm["main"](*args)
    np.testing.assert_allclose(got.numpy().astype(np.float32), ref, rtol=2e-2, atol=5e-2)
