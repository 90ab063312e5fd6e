"""Shared pytest setup: the `gpu` marker skips without a CUDA device; tests/ and each of its
folders are on the path, so that a test file imports the helper modules beside this file
(``onnx_models``) and another folder's test module by its unique base name (tests/README.md)
however much of the suite runs."""
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))
for _folder in sorted(p for p in _TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


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
