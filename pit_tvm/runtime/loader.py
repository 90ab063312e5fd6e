"""Run an exported model with only the TVM runtime (works under ``TVM_USE_RUNTIME_LIB=1``).

Imports ``tvm`` (runtime), ``tvm_ffi`` and numpy only: no ``tvm.relax``, no compiler library,
no compiler-side ``pit_tvm`` module. CUDA in runtime-only mode needs two fixes (tvm027.md §1):
``libtvm_runtime_cuda.so`` is loaded by hand, and a library built on a GPU-less box carries CUDA
*source*, which is JIT-compiled through a ``tvm_callback_cuda_compile`` that runs nvcc
(arch: ``$PIT_CUDA_ARCH`` or the device's compute capability).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import tvm

from ..errors import UserError
from .library import (EXPORT_HINT, LIBRARY_SUFFIX, META_SUFFIX, check_elf_library, check_library_digest,
                      read_metadata)


def _ensure_cuda_runtime() -> None:
    from tvm.base import _LOADED_LIBS  # noqa: PLC0415

    if "tvm_runtime_cuda" not in _LOADED_LIBS and tvm.base._RUNTIME_ONLY:
        from tvm_ffi.libinfo import load_lib_ctypes  # noqa: PLC0415

        libdir = Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent
        try:
            _LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(
                "tvm", "tvm_runtime_cuda", "RTLD_LOCAL", extra_lib_paths=[libdir]
            )
        except OSError as err:
            raise RuntimeError(
                f"cannot load TVM's CUDA runtime ({err}); is a CUDA driver installed? "
                "Use device='cpu' with a library built for llvm."
            ) from err
    if tvm.base._RUNTIME_ONLY:
        _register_nvcc_callback()


def _cuda_arch() -> str:
    arch = os.environ.get("PIT_CUDA_ARCH")
    if arch:
        return arch
    try:
        ver = tvm.cuda(0).compute_version  # "9.0"
    except Exception:  # noqa: BLE001 - no device: the usual deployment target
        return "sm_90a"
    arch = "sm_" + ver.replace(".", "")
    # every sm_90 device has the arch-specific features the wgmma kernels use
    return "sm_90a" if arch == "sm_90" else arch


_CALLBACK_DONE = False


def _register_nvcc_callback() -> None:
    """A self-contained ``tvm_callback_cuda_compile`` (the stock one needs the compiler)."""
    global _CALLBACK_DONE
    if _CALLBACK_DONE:
        return
    import tvm_ffi  # noqa: PLC0415

    def _compile(code, *_):
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        arch = _cuda_arch()
        with tempfile.TemporaryDirectory() as d:
            src, out = os.path.join(d, "k.cu"), os.path.join(d, "k.fatbin")
            with open(src, "w") as f:
                f.write(code)
            proc = subprocess.run([nvcc, "--fatbin", "-O3", f"-arch={arch}", "--use_fast_math",
                                   "--expt-relaxed-constexpr", "-o", out, src],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"nvcc failed for {arch}:\n{proc.stderr[-4000:]}")
            with open(out, "rb") as f:
                return bytearray(f.read())

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", _compile, override=True)
    _CALLBACK_DONE = True


def check_input_shapes(inputs_meta, args) -> None:
    """Raise ``ValueError`` naming the input when an argument's shape contradicts a static
    dimension recorded in ``inputs_meta`` (``[{"name", "shape"}]``; symbolic dims are strings)."""
    for meta, arg in zip(inputs_meta, args):
        want = meta.get("shape")
        if not want:
            continue
        got = tuple(int(d) for d in arg.shape)
        if len(got) != len(want) or any(isinstance(w, int) and w != g for w, g in zip(want, got)):
            raise ValueError(f"input {meta['name']!r} has shape {list(got)}, the model was compiled for "
                             f"{list(want)}")


def host_input(name: str, value, dtype) -> np.ndarray:
    """``value`` as a contiguous numpy array of the input's ``dtype`` (None: as it is).  A cast
    within a kind (float64 -> float32, int32 -> int64, bool -> int64) is made; one across kinds
    (floats to an integer input such as token ids, which would truncate; integers or bools to a
    float input, most likely the wrong array) is a ``TypeError`` naming the input, as in
    onnxruntime.  A 0-d value stays 0-d (``np.ascontiguousarray`` would make it 1-d, which a
    scalar input rejects)."""
    arr = np.asarray(value)
    if dtype is not None and arr.dtype != np.dtype(dtype):
        int_to_float = arr.dtype.kind in "biu" and np.dtype(dtype).kind == "f"
        if int_to_float or not np.can_cast(arr.dtype, np.dtype(dtype), casting="same_kind"):
            raise TypeError(f"input {name!r} has dtype {arr.dtype}, the model takes {dtype} (cast it "
                            "first if that is meant)")
        arr = arr.astype(dtype)
    return np.require(arr, requirements="C")


#: DLPack's device type of host memory (kDLCPU)
DLPACK_CPU = 1
#: the data alignment TVM's compiled kernels assume of their tensors (bytes; LLVM emits
#: aligned vector loads: a misaligned tensor can crash the process, not just raise)
TVM_ALIGNMENT = 64


def tvm_takes_as_is(t: tvm.runtime.Tensor) -> bool:
    """``t`` can be passed to a compiled TVM function: C-contiguous, data 64-byte aligned, not
    empty (an empty tensor counts as contiguous whatever its strides, but a compiled function
    checks them: numpy gives an empty Fortran array the strides ``(4, 0)``)."""
    return t.is_contiguous() and t.data_ptr() % TVM_ALIGNMENT == 0 and all(int(s) for s in t.shape)


def dlpack_to_tvm(value, name: str = "tensor") -> tvm.runtime.Tensor:
    """``value`` (any DLPack tensor: torch, jax, cupy, TVM, numpy) as a TVM tensor on its own
    device: zero-copy where TVM takes it as it is (C-contiguous, data 64-byte aligned: what
    ``tvm.runtime.from_dlpack`` checks and the compiled kernels assume), else a contiguous,
    aligned copy on the same device: a misaligned contiguous tensor (a row slice, many
    ``torch.from_numpy`` arrays) is copied by TVM, a strided one (``t.T``, ``t[::2]``,
    ``expand``) on the host through numpy, on a GPU by its own ``.contiguous()`` (torch).
    A strided GPU tensor without one is a ValueError naming ``name``."""
    if isinstance(value, tvm.runtime.Tensor) and tvm_takes_as_is(value):
        return value
    try:
        view = tvm.runtime.from_dlpack(value)   # zero-copy
        if tvm_takes_as_is(view):
            return view
    except Exception:  # noqa: BLE001 - not contiguous or not aligned (or not importable): see below
        import tvm_ffi  # noqa: PLC0415

        try:
            view = tvm_ffi.from_dlpack(value)   # no checks: a view of value's memory
        except Exception as err:  # noqa: BLE001 - the producer's own refusal (read-only, needs grad, dtype)
            raise TypeError(f"{name}: TVM cannot take this {type(value).__name__} through DLPack: {err}") from err
    shape = tuple(int(s) for s in view.shape)
    if 0 in shape:                              # nothing to copy, compact strides wanted
        return tvm.runtime.empty(shape, str(view.dtype), view.device)
    if view.is_contiguous():
        return view.copyto(view.device)         # misaligned: TVM allocates aligned memory
    if view.device.dlpack_device_type() == DLPACK_CPU:
        return tvm.runtime.tensor(np.ascontiguousarray(host_view(view)), view.device)
    if callable(getattr(value, "contiguous", None)):
        return dlpack_to_tvm(value.contiguous(), name)
    raise ValueError(f"{name} is a non-contiguous tensor on {view.device} (shape {tuple(view.shape)}, "
                     f"strides {tuple(view.strides)}): TVM copies only contiguous device memory; "
                     "pass a contiguous copy")


def is_dlpack_tensor(value) -> bool:
    """Whether an op takes ``value`` through DLPack (TVM, torch, jax, cupy, ...): a numpy array,
    though a DLPack producer too, is read as an array (any layout, copied to the device)."""
    return hasattr(value, "__dlpack__") and not isinstance(value, np.ndarray)


def check_dtype(dtype, name: str, want: str, error=ValueError) -> None:
    """``error`` naming ``name`` unless ``dtype`` (a numpy, TVM or torch dtype) is ``want``."""
    from .._args import dtype_name  # noqa: PLC0415

    if str(dtype) == want:          # (TVM and numpy dtypes print as their names)
        return
    have = dtype_name(dtype)
    if have != want:
        raise error(f"{name}: dtype {have} given, {want} expected")


def check_device(t: tvm.runtime.Tensor, name: str, device, error=ValueError) -> None:
    """``error`` naming ``name`` unless tensor ``t`` is on ``device`` (where the op runs)."""
    dev = t.device
    if (dev.dlpack_device_type(), dev.index) != (device.dlpack_device_type(), device.index):
        raise error(f"{name} is on {dev}, the op runs on {device}")


def op_dlpack_tensor(value, name: str, dtype: str, device, error=ValueError) -> tvm.runtime.Tensor:
    """A DLPack tensor given to an op (:func:`is_dlpack_tensor`) as a TVM tensor
    (:func:`dlpack_to_tvm`), checked to hold ``dtype`` and to be on the op's ``device``: a
    mismatch is ``error`` naming ``name``."""
    t = dlpack_to_tvm(value, name)
    check_dtype(t.dtype, name, dtype, error)
    check_device(t, name, device, error)
    return t


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a TVM dtype name (bfloat16 and the float8 types through ml_dtypes)."""
    try:
        return np.dtype(dtype)
    except TypeError:
        import ml_dtypes  # noqa: PLC0415 - TVM's own dependency for these types

        return np.dtype(getattr(ml_dtypes, dtype))


def host_view(t: tvm.runtime.Tensor) -> np.ndarray:
    """A writable numpy array over the memory of ``t``, a TVM tensor in host memory of any
    strides (``tvm_ffi.from_dlpack`` without checks makes such views), without a copy; numpy
    itself cannot import bfloat16 through DLPack.  ``t`` must outlive the array."""
    import ctypes  # noqa: PLC0415

    dtype = numpy_dtype(str(t.dtype))
    shape = tuple(int(s) for s in t.shape)
    if any(s == 0 for s in shape):
        return np.empty(shape, dtype)
    strides = t.strides
    if strides is None or len(strides) != len(shape):
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    strides = tuple(int(s) for s in strides)
    low = sum(min(0, (n - 1) * s) for n, s in zip(shape, strides))     # elements before / after
    high = sum(max(0, (n - 1) * s) for n, s in zip(shape, strides))    # the first one
    start = t.data_ptr() + low * dtype.itemsize
    flat = np.frombuffer((ctypes.c_char * ((high - low + 1) * dtype.itemsize)).from_address(start), dtype)
    return np.lib.stride_tricks.as_strided(flat[-low:], shape, tuple(s * dtype.itemsize for s in strides))


def flatten_outputs(out) -> list[np.ndarray]:
    """A VM result (tensor or nested tuple) as a flat list of numpy arrays.  A shape (a graph
    output such as ONNX ``Shape``'s, which the VM returns as a shape tuple) is an int64 array."""
    if hasattr(out, "numpy"):
        return [out.numpy()]
    if isinstance(out, tvm.runtime.ShapeTuple):
        return [np.array(list(out), dtype=np.int64)]
    res = []
    for item in out:
        res.extend(flatten_outputs(item))
    return res


def parse_device(device) -> tuple[str, int]:
    """``"cpu"`` / ``"cuda"`` / ``"cuda:1"`` (``"gpu"`` = ``"cuda"``) -> ``(kind, index)``."""
    kind, _, index = str(device).partition(":")
    kind = {"gpu": "cuda"}.get(kind, kind)
    if kind not in ("cpu", "cuda") or not (index == "" or index.isdigit()):
        raise UserError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")
    return kind, int(index or 0)


def open_device(kind: str, index: int = 0):
    """The TVM device, checked to exist (a CUDA device needs a GPU and its driver)."""
    if kind == "cuda":
        try:
            _ensure_cuda_runtime()
        except RuntimeError as err:
            raise UserError(f"device 'cuda': {err}") from err
        dev = tvm.cuda(index)
        if not dev.exist:
            raise UserError(f"device 'cuda:{index}': no such CUDA GPU on this machine (is the driver "
                            "installed?); use device 'cpu' with a library built for llvm")
        return dev
    return tvm.cpu(index)


def load_library(path):
    """``tvm.runtime.load_module`` for a shared library, whatever its file name (TVM picks the
    loader from the suffix; a library exported under a name without ``.so`` is still one)."""
    import tvm_ffi  # noqa: PLC0415

    try:
        if path.endswith(LIBRARY_SUFFIX):
            return tvm.runtime.load_module(path)
        return tvm_ffi.get_global_func("ffi.Module.load_from_file.so")(os.path.realpath(path), "so")
    except RuntimeError as err:
        # a CUDA build loaded without TVM's CUDA runtime (device 'cpu' and no metadata to say so)
        if "created using {cuda}" in str(err):
            raise UserError(f"{path} was built for CUDA; load it with device='cuda'") from err
        raise


def module_kinds(mod) -> set[str]:
    """The kinds of ``mod`` and of every module it imports (``"cuda"`` for GPU kernels)."""
    kinds, todo = set(), [mod]
    while todo:
        m = todo.pop()
        kinds.add(m.kind)
        todo.extend(m.imports)
    return kinds


def inputs_by_name(input_names, inputs) -> dict:
    """``inputs`` (``{name: array}``, or a list / tuple in input order) as ``{name: array}``;
    a ``UserError`` for missing or unknown names or the wrong number of arrays."""
    if isinstance(inputs, Mapping):
        unknown = [n for n in inputs if n not in input_names]
        if unknown:
            raise UserError(f"unknown inputs {unknown}; the model's inputs are {list(input_names)}")
        missing = [n for n in input_names if n not in inputs]
        if missing:
            raise UserError(f"missing inputs {missing}; the model's inputs are {list(input_names)}")
        return inputs
    if isinstance(inputs, (list, tuple)):
        if len(inputs) != len(input_names):
            raise UserError(f"got {len(inputs)} input arrays, the model takes {len(input_names)} "
                            f"({list(input_names)}, in this order)")
        return dict(zip(input_names, inputs))
    raise TypeError(f"inputs must be a dict {{name: array}} or a list/tuple of arrays in the order "
                    f"{list(input_names)}, got {type(inputs).__name__}")


# how the Relax VM reports an argument that does not match main's signature
_VM_PARAM_CHECK = re.compile(r"loc=param\[(?P<index>\d+)\], param=[^,]*, annotation=(?P<annotation>.*?)\)\s+"
                             r"(?P<problem>[^\n]*)")


class Model:
    """A loaded model: ``run({name: array}) -> list[np.ndarray]``."""

    def __init__(self, path, device: str = "cpu"):
        from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415 - runtime-side VM

        self.path = str(path)
        kind, index = parse_device(device)
        # the file first (a truncated library kills the process in dlopen), then the device
        check_elf_library(self.path)
        self.meta = read_metadata(self.path) or {}
        check_library_digest(self.path, self.meta)
        target = self.meta.get("target")
        if target == "cuda" and kind == "cpu":
            raise UserError(f"{self.path} was built for CUDA; load it with device='cuda'")
        if target is not None and target != "cuda" and kind == "cuda":
            raise UserError(f"{self.path} was built for {target} (the CPU); load it with device='cpu'")
        self.device = open_device(kind, index)
        self.lib = load_library(self.path)
        if target is None and kind == "cuda" and "cuda" not in module_kinds(self.lib):
            raise UserError(f"{self.path} holds no CUDA kernels (built for the CPU); load it with device='cpu'")
        try:
            self.vm = VirtualMachine(self.lib, self.device)
        except AttributeError as err:  # "Module has no function 'vm_load_executable'"
            raise UserError(f"{self.path}: a shared library but not {EXPORT_HINT} (it holds no Relax "
                            "VM executable)") from err
        self._main = self.vm["main"]
        arity = self.vm.module["get_function_arity"]("main")
        if self.meta.get("inputs") is not None:
            self.inputs = [dict(i) for i in self.meta["inputs"]]
            if len(self.inputs) != arity:
                raise UserError(f"{self.path}{META_SUFFIX} lists {len(self.inputs)} inputs, the library's main "
                                f"takes {arity}: the metadata belongs to another model; export it again")
        else:  # no metadata: the VM's parameter names
            self.inputs = [{"name": self.vm.module["get_function_param_name"]("main", i), "dtype": None}
                           for i in range(arity)]
        self.input_names = [i["name"] for i in self.inputs]
        self.output_names = list(self.meta.get("outputs", []))
        self.annotations = list(self.meta.get("annotations", []))

    def _arg(self, name, value, dtype):
        if is_dlpack_tensor(value):   # TVM, torch, ...
            t = dlpack_to_tvm(value, f"input {name!r}")   # zero-copy where TVM takes it as it is
        else:
            return tvm.runtime.tensor(host_input(name, value, dtype), self.device)
        if dtype is not None and str(t.dtype) != dtype:
            # (a device tensor is taken as it is, zero copy: no cast)
            raise TypeError(f"input {name!r} has dtype {t.dtype}, the model takes {dtype}")
        if t.device != self.device:
            t = t.copyto(self.device)
        return t

    def _args(self, inputs):
        inputs = inputs_by_name(self.input_names, inputs)
        args = [self._arg(i["name"], inputs[i["name"]], i.get("dtype")) for i in self.inputs]
        check_input_shapes(self.inputs, args)
        return args

    def _call(self, args):
        """``main(*args)``; the VM's own check of an argument (all there is without metadata)
        failing is a ``UserError`` naming the input."""
        try:
            return self._main(*args)
        except (ValueError, TypeError, RuntimeError) as err:
            found = _VM_PARAM_CHECK.search(str(err))
            if found is None or int(found["index"]) >= len(args):
                raise
            arg = args[int(found["index"])]
            raise UserError(f"input {self.input_names[int(found['index'])]!r} (shape {list(arg.shape)}, dtype "
                            f"{arg.dtype}) does not fit the model's {found['annotation']}: "
                            f"{' '.join(found['problem'].split())}") from err

    def run(self, inputs) -> list[np.ndarray]:
        """Run on ``{input name: numpy array or DLPack tensor}`` or a list/tuple in input order."""
        return flatten_outputs(self._call(self._args(inputs)))

    def benchmark(self, inputs, repeat: int = 20, warmup: int = 3) -> float:
        """Median seconds per run (device synchronised, inputs already on the device)."""
        if isinstance(repeat, bool) or not isinstance(repeat, (int, np.integer)) or repeat < 1:
            raise UserError(f"repeat must be a positive number of timed runs, got {repeat!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, (int, np.integer)) or warmup < 0:
            raise UserError(f"warmup must be a number of runs >= 0, got {warmup!r}")
        args = self._args(inputs)
        self._call(args)    # (a bad input: a UserError here, not inside the timing)
        for _ in range(warmup):
            self._main(*args)
        self.device.sync()
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            self._main(*args)
            self.device.sync()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))


def load(path, device: str = "cpu") -> Model:
    """Load a model exported by ``CompiledModel.export`` (or ``pit-tvm compile``).

    The library and its metadata are checked first (:mod:`pit_tvm.runtime.library`): a missing,
    truncated, foreign or modified file, or metadata that is not pit-tvm's, is a
    :class:`~pit_tvm.errors.UserError` naming the problem, never a crash."""
    return Model(path, device)
