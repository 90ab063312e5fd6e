"""Deployment runtime: ``load(path, device)`` runs an exported model with the TVM runtime only.

Keep this package importable under ``TVM_USE_RUNTIME_LIB=1``: no compiler-side imports here.
"""


def load(path, device: str = "cpu"):
    """Load a model exported by ``pit_tvm.compile.CompiledModel.export``; see ``loader.Model``."""
    from .loader import load as _load  # noqa: PLC0415

    return _load(path, device)


__all__ = ["load"]
