"""Argument checks shared by the public API (:func:`pit_tvm.sparse_matmul`,
:func:`pit_tvm.choose_micro_tile`): each names the argument and what it expects, and none
converts silently (a float K or micro-tile side is refused, not truncated).

numpy only: :mod:`pit_tvm.tuning.choose` imports it without TVM.
"""
from __future__ import annotations

import math
import numbers
import re

import numpy as np

_TILE_TEXT = re.compile(r"\s*(\d+)\s*[xX]\s*(\d+)\s*")


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool (``True`` is an int to Python, never a size here)."""
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, (bool, np.bool_))


def positive_int(value, name: str) -> int:
    """``value`` (a Python or numpy int > 0) as an int; a TypeError for floats, bools, strings,
    a ValueError for ints <= 0."""
    if not is_int(value):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {int(value)}")
    return int(value)


def micro_tile_pair(value, name: str = "micro_tile") -> tuple[int, int]:
    """``value`` as ``(rows, cols)``: a pair of positive ints (tuple, list, numpy array) or an
    ``"RxC"`` string such as ``"32x64"``."""
    what = f"{name} must be a pair of positive ints (rows, cols) or an 'RxC' string like '32x64'"
    if isinstance(value, str):
        match = _TILE_TEXT.fullmatch(value)
        if not match:
            raise ValueError(f"{what}, got {value!r}")
        value = (int(match.group(1)), int(match.group(2)))
    try:
        items = list(value)
    except TypeError:
        raise TypeError(f"{what}, got {value!r} ({type(value).__name__})") from None
    if len(items) != 2:
        raise ValueError(f"{what}, got {len(items)} values: {value!r}")
    if not all(is_int(x) for x in items):
        raise TypeError(f"{what}, got {value!r} (element types {', '.join(type(x).__name__ for x in items)})")
    if any(x <= 0 for x in items):
        raise ValueError(f"{what}, got {tuple(int(x) for x in items)}: both sides must be positive")
    return int(items[0]), int(items[1])


def dtype_name(value, name: str = "dtype") -> str:
    """A dtype given as a string, a numpy dtype or type (``np.float16``, ``ml_dtypes.bfloat16``),
    a TVM dtype or a torch dtype, as its name (``"float16"``)."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, (bool, numbers.Number)):
        raise TypeError(f"{name} must be a dtype name such as 'float16', got {value!r}")
    module = type(value).__module__ or ""
    if module.startswith("torch"):
        return str(value).removeprefix("torch.")
    try:
        return np.dtype(value).name
    except (TypeError, ValueError):
        return str(value)       # a TVM DataType / PrimType prints as its name


def fraction(value, name: str, allow_none: bool = True):
    """``value`` as a float in [0, 1] (None passes through where allowed); strings, bools and
    NaN are refused."""
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{name} must be a number in [0, 1]{' or None' if allow_none else ''}, "
                        f"got {value!r} ({type(value).__name__})")
    value = float(value)
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1]{' or None' if allow_none else ''}, got {value!r}")
    return value
