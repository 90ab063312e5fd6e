"""Relax passes: merge matmuls that share an input (``CombineParallelMatmuls``), find dynamic
sparsity (``AnnotateDynamicSparsity``), run the token-wise matmuls of a padded batch on its real
tokens (``PropagatePadding``) and lower it to PIT kernels (``LowerToPIT``), put the
dense matmuls on the PIT kernels' dense twin (``DenseMatmulToPITKernels``), build a strips index in
the epilogue of the kernel producing its operand (``ListStripsInProducer``), fuse attention on the
H100 (``FuseAttention``), lower attention with a run-time mask to block-sparse attention
(``SparseAttentionToPIT``); ``import_onnx`` imports
ONNX keeping tensor names. Compiler-side only."""
from importlib import import_module

_PUBLIC = {
    "AnnotateDynamicSparsity": "pit_tvm.passes.annotate",
    "annotations_of": "pit_tvm.passes.annotate",
    "LowerToPIT": "pit_tvm.passes.lower",
    "PropagatePadding": "pit_tvm.passes.propagate_padding",
    "DenseMatmulToPITKernels": "pit_tvm.passes.dense",
    "CombineParallelMatmuls": "pit_tvm.passes.combine",
    "FuseAttention": "pit_tvm.passes.attention",
    "SparseAttentionToPIT": "pit_tvm.passes.sparse_attention",
    "ListStripsInProducer": "pit_tvm.passes.strips",
    "import_onnx": "pit_tvm.passes.frontend",
    "UnsupportedOnnxError": "pit_tvm.passes.frontend",
    "ReshapeOutputsAsViews": "pit_tvm.passes.output_views",
}


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'pit_tvm.passes' has no attribute {name!r}")


__all__ = sorted(_PUBLIC)
