"""Run an exported model with only the TVM runtime (works under ``TVM_USE_RUNTIME_LIB=1``).

Imports ``tvm`` (runtime), ``tvm_ffi`` and numpy only: no ``tvm.relax``, no compiler library,
no compiler-side ``pit_tvm`` module. CUDA in runtime-only mode needs two fixes (tvm027.md §1):
``libtvm_runtime_cuda.so`` is loaded by hand, and a library built on a GPU-less box carries CUDA
*source*, which is JIT-compiled through a ``tvm_callback_cuda_compile`` that runs nvcc
(arch: ``$PIT_CUDA_ARCH`` or the device's compute capability).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import tvm

META_SUFFIX = ".json"


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
    within a kind (float64 -> float32, int32 -> int64) is made; one across kinds (floats to an
    integer input such as token ids, which would truncate) is a ``TypeError`` naming the input.
    A 0-d value stays 0-d (``np.ascontiguousarray`` would make it 1-d, which a scalar input rejects)."""
    arr = np.asarray(value)
    if dtype is not None and arr.dtype != np.dtype(dtype):
        if not np.can_cast(arr.dtype, np.dtype(dtype), casting="same_kind"):
            raise TypeError(f"input {name!r} has dtype {arr.dtype}, the model takes {dtype}")
        arr = arr.astype(dtype)
    return np.require(arr, requirements="C")


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


class Model:
    """A loaded model: ``run({name: array}) -> list[np.ndarray]``."""

    def __init__(self, path, device: str = "cpu"):
        from tvm.runtime.vm import VirtualMachine  # noqa: PLC0415 - runtime-side VM

        self.path = str(path)
        kind, _, index = device.partition(":")
        if kind not in ("cpu", "cuda", "gpu"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if kind in ("cuda", "gpu"):
            _ensure_cuda_runtime()
            self.device = tvm.cuda(int(index or 0))
        else:
            self.device = tvm.cpu(int(index or 0))
        meta_path = self.path + META_SUFFIX
        self.meta = {}
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                self.meta = json.load(f)
        if self.meta.get("target") == "cuda" and kind == "cpu":
            raise ValueError(f"{self.path} was built for CUDA; load it with device='cuda'")
        self.lib = tvm.runtime.load_module(self.path)
        self.vm = VirtualMachine(self.lib, self.device)
        self._main = self.vm["main"]
        if self.meta.get("inputs"):
            self.inputs = [dict(i) for i in self.meta["inputs"]]
        else:  # no metadata: the VM's parameter names
            arity = self.vm.module["get_function_arity"]("main")
            self.inputs = [{"name": self.vm.module["get_function_param_name"]("main", i), "dtype": None}
                           for i in range(arity)]
        self.input_names = [i["name"] for i in self.inputs]
        self.output_names = list(self.meta.get("outputs", []))
        self.annotations = list(self.meta.get("annotations", []))

    def _arg(self, name, value, dtype):
        if isinstance(value, tvm.runtime.Tensor):
            t = value
        elif hasattr(value, "__dlpack__") and not isinstance(value, np.ndarray):
            try:
                t = tvm.runtime.from_dlpack(value)  # zero-copy
            except Exception:  # noqa: BLE001 - e.g. not 64-byte aligned: copy host data instead
                dev_type = value.__dlpack_device__()[0] if hasattr(value, "__dlpack_device__") else 1
                if int(dev_type) != 1:  # not kDLCPU
                    raise
                return self._arg(name, np.from_dlpack(value), dtype)
        else:
            return tvm.runtime.tensor(host_input(name, value, dtype), self.device)
        if dtype is not None and str(t.dtype) != dtype:
            # (a device tensor is taken as it is, zero copy: no cast)
            raise TypeError(f"input {name!r} has dtype {t.dtype}, the model takes {dtype}")
        if t.device != self.device:
            t = t.copyto(self.device)
        return t

    def _args(self, inputs):
        if not isinstance(inputs, dict):
            inputs = dict(zip(self.input_names, inputs))
        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise KeyError(f"missing inputs {missing}; expected {self.input_names}")
        args = [self._arg(i["name"], inputs[i["name"]], i.get("dtype")) for i in self.inputs]
        check_input_shapes(self.inputs, args)
        return args

    def run(self, inputs) -> list[np.ndarray]:
        """Run on ``{input name: numpy array or DLPack tensor}`` (or a list in input order)."""
        return flatten_outputs(self._main(*self._args(inputs)))

    def benchmark(self, inputs, repeat: int = 20, warmup: int = 3) -> float:
        """Median seconds per run (device synchronised, inputs already on the device)."""
        args = self._args(inputs)
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
    """Load a model exported by ``CompiledModel.export`` (or ``pit-tvm compile``)."""
    return Model(path, device)
