"""Small helpers shared by the test modules (imported as ``_helpers``; pytest puts tests/ on
the path)."""
import ml_dtypes
import numpy as np


def np_dtype(dtype: str):
    """The numpy dtype of a TVM dtype name (bfloat16 through ml_dtypes)."""
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def rows_index(nonzero_rows: np.ndarray):
    """The rows-kind PIT index of a boolean row mask: ``offsets = [0, count]`` and ``ids``
    (the non-zero rows ascending, then -1), as the device index kernel lays it out."""
    rows = np.nonzero(nonzero_rows)[0].astype(np.int32)
    ids = np.full(len(nonzero_rows), -1, np.int32)
    ids[: len(rows)] = rows
    return np.array([0, len(rows)], np.int32), ids
