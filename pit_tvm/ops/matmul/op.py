"""The user-facing op: :func:`sparse_matmul` compiles a :class:`SparseMatmul` (one Relax graph
of :func:`~.emit.emit_pit_matmul`, the index built on the device every call); :class:`DenseMatmul`
is the dense kernel with the PIT schedule's structure, the fair baseline.
"""
from __future__ import annotations

import os

import numpy as np
import tvm
from tvm import tirx

from pit_tvm._args import dtype_name, fraction, positive_int
from pit_tvm.runtime.loader import (DLPACK_CPU, check_device, check_dtype, host_view, is_dlpack_tensor,
                                    numpy_dtype, op_dlpack_tensor)
from pit_tvm.target import arch_number, build, cuda_arch, device_for, make_target

from .derived import dense_matmul_func
from .emit import emit_pit_matmul
from .plan import SUPPORTED_DTYPES, MatmulPlan, validate


def _build_sparse_matmul(k, n, dtype, out_dtype, micro_tile, target, density_threshold,
                         tuning_log):
    """The executable of :class:`SparseMatmul`: a Relax ``main(a[M, k], b[k, n]) -> c`` made by
    :func:`emit_pit_matmul` (the graph the compiler emits for a model), plus the names of
    its index and kernel PrimFuncs."""
    from tvm import relax

    from pit_tvm.index import index_state

    bb = relax.BlockBuilder()
    m = tirx.Var("m", "int64")
    a = relax.Var("a", relax.TensorType([m, k], dtype))
    b = relax.Var("b", relax.TensorType([k, n], dtype))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            c = emit_pit_matmul(bb, a, b, micro_tile=micro_tile, target=target,
                                out_dtype=out_dtype, density_threshold=density_threshold,
                                tuning_log=tuning_log, tensor_core_only=False)
            out = bb.emit_output(c)
        bb.emit_func_output(out)
    mod = bb.get()
    names = {}
    for gv, func in mod.functions.items():
        for key, prefix in (("index", "pit_index_"), ("kernel", "pit_kernel_"), ("strips", "pit_strips_")):
            if gv.name_hint.startswith(prefix):
                names[key] = gv.name_hint
        if gv.name_hint.startswith("pit_kernel_"):
            names["micro_tile"] = tuple(int(x) for x in func.attrs["pit.micro_tile"])
        if gv.name_hint.startswith("pit_index_"):
            names["index_state"] = index_state(func)
    return build(mod, target), names


def op_target(target) -> tvm.target.Target:
    """``target`` of :class:`SparseMatmul` as a Target: ``"llvm"``/``"cpu"``, ``"cuda"`` or
    ``"cuda:sm_XY"``, a dict or a Target, of kind llvm or cuda (with an ``sm_XY`` arch)."""
    try:
        tgt = make_target(target)
    except TypeError:
        raise
    except Exception as err:  # noqa: BLE001 - TVM's own error for a dict target or a CUDA arch
        if isinstance(target, str) and not target.startswith("cuda:"):
            raise                       # make_target's own "unknown target"
        raise ValueError(f"target {target!r} is not a valid TVM target: {err}") from None
    kind = tgt.kind.name
    if kind not in ("llvm", "cuda"):
        raise ValueError(f"target {target!r}: PIT matmul builds for 'llvm' or 'cuda' targets, not {kind!r}")
    if kind == "cuda" and arch_number(cuda_arch(tgt)) < 0:
        raise ValueError(f"target {target!r}: unknown CUDA arch {cuda_arch(tgt)!r}; "
                         "use e.g. 'cuda:sm_80' or 'cuda:sm_90a'")
    return tgt


class SparseMatmul:
    """``C = A @ B`` with A dynamically sparse; compiled once, the index built every call.

    Use :func:`sparse_matmul` to create one. ``op(a, b)`` takes numpy arrays and DLPack
    tensors (torch, TVM, jax, ...) of any layout and returns C of the same kind as ``a`` (one
    call of the Relax graph :func:`emit_pit_matmul` emits, C from the VM's pooled allocator);
    a DLPack tensor is used in place when C-contiguous and 64-byte aligned, else copied
    (numpy arrays always are).  ``op(a, b, out=c)`` copies that C into ``c`` (any layout);
    ``op.index(a)`` returns the device index ``(offsets, ids)`` for inspection
    (:func:`pit_tvm.index.tiles_from_index` decodes it) for ``op.kernel_plan``'s micro-tile.
    """

    def __init__(self, k, n, dtype="float16", micro_tile=(1, 64), target="llvm", out_dtype=None,
                 density_threshold=0.9, tuning_log=None):
        self.k, self.n = positive_int(k, "K"), positive_int(n, "N")
        self.dtype = dtype_name(dtype, "dtype")
        micro_tile = validate(self.k, self.n, self.dtype, micro_tile)
        self.out_dtype = self.dtype if out_dtype is None else dtype_name(out_dtype, "out_dtype")
        if self.out_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"unsupported out_dtype {self.out_dtype!r}: use one of {', '.join(SUPPORTED_DTYPES)}")
        density_threshold = fraction(density_threshold, "density_threshold")
        if tuning_log is not None and not isinstance(tuning_log, (str, os.PathLike)):
            raise TypeError(f"tuning_log must be a path (str or os.PathLike) or None, got {type(tuning_log).__name__}")
        self.plan = MatmulPlan(self.k, self.n, micro_tile)
        self.micro_tile = self.plan.micro_tile
        self.target = op_target(target)
        self.device = device_for(self.target)
        self.density_threshold = density_threshold
        self.executable, names = _build_sparse_matmul(
            self.k, self.n, self.dtype, self.out_dtype, self.micro_tile, self.target,
            density_threshold, tuning_log)
        # op(a, b): one call of the Relax function (index + kernels), whose index and C come
        # from the VM's pooled allocator: no cudaMalloc, and no cudaFree (which synchronises
        # the device) per call.  op(a, b, out=C) copies that C into out; op.index(a) calls
        # the index PrimFunc directly.
        self._main = None      # the VM needs the device: made on the first call
        # the index and kernel work on this plan's micro-tile: the requested one, or on CUDA
        # the tensor-core cover of a thinner one (tensor_core_plan)
        self.kernel_plan = MatmulPlan(self.k, self.n, names["micro_tile"])
        self._index = self.executable[names["index"]]
        self._workspace = {}   # row count -> (offsets, ids) for index()
        self._index_state_shape = names.get("index_state")   # a one-group CUDA index's counter
        self._index_state = None
        # the wgmma tiles kernel's index in one pass (pit_tvm.schedules.wgmma_strips): the
        # strips kernel (with the A compaction for thin micro-tiles), then the CSR pack
        self._strips = self.executable[names["strips"]] if "strips" in names else None

    # -- tensors in and out ---------------------------------------------------------
    def _as_tensor(self, x, name, shape_check):
        """``x`` as a TVM tensor on the op's device, checked (dtype, device, shape) before any
        copy to the device.  A numpy array (any layout) is copied; a DLPack tensor (TVM, torch,
        jax, cupy) is taken zero-copy where TVM can (C-contiguous, 64-byte aligned), else copied
        (:func:`pit_tvm.runtime.loader.op_dlpack_tensor`); anything else (a list) is read by
        numpy as the op's dtype."""
        if is_dlpack_tensor(x):     # TVM, torch, ...
            t = op_dlpack_tensor(x, name, self.dtype, self.device)
            shape_check(tuple(int(s) for s in t.shape))
            return t
        arr = self._as_array(x, name)
        check_dtype(arr.dtype, name, self.dtype)
        shape_check(arr.shape)
        return tvm.runtime.tensor(np.ascontiguousarray(arr), self.device)

    def _as_array(self, x, name):
        if x is None:
            raise TypeError(f"{name} must be a numpy array, a DLPack tensor (torch, TVM, ...) or a nested "
                            "sequence of numbers, got None")
        if isinstance(x, np.ndarray) or hasattr(x, "dtype"):
            return np.asarray(x)
        try:            # (a list, a scalar: no dtype of its own)
            return np.asarray(x, dtype=numpy_dtype(self.dtype))
        except (TypeError, ValueError) as err:
            raise TypeError(f"{name} must be a numpy array, a DLPack tensor (torch, TVM, ...) or a nested "
                            f"sequence of numbers, got {type(x).__name__} ({err})") from None

    def _as_out(self, out, m):
        """Where ``out`` is written, checked against C (``(m, N)``, ``out_dtype``) before the op
        runs: a TVM tensor over contiguous memory (``copyfrom``: TVM copies into memory of any
        alignment), a numpy array (assigned: any layout), or a strided torch tensor on a GPU
        (``copy_``).  C itself comes from the VM's allocator: ``out=`` costs one copy."""
        if isinstance(out, np.ndarray):
            check_dtype(out.dtype, "out", self.out_dtype)
            self._check_out_shape(out.shape, m)
            if not out.flags.writeable:
                raise ValueError("out is a read-only numpy array")
            return out
        if not hasattr(out, "__dlpack__"):
            raise TypeError(f"out must be a numpy array, a TVM tensor or a DLPack tensor, got {type(out).__name__}")
        import tvm_ffi

        try:    # a view of out's memory as it is (any strides, any alignment): it is written, not read
            view = out if isinstance(out, tvm.runtime.Tensor) else tvm_ffi.from_dlpack(out)
        except Exception as err:  # noqa: BLE001 - the producer's own refusal (read-only, needs grad)
            raise TypeError(f"out: TVM cannot take this {type(out).__name__} through DLPack: {err}") from err
        check_dtype(view.dtype, "out", self.out_dtype)
        self._check_out_shape(tuple(int(s) for s in view.shape), m)
        check_device(view, "out", self.device)
        if view.is_contiguous():
            return view
        if view.device.dlpack_device_type() == DLPACK_CPU:
            return host_view(view)
        if callable(getattr(out, "copy_", None)) and type(out).__module__.startswith("torch"):
            return out
        raise ValueError(f"out is a non-contiguous tensor on {view.device} (strides {tuple(view.strides)}): "
                         "TVM writes only contiguous device memory; pass a contiguous one")

    def _check_out_shape(self, shape, m):
        if tuple(shape) != (m, self.n):
            raise ValueError(f"out must have shape ({m}, {self.n}) (A's rows, N), got {tuple(shape)}")

    @staticmethod
    def _write_out(dest, c):
        if isinstance(dest, tvm.runtime.Tensor):
            dest.copyfrom(c)
        elif isinstance(dest, np.ndarray):
            dest[...] = c.numpy()
        else:   # a strided torch tensor on a GPU
            import torch

            dest.copy_(torch.from_dlpack(c))

    def _check_a(self, shape):
        if len(shape) != 2 or shape[1] != self.k:
            raise ValueError(f"A must have shape (M, {self.k}) (2-D, K={self.k} columns), got {tuple(shape)}")

    def _check_b(self, shape):
        if tuple(shape) != (self.k, self.n):
            raise ValueError(f"B must have shape ({self.k}, {self.n}) (K, N), got {tuple(shape)}")

    WORKSPACE_SLOTS = 8

    def _index_buffers(self, m):
        """The index buffers for ``m`` rows, allocated once per row count and reused: a device
        allocation (and its free, which synchronises) per call would sit on the hot path."""
        if m in self._workspace:
            return self._workspace[m]
        groups, capacity = self.kernel_plan.index_sizes(m)
        buffers = (tvm.runtime.empty((groups + 1,), "int32", self.device),
                   tvm.runtime.empty((capacity,), "int32", self.device))
        if len(self._workspace) >= self.WORKSPACE_SLOTS:
            self._workspace.pop(next(iter(self._workspace)))
        self._workspace[m] = buffers
        return buffers

    def _strips_buffers(self, m):
        """``(state, counts, strip ids[, compacted A])`` of the one-pass index for ``m`` rows,
        allocated once per row count (the state zeroed once: the kernel leaves it zero)"""
        from pit_tvm.schedules.wgmma_strips import compacts, strip_state_words

        key = ("strips", m)
        if key not in self._workspace:
            groups = strip_state_words(m)
            capacity = self.kernel_plan.index_sizes(m)[1]
            self._workspace[key] = (
                (tvm.runtime.tensor(np.zeros(groups), self.device), tvm.runtime.empty((groups,), "int32", self.device),
                 tvm.runtime.empty((capacity,), "int32", self.device))
                + ((tvm.runtime.empty((m, self.k), self.dtype, self.device),)
                   if compacts(self.kernel_plan.micro_tile[1]) else ()))
        return self._workspace[key]

    def index(self, a):
        """Build the index of ``a`` on the device: ``(offsets, ids)``, CSR by group.

        The buffers are the op's workspace for this row count: the next call overwrites them.
        """
        a_t = self._as_tensor(a, "A", self._check_a)
        offsets, ids = self._index_buffers(int(a_t.shape[0]))
        if self._strips is not None:
            state, counts, strip_ids, *ac = self._strips_buffers(int(a_t.shape[0]))
            self._strips(a_t, state, counts, strip_ids, *ac)
            self._index(counts, strip_ids, offsets, ids)
        elif self._index_state_shape is None:
            self._index(a_t, offsets, ids)
        else:
            if self._index_state is None:   # zeroed once: the index leaves its counter zero
                self._index_state = tvm.runtime.tensor(np.zeros(*self._index_state_shape), self.device)
            self._index(a_t, self._index_state, offsets, ids)
        return offsets, ids

    def __call__(self, a, b, out=None):
        """``C = a @ b``: C of ``a``'s kind (a TVM tensor for a TVM tensor, torch for torch,
        else numpy), or written into ``out`` (any layout, see :meth:`_as_out`) and ``out``
        returned."""
        a_t = self._as_tensor(a, "A", self._check_a)
        b_t = self._as_tensor(b, "B", self._check_b)
        m = int(a_t.shape[0])
        dest = None if out is None else self._as_out(out, m)
        if self._main is None:
            from tvm import relax

            self._main = relax.VirtualMachine(self.executable, self.device)["main"]
        # one path for every call: the graph may run more kernels than index + matmul (the
        # A compaction of micro-tiles under 16 bytes wide, before the wgmma tiles kernel)
        c = self._main(a_t, b_t)
        if dest is not None:
            self._write_out(dest, c)
            return out
        if isinstance(a, tvm.runtime.Tensor):
            return c
        if type(a).__module__.startswith("torch"):
            import torch

            return torch.from_dlpack(c)
        return c.numpy()


def sparse_matmul(k, n, dtype="float16", micro_tile=(1, 64), target="llvm", out_dtype=None,
                  density_threshold=0.9, tuning_log=None) -> SparseMatmul:
    """Compile the PIT matmul ``C[M, n] = A[M, k] @ B[k, n]`` (M varies per call).

    ``micro_tile=(mr, mk)``: ``(1, k)`` whole rows (SRead+SWrite along M), ``(32, 1)`` along K,
    ``(32, 64)`` blocks (SRead along K per strip). ``density_threshold``: above this fraction of
    non-zero micro-tiles the kernel runs densely (decided on the device); None disables.
    On CUDA, fp16/bf16 use the tensor-core kernels where a tile config fits K, N
    (:mod:`pit_tvm.schedules.tensorcore` for rows, with a split-K path for few rows;
    :mod:`pit_tvm.schedules.tensorcore_tiles` for tiles, thin ones as their 16-row cover);
    ``tuning_log`` picks the tuned config of the tensor-core kernel (``pit-tvm tune``).

    K and N are ints (numpy ints too), ``dtype``/``out_dtype`` names or numpy / torch dtypes
    of ``float32``, ``float16``, ``bfloat16``, ``micro_tile`` a pair of ints or ``"RxC"``;
    ``target`` ``"llvm"``, ``"cuda"``, ``"cuda:sm_XY"`` or a dict / Target of those kinds.
    Anything else is a TypeError or ValueError naming the argument, before any build.

    Any K, N build: where no tensor-core tile fits, the SIMT kernel runs fp16/bf16 (a warning
    says so).  A micro-tile the index skips (all zero) contributes exactly 0 to C whatever B
    holds (NaN / Inf in B's rows there do not reach C, as they would in numpy's ``a @ b``), on
    both sides of ``density_threshold``, except for the wgmma tiles kernels (``cuda``, micro-tiles
    along K), whose dense fallback above it multiplies every micro-tile (docs/guide/semantics.md).
    """
    return SparseMatmul(k, n, dtype, micro_tile, target, out_dtype, density_threshold, tuning_log)


class DenseMatmul:
    """The dense kernel with the PIT schedule's structure: the fair baseline."""

    def __init__(self, k, n, dtype="float16", target="llvm", out_dtype=None):
        self.k, self.n, self.dtype = int(k), int(n), str(dtype)
        self.out_dtype = str(out_dtype or dtype)
        self.target = make_target(target)
        self.device = device_for(self.target)
        func = dense_matmul_func(self.k, self.n, self.dtype, self.out_dtype, self.target)
        self.executable = build(tvm.IRModule({"dense_matmul": func.with_attr("global_symbol", "dense_matmul")}),
                                self.target)
        self._kernel = self.executable["dense_matmul"]

    def __call__(self, a, b, out=None):
        a_t = a if isinstance(a, tvm.runtime.Tensor) else tvm.runtime.tensor(np.asarray(a), self.device)
        b_t = b if isinstance(b, tvm.runtime.Tensor) else tvm.runtime.tensor(np.asarray(b), self.device)
        c = out if out is not None else tvm.runtime.empty((int(a_t.shape[0]), self.n), self.out_dtype, self.device)
        self._kernel(a_t, b_t, c)
        return c if (out is not None or isinstance(a, tvm.runtime.Tensor)) else c.numpy()

