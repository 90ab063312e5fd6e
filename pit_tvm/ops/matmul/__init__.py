"""PIT matmul: ``C = A @ B`` with A dynamically sparse, built from rules, index and SRead/SWrite.

The workload is an ordinary TensorIR matmul (fp32 accumulate into ``acc``, then a ``cast``
epilogue into C). PIT is applied to it by the primitives in :mod:`pit_tvm.schedules`:

* **rows** (micro-tile ``(mr, K)``: whole rows, ``mr`` rows each): the spatial axis ``i`` is
  permuted: SRead gathers the non-zero rows of A, SWrite scatters the result rows of C
  (zero rows of A give zero rows of C, filled first).
* **tiles** (micro-tile ``(mr, mk)`` with ``mk < K``: ``32x1`` along K, ``32x64`` blocks, ``1x64``):
  the reduction axis ``k`` is permuted per strip of ``mr`` rows: SRead gathers the non-zero
  micro-tiles of the strip from A and the matching rows of B; no scatter is needed.

The index is built on the device every call (:mod:`pit_tvm.index`); its count never leaves
the device: grids and loops are worst-case sized and the iterations past the count exit at
once (:func:`pit_tvm.schedules.sparse_access.lower_pit`).

The modules, by role:

* :mod:`.plan` -- the workload, :class:`MatmulPlan` (index layout of a micro-tile), row hints;
* :mod:`.backends` -- which kernel runs on which target: one ordered backend list (wgmma on
  sm_90a, mma.sync on sm_80 / sm_86 / sm_90, SIMT elsewhere on CUDA, the CPU schedule);
* :mod:`.derived` -- the kernels SRead / SWrite derive on the workload (CPU, CUDA SIMT);
* :mod:`.epilogue` -- :class:`Epilogue` (bias, activation, row scale, residual);
* :mod:`.emit` -- the Relax emission (:func:`emit_pit_matmul`, :func:`emit_dense_matmul`);
* :mod:`.op` -- the user-facing op (:func:`sparse_matmul`, :class:`SparseMatmul`, :class:`DenseMatmul`).
"""
from .backends import (BACKENDS, TENSOR_CORE_BACKENDS, Backend, KernelRequest, MatmulKernels,
                       _cuda_dense_kernel, _cuda_rows_kernel, _cuda_tiles_kernel, _cuda_wgmma_tiles,
                       choose_kernels, pit_matmul_func, tensor_core_kernel)
from .derived import dense_matmul_func, simt_matmul_func
from .emit import (CPU_DENSE_DTYPES, OPAQUE_OP_PATTERN, add_once, emit_dense_matmul, emit_pit_matmul,
                   strips_listing_producer)
from .epilogue import ACTIVATIONS, Epilogue, emit_epilogue, is_row_scale, same_dims
from .op import DenseMatmul, SparseMatmul, op_target, sparse_matmul
from .plan import (PIT_EXPECTED_DENSITY, SUPPORTED_DTYPES, TC_MIN_STRIP, MatmulPlan,
                   effective_density_threshold, matmul_workload, planned_density, tensor_core_plan)

__all__ = [
    "ACTIVATIONS", "BACKENDS", "add_once", "CPU_DENSE_DTYPES", "OPAQUE_OP_PATTERN", "PIT_EXPECTED_DENSITY",
    "SUPPORTED_DTYPES", "TC_MIN_STRIP", "TENSOR_CORE_BACKENDS", "Backend", "DenseMatmul", "Epilogue",
    "KernelRequest", "MatmulKernels", "MatmulPlan", "SparseMatmul", "choose_kernels", "dense_matmul_func",
    "effective_density_threshold", "emit_dense_matmul", "emit_epilogue", "emit_pit_matmul", "is_row_scale",
    "matmul_workload", "op_target", "pit_matmul_func", "planned_density", "same_dims", "simt_matmul_func", "sparse_matmul",
    "strips_listing_producer", "tensor_core_kernel", "tensor_core_plan",
]
