"""pit-tvm: PIT (permutation-invariant transformation) for dynamic sparsity on Apache TVM.

Pipeline, one way: ONNX -> Relax passes (``pit_tvm.passes``) -> PIT ops (``pit_tvm.ops``)
-> schedules (``pit_tvm.schedules``) -> build (``pit_tvm.target``) -> runtime (``pit_tvm.runtime``).
The public names below are imported lazily so that ``import pit_tvm`` stays cheap.
"""
from importlib import import_module

from pit_tvm.threads import use_physical_cores

__version__ = "0.1.0"

use_physical_cores()     # before TVM's CPU thread pool starts (pit_tvm/threads.py says why)

_PUBLIC = {
    "find_pit_rules": "pit_tvm.rules",
    "PitRule": "pit_tvm.rules",
    "sparse_matmul": "pit_tvm.ops.matmul",
    "SparseMatmul": "pit_tvm.ops.matmul",
    "moe_ffn": "pit_tvm.ops.moe",
    "MoEFFN": "pit_tvm.ops.moe",
    "MoESpec": "pit_tvm.ops.moe",
    "sparse_attention": "pit_tvm.ops.sparse_attention",
    "SparseAttention": "pit_tvm.ops.sparse_attention",
    "AttentionPattern": "pit_tvm.ops.sparse_attention",
    "build_tile_index": "pit_tvm.index",
    "choose_micro_tile": "pit_tvm.tuning.choose",
    "compile_onnx": "pit_tvm.compile",
    "CompiledModel": "pit_tvm.compile",
    "UnsupportedOnnxError": "pit_tvm.passes.frontend",
}


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'pit_tvm' has no attribute {name!r}")


__all__ = sorted(_PUBLIC)
