"""Export -> load with the TVM runtime only (TVM_USE_RUNTIME_LIB=1, the compiler library absent
from the tvm package the subprocess imports) -> run; CUDA build checks."""
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnx_models import small_model
from pit_tvm.compile import compile_onnx

ort = pytest.importorskip("onnxruntime")
ROOT = Path(__file__).resolve().parents[2]


def tvm_without_compiler(root: Path) -> Path:
    """A view of the installed ``tvm`` package under ``root`` in which ``libtvm_compiler.so``
    does not exist: every entry a symlink to the real one, ``lib/`` without the compiler
    library (TVM finds its libraries next to its ``__file__``, which the view keeps unresolved)."""
    import importlib.util

    real = Path(importlib.util.find_spec("tvm").submodule_search_locations[0])
    view = root / "tvm"
    view.mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name != "lib":
            (view / entry.name).symlink_to(entry)
    (view / "lib").mkdir()
    for lib in (real / "lib").iterdir():
        if "tvm_compiler" not in lib.name:
            (view / "lib" / lib.name).symlink_to(lib)
    return root


def runtime_only(code: str, *args, timeout=120, site: Path | None = None):
    # Keep any PYTHONPATH entries (the GPU box puts TVM on it) after the project root; ``site``
    # (a tvm_without_compiler view) before both.
    path = os.pathsep.join(p for p in (str(site or ""), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


NO_COMPILER_CHECK = """
    import sys, tvm
    assert tvm.base._RUNTIME_ONLY, "not in runtime-only mode"
    assert "tvm.relax" not in sys.modules, "tvm.relax was imported"
    assert "tvm_compiler" not in tvm.base._LOADED_LIBS
    maps = open("/proc/self/maps").read()
    assert "libtvm_compiler" not in maps, "the compiler library is mapped"
    assert not [m for m in sys.modules if m in ("pit_tvm.compile", "pit_tvm.passes", "pit_tvm.ops")]
    print("RUNTIME_ONLY_OK")
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = small_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = compile_onnx(model)
    path = tmp_path_factory.mktemp("rt") / "small.so"
    cm.export(path)
    return model, cm, path


def test_export_writes_library_and_metadata(exported):
    _, cm, path = exported
    meta = json.loads(Path(str(path) + ".json").read_text())
    assert meta["target"] == "llvm" and meta["outputs"] == ["y", "pooled"]
    assert meta["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", "seq", 32]}]
    assert meta["annotations"][0]["tensor"] == "hidden"
    assert meta["annotations"][0]["status"] == "pit"  # the exported library holds the PIT kernel
    assert any(gv.name_hint.startswith("pit_kernel") for gv in cm.lowered.get_global_vars())


def test_runtime_only_roundtrip_matches_onnxruntime(exported, tmp_path):
    model, _, path = exported
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    cases = [rng.standard_normal(s).astype("float32") for s in ((2, 5, 32), (1, 13, 32))]
    np.savez(tmp_path / "in.npz", *cases)
    code = """
        import sys, numpy as np
        import pit_tvm.runtime as rt
        model = rt.load(sys.argv[1], device="cpu")
        assert model.input_names == ["x"] and model.output_names == ["y", "pooled"]
        ins = np.load(sys.argv[2]); outs = {}
        for i, key in enumerate(sorted(ins.files)):
            x = ins[key]
            res = model.run({"x": x})
            class DL:  # a non-numpy DLPack producer
                def __init__(s, a): s.a = a
                def __dlpack__(s, **kw): return s.a.__dlpack__(**kw)
                def __dlpack_device__(s): return s.a.__dlpack_device__()
            res2 = model.run({"x": DL(x)})
            for a, b in zip(res, res2): np.testing.assert_array_equal(a, b)
            outs[f"{i}_y"], outs[f"{i}_pooled"] = res
        np.savez(sys.argv[3], **outs)
        assert model.benchmark({"x": ins[ins.files[0]]}, repeat=3, warmup=1) > 0
    """
    code = textwrap.dedent(code) + textwrap.dedent(NO_COMPILER_CHECK) + textwrap.dedent("""
        import os
        lib = os.path.join(os.path.dirname(tvm.__file__), "lib")
        assert not [f for f in os.listdir(lib) if "tvm_compiler" in f], os.listdir(lib)
        print("COMPILER_ABSENT_OK", tvm.__file__)
    """)
    site = tvm_without_compiler(tmp_path / "site")
    out = runtime_only(code, path, tmp_path / "in.npz", tmp_path / "out.npz", site=site)
    assert "RUNTIME_ONLY_OK" in out and f"COMPILER_ABSENT_OK {site}" in out
    got = np.load(tmp_path / "out.npz")
    for i, x in enumerate(cases):
        ref = sess.run(None, {"x": x})
        np.testing.assert_allclose(got[f"{i}_y"], ref[0], rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(got[f"{i}_pooled"], ref[1], rtol=1e-4, atol=1e-3)


def test_runtime_package_import_is_compiler_free():
    out = runtime_only("import pit_tvm, pit_tvm.runtime, pit_tvm.runtime.loader, pit_tvm.cli.run\n"
                       + textwrap.dedent(NO_COMPILER_CHECK))
    assert "RUNTIME_ONLY_OK" in out


def test_cli_compile_then_run_runtime_only(tmp_path):
    model = small_model(seed=1)
    onnx.save(model, tmp_path / "m.onnx")
    x = np.random.default_rng(0).standard_normal((2, 4, 32)).astype("float32")
    np.savez(tmp_path / "in.npz", x=x)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "pit_tvm.cli.main", "compile", str(tmp_path / "m.onnx"),
                           "--target", "llvm", "--sparse", "hidden:1x32", "-o", str(tmp_path / "m.so")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "hidden" in proc.stdout and "explicit+relu" in proc.stdout and "1x32" in proc.stdout
    env["TVM_USE_RUNTIME_LIB"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pit_tvm.cli.main", "run", str(tmp_path / "m.so"),
                           "--inputs", str(tmp_path / "in.npz"), "--bench", "--repeat", "3"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "y: shape=(2, 4, 16)" in proc.stdout and "pooled: shape=(2, 16)" in proc.stdout
    assert "median time:" in proc.stdout
    # unknown --sparse name: error listing the valid names, exit code 2
    proc = subprocess.run([sys.executable, "-m", "pit_tvm.cli.main", "compile", str(tmp_path / "m.onnx"),
                           "--sparse", "nope", "-o", str(tmp_path / "bad.so")],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "valid tensor names" in proc.stderr and "hidden" in proc.stderr
    # --shape: a static build; a wrong rank is an error naming the input
    proc = subprocess.run([sys.executable, "-m", "pit_tvm.cli.main", "compile", str(tmp_path / "m.onnx"),
                           "--shape", "x=2x4x32", "-o", str(tmp_path / "static.so")],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.load(open(tmp_path / "static.so.json"))["inputs"][0]["shape"] == [2, 4, 32]
    proc = subprocess.run([sys.executable, "-m", "pit_tvm.cli.main", "compile", str(tmp_path / "m.onnx"),
                           "--shape", "x=2x4", "-o", str(tmp_path / "bad.so")],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "'x'" in proc.stderr and "cannot be [2, 4]" in proc.stderr
    # --expected-density outside (0, 1]: an error naming it, exit code 2
    proc = subprocess.run([sys.executable, "-m", "pit_tvm.cli.main", "compile", str(tmp_path / "m.onnx"),
                           "--expected-density", "1.5", "-o", str(tmp_path / "bad.so")],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "expected_density" in proc.stderr and "1.5" in proc.stderr


def test_cli_run_bad_inputs_are_errors(exported, tmp_path, capsys):
    """pit-tvm run: an input file that is not an .npz, or an input of the wrong shape or dtype,
    is an error naming it (exit code 2), not a traceback"""
    from pit_tvm.cli.main import main

    _, _, path = exported
    x = np.zeros((2, 3, 32), "float32")
    cases = {"one.npy": (lambda p: np.save(p, x), "not an .npz"),
             "text.npz": (lambda p: p.write_text("not numpy"), "cannot read --inputs"),
             "rank.npz": (lambda p: np.savez(p, x=x[0]), "input 'x' has shape [3, 32]"),
             "dtype.npz": (lambda p: np.savez(p, x=x.astype("complex64")), "input 'x' has dtype complex64")}
    for name, (write, message) in cases.items():
        write(tmp_path / name)
        assert main(["run", str(path), "--inputs", str(tmp_path / name)]) == 2, name
        assert message in capsys.readouterr().err, name
    # float64 is cast to the model's float32 (one kind), as before
    np.savez(tmp_path / "f64.npz", x=x.astype("float64"))
    assert main(["run", str(path), "--inputs", str(tmp_path / "f64.npz")]) == 0
    assert "y: shape=(2, 3, 16) dtype=float32" in capsys.readouterr().out


def test_host_input_casts_within_a_kind_only():
    from pit_tvm.runtime.loader import host_input

    assert host_input("x", np.ones((2, 2)), "float32").dtype == np.float32
    assert host_input("ids", np.arange(4, dtype="int32"), "int64").dtype == np.int64
    assert host_input("x", [[1, 2]], None).dtype.kind == "i"
    with pytest.raises(TypeError, match="input 'ids' has dtype float64, the model takes int64"):
        host_input("ids", np.array([1.5, 2.0]), "int64")    # token ids as floats would truncate


def test_cli_compile_malformed_micro_tile_is_named(tmp_path, capsys):
    from pit_tvm.cli.compile import parse_sparse
    from pit_tvm.cli.main import main

    assert parse_sparse(["hidden", "h2:1x64", "input:0"]) == {"hidden": None, "h2": (1, 64), "input:0": None}
    onnx.save(small_model(seed=1), tmp_path / "m.onnx")
    for bad in ("hidden:3x", "hidden:0x32", "hidden:x32"):
        assert main(["compile", str(tmp_path / "m.onnx"), "--sparse", bad, "-o", str(tmp_path / "bad.so")]) == 2
        assert f"--sparse '{bad}': the micro-tile after ':' must be MxK" in capsys.readouterr().err
    assert not (tmp_path / "bad.so").exists()


@pytest.fixture(scope="module")
def cuda_built(tmp_path_factory):
    """fp16 with N=128: on CUDA PIT lowers only where a tensor-core kernel applies."""
    from pit_tvm.testing import to_float16

    model = small_model(seed=2, n_out=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = compile_onnx(to_float16(model), target="cuda")
    path = tmp_path_factory.mktemp("cuda") / "small_cuda.so"
    cm.export(path)
    return model, cm, path


def test_cuda_build_source_compiles_with_nvcc(cuda_built):
    from pit_tvm.nvcc import check_cuda_compiles, find_nvcc

    if find_nvcc() is None:
        pytest.skip("nvcc not available")
    _, cm, path = cuda_built
    assert path.exists() and json.loads(Path(str(path) + ".json").read_text())["target"] == "cuda"
    assert any(gv.name_hint.startswith("pit_kernel") for gv in cm.lowered.get_global_vars())
    # built for the default "cuda" (sm_90a: wgmma kernels), so compiled for that arch
    assert check_cuda_compiles(cm.executable, archs=("sm_90a",)) >= 1


@pytest.mark.gpu
def test_cuda_runtime_only_roundtrip(cuda_built, tmp_path):
    model, _, path = cuda_built
    x = np.random.default_rng(5).standard_normal((3, 7, 32)).astype("float32")
    np.save(tmp_path / "x.npy", x.astype("float16"))
    code = """
        import sys, numpy as np
        import pit_tvm.runtime as rt
        model = rt.load(sys.argv[1], device="cuda")
        y, pooled = model.run({"x": np.load(sys.argv[2])})
        np.save(sys.argv[3], y)
    """
    code = textwrap.dedent(code) + textwrap.dedent(NO_COMPILER_CHECK)
    runtime_only(code, path, tmp_path / "x.npy", tmp_path / "y.npy", timeout=600,
                 site=tvm_without_compiler(tmp_path / "site"))
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    y = np.load(tmp_path / "y.npy").astype("float32")
    np.testing.assert_allclose(y, ref[0], rtol=3e-2, atol=3e-2 * np.abs(ref[0]).max())


def test_model_takes_dlpack_inputs_of_any_layout(exported):
    """runtime.Model takes DLPack tensors TVM cannot import as they are (Fortran order, strided,
    not 64-byte aligned: pit_tvm.runtime.loader.dlpack_to_tvm copies them), with the result
    of the contiguous numpy input."""
    import pit_tvm.runtime as rt

    class Producer:  # a non-numpy DLPack producer
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    _, _, path = exported
    model = rt.load(path, device="cpu")
    x = np.random.default_rng(5).standard_normal((2, 5, 32)).astype("float32")
    want = model.run({"x": x})
    raw = np.empty(x.size + 1, np.float32)[1:]                   # 4 bytes off numpy's alignment
    misaligned = raw if raw.ctypes.data % 64 else np.empty(x.size + 2, np.float32)[1:-1]
    misaligned = misaligned.reshape(x.shape)
    strided = np.zeros((2, 10, 32), np.float32)[:, ::2]
    for view in (np.asfortranarray(x), misaligned, strided):
        view[...] = x
        for a, b in zip(model.run({"x": Producer(view)}), want):
            np.testing.assert_array_equal(a, b)
