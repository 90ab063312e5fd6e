"""Fused attention (sm_90a): the FuseAttention pass on imported ONNX graphs, the kernel's CUDA
(nvcc, ptxas: no spills), and on the H100 the kernel and a compiled encoder against references."""
from __future__ import annotations


import numpy as np
import pytest
import tvm
from tvm import relax

from pit_tvm.runtime.loader import numpy_dtype
from pit_tvm.nvcc import cuda_sources, find_nvcc, ptxas_log
from pit_tvm.passes import CombineParallelMatmuls, FuseAttention, import_onnx
from pit_tvm.schedules.attention import attention_applies, fused_attention_func
from pit_tvm.target import build

from pit_tvm import testing as W

TARGET = "cuda:sm_90a"


def _encoder_module(seq, hidden=128, heads=2, layers=2, symbolic=False):
    model = W.to_float16(W.bert_encoder(layers, hidden, heads))
    shapes = None if symbolic else {"input_embeds": [2, seq, hidden], "attention_mask": [2, seq]}
    mod = import_onnx(model, shape_dict=shapes)
    return CombineParallelMatmuls()(relax.transform.FoldConstant()(mod))


def _ops(mod):
    script = mod["main"].script()
    return script.count("fused_attention"), script.count("R.nn.softmax")


def test_pass_fuses_each_layer():
    """Head dim 64, 128 tokens: every layer's QK^T / scale / mask / softmax / PV chain is one
    call_tir; nothing of the chain is left."""
    mod = FuseAttention("cuda")(_encoder_module(128))
    calls, softmax = _ops(mod)
    assert (calls, softmax) == (2, 0)
    script = mod["main"].script()
    assert "R.matmul(transpose" not in script            # both batched matmuls are gone
    assert any("fused_attention" in gv.name_hint for gv in mod.get_global_vars())
    # Q, K, V read in place from the projection (its bias added before the slices), the
    # heads merged and the padding mask applied by the kernel: no slice, head transpose,
    # per-part bias add or multiply of the attention output is left
    assert all(gv.name_hint.endswith("_packed_merged_rowscale") for gv in mod.get_global_vars()
               if "fused_attention" in gv.name_hint)
    assert "_ctx: R.Tensor((2, 128, 128), dtype=\"float16\") = R.multiply" not in script
    assert "R.strided_slice" not in script and "R.permute_dims" not in script


def test_chain_finds_head_split_and_merge():
    """The matched chain carries the projection columns of q, k and v and the head-merging
    reshape of its result."""
    from pit_tvm.passes.attention import _attention_chains

    mod = _encoder_module(128, layers=1)
    chains = list(_attention_chains(mod["main"]).values())
    assert len(chains) == 1 and chains[0].packed is not None and chains[0].merge is not None
    assert [o for _, o in chains[0].packed] == [0, 128, 256]       # q, k, v columns of the projection
    assert chains[0].merge.op.name == "relax.multiply" and chains[0].row_scale is not None   # the padding mask


@pytest.mark.parametrize("case", ["cpu", "seq96", "head_dim16", "symbolic", "sm_80"])
def test_pass_leaves_what_the_kernel_does_not_take(case):
    """CPU targets, sequence lengths other than 128 / 256, head dims other than 32 / 64,
    symbolic shapes and archs without wgmma keep the unfused graph."""
    mod = _encoder_module(96 if case == "seq96" else 128, hidden=32 if case == "head_dim16" else 128,
                          symbolic=case == "symbolic")
    target = {"cpu": "llvm", "sm_80": "cuda:sm_80"}.get(case, "cuda")
    out = FuseAttention(target)(mod)
    assert _ops(out) == (0, 2)


def test_applies():
    assert attention_applies(32, 12, 128, 64, "float16", 32, "sm_90a")
    assert attention_applies(1, 1, 256, 64, "bfloat16", 1, "sm_90a")
    assert attention_applies(32, 12, 128, 32, "float16", 32, "sm_90a")      # MiniLM's heads
    assert not attention_applies(32, 12, 128, 16, "float16", 32, "sm_90a")
    assert not attention_applies(32, 12, 128, 64, "float16", 32, "sm_80")
    assert not attention_applies(32, 12, 64, 64, "float16", 32, "sm_90a")
    assert not attention_applies(32, 12, 128, 128, "float16", 32, "sm_90a")
    assert not attention_applies(32, 12, 128, 64, "float32", 32, "sm_90a")
    assert not attention_applies(32, 12, 128, 64, "float16", 4, "sm_90a")   # mask batch 1 or B
    with pytest.raises(ValueError, match="head_dim"):
        fused_attention_func(2, 2, 128, 16, 0.125)


def test_packed_layout_checks():
    with pytest.raises(ValueError, match="offset"):
        fused_attention_func(2, 2, 128, 64, 0.125, packed=((384, 0), (384, 128), (384, 300)))


@pytest.mark.parametrize("seq,packed,d", [(128, False, 64), (256, False, 64), (128, True, 64), (128, True, 32),
                                          (256, False, 32)])
def test_kernel_compiles_without_spills(seq, packed, d):
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    layout = ((9 * d, 0), (9 * d, 3 * d), (9 * d, 6 * d)) if packed else None
    ex = build(tvm.IRModule({"main": fused_attention_func(2, 3, seq, d, 0.125, packed=layout,
                                                          out_packed=packed, row_scale=packed)}), TARGET)
    src = cuda_sources(ex)[0]
    assert "wgmma.mma_async" in src and "__shfl_xor_sync" in src
    # masked keys (and with a row scale, zeroed queries) are zero-filled, not read
    assert "__syncthreads_or" in src and "16, %2;" in src
    log = ptxas_log(src, "sm_90a")
    assert "0 bytes spill stores" in log and "C7515" not in log, log[-2000:]


# ------------------------------------------------------------------------------------ GPU
def _reference(q, k, v, mask, scale):
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float32), k.astype(np.float32)) * scale
    s = s + mask.astype(np.float32)
    s = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bhkd->bhqd", s / s.sum(-1, keepdims=True), v.astype(np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("seq,mask_batch,dtype,d", [(128, 4, "float16", 64), (256, 1, "float16", 64),
                                                    (128, 4, "bfloat16", 64), (128, 4, "float16", 32),
                                                    (256, 1, "bfloat16", 32)])
def test_gpu_kernel_matches_numpy(seq, mask_batch, dtype, d):
    """Random Q, K, V; an additive padding mask per sequence (lengths 1 .. seq, -10000 past,
    which the kernel does not read; -30 on some real keys, which it does) and one sequence
    with every key masked (the softmax spreads over all keys: the kernel reads them all)."""
    b, h, scale = 4, 2, 0.125
    rng = np.random.default_rng(seq + mask_batch)
    npd = numpy_dtype(dtype)
    q, k, v = (rng.standard_normal((b, h, seq, d)).astype(np.float32).astype(npd) for _ in range(3))
    lengths = [1, seq // 3, seq, 0][:mask_batch]
    mask = np.stack([np.where(np.arange(seq) < n, 0.0, -10000.0) for n in lengths]).astype(np.float16)
    mask[:, 2:seq // 4:5] = np.minimum(mask[:, 2:seq // 4:5], -30.0)
    mask = mask.reshape(mask_batch, 1, 1, seq)
    f = build(tvm.IRModule({"main": fused_attention_func(b, h, seq, d, scale, dtype, "float16", mask_batch)}),
              TARGET)["main"]
    dev = tvm.cuda(0)
    out = tvm.runtime.tensor(np.full((b, h, seq, d), 7, np.float32).astype(npd), dev)
    f(*(tvm.runtime.tensor(x, dev) for x in (q, k, v, mask)), out)
    ref = _reference(q, k, v, mask, scale)
    tol = 1e-2 if dtype == "float16" else 3e-2
    np.testing.assert_allclose(out.numpy().astype(np.float32), ref, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("separate,d", [(False, 64), (True, 64), (False, 32), (True, 32)])
def test_gpu_packed_kernel_matches_numpy(separate, d):
    """Q, K, V read in place from ``[B, S, W]`` projections (one tensor, or three with other
    widths and offsets), the output written with the heads merged, ``[B, S, H * D]``, times a
    row scale (a padding mask) for the three separate tensors."""
    b, h, seq, scale = 2, 3, 128, 0.125
    rng = np.random.default_rng(7)
    widths = (h * d + 64, h * d + 128, h * d + 8) if separate else (3 * h * d,) * 3
    offsets = (64, 0, 8) if separate else (0, h * d, 2 * h * d)
    xs = [rng.standard_normal((b, seq, w)).astype(np.float16) for w in (widths if separate else widths[:1])]
    srcs = xs if separate else xs * 3
    q, k, v = (x[:, :, o:o + h * d].reshape(b, seq, h, d).transpose(0, 2, 1, 3) for x, o in zip(srcs, offsets))
    mask = np.stack([np.where(np.arange(seq) < n, 0.0, -10000.0) for n in (9, seq)]).astype(np.float16)
    mask = mask.reshape(b, 1, 1, seq)
    f = build(tvm.IRModule({"main": fused_attention_func(b, h, seq, d, scale, packed=tuple(zip(widths, offsets)),
                                                         out_packed=True, row_scale=separate)}), TARGET)["main"]
    dev = tvm.cuda(0)
    out = tvm.runtime.tensor(np.full((b, seq, h * d), 7, np.float16), dev)
    rows = rng.choice([0.0, 1.0, 0.5], (b, seq, 1)).astype(np.float16)
    f(*(tvm.runtime.tensor(x, dev) for x in srcs + [mask] + ([rows] if separate else [])), out)
    ref = _reference(q, k, v, mask, scale).transpose(0, 2, 1, 3).reshape(b, seq, h * d)
    if separate:
        ref = ref * rows.astype(np.float32)
    np.testing.assert_allclose(out.numpy().astype(np.float32), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_gpu_encoder_with_fused_attention_matches_onnxruntime(cuda_graph):
    """A 2-layer encoder with head dim 64 over 128 tokens compiled for the H100 (the attention
    fused, PIT on the linear layers; optionally captured in CUDA graphs, run twice with other
    lengths in between) against onnxruntime on the fp32 model, over real tokens."""
    ort = pytest.importorskip("onnxruntime")
    from pit_tvm.compile import compile_onnx

    model = W.bert_encoder(2, 128, 2)
    inputs = W.bert_inputs(128, batch=3, seq=128, lengths=[5, 77, 128])
    cm = compile_onnx(W.to_float16(model), "cuda", shapes={n: list(x.shape) for n, x in inputs.items()},
                      cuda_graph=cuda_graph)
    assert "fused_attention" in cm.lowered["main"].script()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for lengths in ([5, 77, 128], [128, 1, 40], [5, 77, 128]):
        inputs = W.bert_inputs(128, batch=3, seq=128, lengths=lengths)
        got = cm.run({"input_embeds": inputs["input_embeds"].astype(np.float16),
                      "attention_mask": inputs["attention_mask"]})[0]
        ref = sess.run(None, inputs)[0]
        real = inputs["attention_mask"].astype(bool)
        np.testing.assert_allclose(np.asarray(got, np.float32)[real], ref[real], rtol=3e-2, atol=3e-2)


def test_cuda_graph_build_captures_the_model():
    """``cuda_graph=True`` builds (no GPU needed) a VM program that runs its static regions as
    captured CUDA graphs, the PIT index and kernels included; without it, none."""
    from pit_tvm.compile import compile_onnx

    model = W.to_float16(W.bert_encoder(1, 128, 2))
    shapes = {"input_embeds": [2, 128, 128], "attention_mask": [2, 128]}
    for graph in (True, False):
        text = compile_onnx(model, "cuda", shapes=shapes, cuda_graph=graph).executable.as_text()
        assert ("vm.builtin.cuda_graph.run_or_capture" in text) == graph
