"""What a TIR statement reads and writes, for the TIR passes that decide by buffer dtype."""
from __future__ import annotations

import tvm_ffi
from tvm import ir, tirx


def touches_dtype(stmt, dtype: str) -> bool:
    """whether ``stmt`` loads or stores a buffer of ``dtype``"""
    found = []

    def note(node):
        buffer = node.source if isinstance(node, ir.TensorLoad) else node.buffer
        if str(buffer.dtype) == dtype:
            found.append(node)
        return node

    tvm_ffi.structural_map(stmt, [(ir.TensorLoad, note), (tirx.BufferStore, note)])
    return bool(found)
