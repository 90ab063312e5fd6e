"""Shared pytest setup: the `gpu` marker skips without a CUDA device."""
import pytest


def _cuda_available() -> bool:
    try:
        import tvm

        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001 - no driver, no runtime: no GPU
        return False


HAS_CUDA = _cuda_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
