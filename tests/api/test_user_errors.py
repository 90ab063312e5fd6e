"""Bad input to the public API and the CLI is a clear error, never a crash or an unrelated one.

Libraries and metadata that are truncated, corrupt, foreign or missing (``pit_tvm.runtime.load``,
``pit-tvm run``: the cases that used to crash run in a subprocess), ``CompiledModel.export``'s
suffix, ``compile_onnx``'s checks of the model file and of ``shapes=`` / ``sparse=``,
``run``'s inputs, and every CLI subcommand's user errors: exit code 2 and one stderr line.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from onnx_models import small_model

from pit_tvm.cli.main import main
from pit_tvm.compile import compile_onnx, static_shapes
from pit_tvm.errors import UserError
from pit_tvm.passes.annotate import sparse_annotations
from pit_tvm.runtime import load
from pit_tvm.runtime.library import check_elf_library

ort = pytest.importorskip("onnxruntime")
ROOT = Path(__file__).resolve().parents[2]  # the repository
HAS_GPU = tvm.cuda(0).exist
X = np.random.default_rng(7).standard_normal((2, 3, 32)).astype("float32")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The small model, compiled and exported as ``model.so``; its onnxruntime outputs for X."""
    root = tmp_path_factory.mktemp("hardening")
    model = small_model(seed=4)
    onnx.save(model, root / "m.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = compile_onnx(model)
    path = Path(cm.export(root / "model"))            # no suffix: .so appended
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": X})
    return root, cm, path, ref


def user_error(capsys, argv, *fragments, prog=None):
    """``main(argv)`` is a user error: exit code 2, one stderr line ``pit-tvm CMD: error: ...``
    holding every fragment, no traceback."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 2, (argv, out, err)
    assert err.count("\n") == 1 and err.startswith(f"{prog or 'pit-tvm ' + str(argv[0])}: error: "), err
    assert "Traceback" not in out + err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


# ---------------------------------------------------------------------------------------------
# libraries and metadata
# ---------------------------------------------------------------------------------------------
def test_truncation_at_any_length_is_detected(built, tmp_path):
    """check_elf_library finds a library cut anywhere (dlopen of one dies with SIGBUS)."""
    _, _, path, _ = built
    data = path.read_bytes()
    check_elf_library(path)
    cut = tmp_path / "cut.so"
    for size in sorted({*range(0, len(data), max(1, len(data) // 97)), 1, 63, 64, len(data) - 1}):
        cut.write_bytes(data[:size])
        with pytest.raises(UserError, match="truncated|no ELF header"):
            check_elf_library(cut)


def broken_copies(path: Path, where: Path) -> dict:
    """``{name: (library path, expected message)}``: the exported ``path`` broken every way."""
    data, meta = path.read_bytes(), json.loads(Path(f"{path}.json").read_text())
    cases = {}

    def case(name, lib_bytes, meta_text, message):
        lib = where / f"{name}.so"
        lib.write_bytes(lib_bytes)
        if meta_text is not None:
            Path(f"{lib}.json").write_text(meta_text)
        cases[name] = (str(lib), message)

    good_meta = json.dumps(meta)
    for size in (100, len(data) // 2, len(data) - 1):
        case(f"truncated{size}", data[:size], good_meta, "truncated or corrupt library")
    case("truncated_no_meta", data[: len(data) // 3], None, "truncated or corrupt library")
    case("garbage", np.random.default_rng(0).bytes(5000), None, "not a shared library (no ELF header)")
    case("empty", b"", good_meta, "not a shared library")
    libm = Path("/lib/x86_64-linux-gnu/libm.so.6")
    if libm.exists():
        case("foreign_no_meta", libm.read_bytes(), None, "holds no Relax VM executable")
        case("foreign_with_meta", libm.read_bytes(), good_meta, "does not match the checksum")
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF                                  # same size, one byte changed
    case("modified", bytes(flipped), good_meta, "does not match the checksum")
    case("meta_not_json", data, "{not json", "not valid JSON")
    case("meta_list", data, "[1, 2]", "a JSON list, expected an object")
    case("meta_format", data, json.dumps(dict(meta, format="onnx")), "format is 'onnx'")
    case("meta_inputs", data, json.dumps(dict(meta, inputs="x")), "'inputs' is not a list")
    case("meta_dtype", data, json.dumps(dict(meta, inputs=[dict(meta["inputs"][0], dtype="float99")])),
         "has dtype 'float99'")
    case("meta_checksum", data, json.dumps(dict(meta, library_sha256="0" * 64)), "does not match the checksum")
    case("meta_arity", data, json.dumps(dict(meta, inputs=meta["inputs"] * 2)), "lists 2 inputs")
    return cases


def test_broken_library_or_metadata_is_a_user_error(built, tmp_path):
    """runtime.load of each broken copy raises UserError naming the problem; in a subprocess,
    printing each case first, so a crash (the old SIGBUS) fails here with its name."""
    _, _, path, _ = built
    cases = broken_copies(path, tmp_path)
    code = textwrap.dedent("""
        import json, sys
        from pit_tvm.errors import UserError
        from pit_tvm.runtime import load
        results = {}
        for name, (lib, _) in json.loads(sys.argv[1]).items():
            print("case", name, flush=True)
            try:
                load(lib)
                results[name] = "loaded"
            except UserError as err:
                results[name] = str(err)
        print("RESULTS", json.dumps(results))
    """)
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300, cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    results = json.loads(proc.stdout.split("RESULTS ", 1)[1])
    for name, (lib, message) in cases.items():
        assert message in results[name], (name, results[name])
        assert "\n" not in results[name]


def test_cli_run_truncated_library_exits_2(built, tmp_path):
    """`pit-tvm run` of a truncated library: exit code 2 and one line (it was SIGBUS, 135)."""
    _, _, path, _ = built
    lib = tmp_path / "cut.so"
    lib.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    shutil.copy(f"{path}.json", f"{lib}.json")
    np.savez(tmp_path / "in.npz", x=X)
    proc = subprocess.run([sys.executable, "-m", "pit_tvm.cli.main", "run", str(lib), "--inputs",
                           str(tmp_path / "in.npz")], capture_output=True, text=True, timeout=300,
                          cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT), TVM_USE_RUNTIME_LIB="1"))
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert proc.stderr.count("\n") == 1 and "cut.so: truncated or corrupt library" in proc.stderr


def test_library_without_metadata_or_suffix_still_runs(built, tmp_path):
    """No metadata: the VM's parameter names, and a bad input is still named; a library exported
    under a name without .so (before export appended it) loads too."""
    _, _, path, ref = built
    bare = tmp_path / "bare.so"
    shutil.copy(path, bare)
    model = load(bare)
    assert model.input_names == ["x"] and model.meta == {}
    for got, want in zip(model.run([X]), ref):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    with pytest.raises(UserError, match=r"input 'x' \(shape \[3, 32\].*expect Tensor with ndim 3 but get 2"):
        model.run({"x": X[0]})
    with pytest.raises(UserError, match=r"input 'x' \(shape \[2, 3, 31\].*shape\[2\] mismatch"):
        model.run({"x": X[..., :31]})
    legacy = tmp_path / "legacy"
    shutil.copy(path, legacy)
    shutil.copy(f"{path}.json", f"{legacy}.json")
    for got, want in zip(load(legacy).run({"x": X}), ref):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_load_refuses_wrong_files_and_devices(built, tmp_path):
    root, _, path, _ = built
    for target, message in ((root / "m.onnx", "is an ONNX model, not a compiled library"),
                            (tmp_path, "is a directory"), (tmp_path / "none.so", "no such file")):
        with pytest.raises(UserError, match=message):
            load(target)
    for device in ("tpu", "cuda:x", "cpu:-1"):
        with pytest.raises(UserError, match="device must be 'cpu' or 'cuda'"):
            load(path, device)
    with pytest.raises(UserError, match="built for llvm .*device='cpu'"):
        load(path, "cuda")


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------
def test_export_appends_so_and_checks_the_directory(built, tmp_path):
    root, cm, path, ref = built
    assert path == root / "model.so" and path.exists() and Path(f"{path}.json").exists()
    meta = json.loads(Path(f"{path}.json").read_text())
    assert len(meta["library_sha256"]) == 64 and not (root / "model").exists()
    for got, want in zip(load(path).run({"x": X}), ref):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    assert cm.export(tmp_path / "m.v2") == str(tmp_path / "m.v2.so")
    assert cm.export(tmp_path / "m.so") == str(tmp_path / "m.so")
    with pytest.raises(UserError, match="the directory .*missing does not exist"):
        cm.export(tmp_path / "missing" / "m.so")
    (tmp_path / "d.so").mkdir()
    with pytest.raises(UserError, match="is a directory"):
        cm.export(tmp_path / "d.so")


# ---------------------------------------------------------------------------------------------
# compile_onnx arguments
# ---------------------------------------------------------------------------------------------
def test_compile_onnx_refuses_what_is_not_an_onnx_model(tmp_path):
    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "text.onnx").write_text("hello, not a protobuf \xff")
    no_outputs = helper.make_model(helper.make_graph(
        [], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])], []))
    cases = [(tmp_path / "empty.onnx", "an empty file, not an ONNX model"),
             (tmp_path / "text.onnx", "not an ONNX model"),
             (tmp_path, "not a file"),
             (tmp_path / "missing.onnx", "no such file"),
             (no_outputs, "the ONNX graph has no outputs")]
    for model, message in cases:
        with pytest.raises(UserError, match=message):
            compile_onnx(model)


@pytest.mark.parametrize("shapes, error, message", [
    ({"x": [-1, 8, 32]}, UserError, r"shapes\['x'\] = \[-1, 8, 32\]: every dim must be a positive int.*got -1"),
    ({"x": [None, 8, 32]}, UserError, r"got None"),
    ({"x": [5.7, 8, 32]}, UserError, r"got 5.7"),
    ({"x": [True, 8, 32]}, UserError, r"got True"),
    ({"x": "2x8x32"}, TypeError, r"shapes\['x'\] must be a list of positive ints, got str"),
    ({"x": 8}, TypeError, r"got int 8"),
    ([2, 8, 32], TypeError, r"shapes= must be a dict \{input name: \[dim, ...\]\}, got list"),
    ({"y": [2, 8, 32]}, UserError, r"unknown input 'y'; the model's inputs are \['x'\]"),
    ({"x": [2, 8]}, UserError, r"'x' is \['batch', 'seq', 32\] in the model, cannot be \[2, 8\]"),
])
def test_shapes_argument_is_checked(shapes, error, message):
    with pytest.raises(error, match=message):
        compile_onnx(small_model(), shapes=shapes)


@pytest.mark.parametrize("sparse, error, message", [
    ("hidden", TypeError, r"sparse= must be a dict .* got str 'hidden' \(for one tensor: \['hidden'\]\)"),
    ({"hidden": 5}, UserError, r"sparse\['hidden'\]: the micro-tile must be None or two positive ints \(m, k\), got 5"),
    ({"hidden": (1, 0)}, UserError, r"got \(1, 0\)"),
    ({"hidden": (1.5, 32)}, UserError, r"got \(1.5, 32\)"),
    ({"hidden": "1x32"}, UserError, r"got '1x32'"),
    ({3: None}, UserError, r"tensor names are non-empty strings, got 3"),
    (7, TypeError, r"got int 7"),
    ({"nope": None}, UserError, r"unknown tensor name\(s\) \['nope'\] in sparse=; valid tensor names: .*hidden"),
])
def test_sparse_argument_is_checked(sparse, error, message):
    with pytest.raises(error, match=message):
        compile_onnx(small_model(), sparse=sparse)


_DIM = st.one_of(st.integers(-3, 40), st.none(), st.floats(-2, 40), st.just(float("nan")), st.text(max_size=2),
                 st.booleans())


@settings(max_examples=80, deadline=None)
@given(st.lists(_DIM, max_size=4))
def test_shapes_fuzz_accepts_exactly_positive_int_shapes(dims):
    """A shape for x[batch, seq, 32] is accepted iff it is three positive ints ending in 32;
    anything else is a UserError or TypeError (never another exception, never truncation)."""
    proto = small_model()
    valid = (len(dims) == 3 and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims)
             and dims[2] == 32)
    if valid:
        assert static_shapes(proto, {"x": dims}) == {"x": dims}
    else:
        with pytest.raises((UserError, TypeError)):
            static_shapes(proto, {"x": dims})


@settings(max_examples=80, deadline=None)
@given(st.one_of(st.none(), st.text(max_size=3), st.integers(),
                 st.lists(st.text(min_size=1, max_size=3), max_size=3),
                 st.dictionaries(st.one_of(st.text(max_size=3), st.integers()),
                                 st.one_of(st.none(), st.integers(-2, 64), st.tuples(_DIM, _DIM),
                                           st.lists(st.integers(-1, 64), max_size=3)), max_size=3)))
def test_sparse_fuzz_normalises_or_names_the_problem(sparse):
    """sparse= is normalised to {name: (m, k) | None} with positive ints, or refused clearly."""
    def tile_ok(t):
        return t is None or (isinstance(t, (tuple, list)) and len(t) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in t))

    valid = sparse is None or isinstance(sparse, list) and all(sparse) or isinstance(sparse, dict) and all(
        isinstance(k, str) and k and tile_ok(v) for k, v in sparse.items())
    if valid:
        out = sparse_annotations(sparse)
        names = sparse if isinstance(sparse, list) else list(sparse or {})
        assert list(out) == list(dict.fromkeys(names))
        for name, tile in out.items():
            want = None if isinstance(sparse, list) else sparse[name]
            assert tile == (None if want is None else tuple(want))
    else:
        with pytest.raises((UserError, TypeError)):
            sparse_annotations(sparse)


# ---------------------------------------------------------------------------------------------
# run's inputs (CompiledModel and the runtime Model)
# ---------------------------------------------------------------------------------------------
def test_run_takes_a_dict_or_a_sequence_and_names_bad_inputs(built):
    _, cm, path, ref = built
    for model in (cm, load(path)):
        for inputs in ({"x": X}, [X], (X,), {"x": X.astype("float64")}):
            for got, want in zip(model.run(inputs), ref):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
        with pytest.raises(UserError, match=r"got 2 input arrays, the model takes 1 \(\['x'\], in this order\)"):
            model.run([X, X])
        with pytest.raises(UserError, match=r"got 0 input arrays"):
            model.run(())
        with pytest.raises(UserError, match=r"unknown inputs \['y'\]; the model's inputs are \['x'\]"):
            model.run({"x": X, "y": X})
        with pytest.raises(UserError, match=r"missing inputs \['x'\]"):
            model.run({})
        with pytest.raises(TypeError, match=r"inputs must be a dict .* got ndarray"):
            model.run(X)
        with pytest.raises(TypeError, match="input 'x' has dtype int64, the model takes float32"):
            model.run({"x": X.astype("int64")})
        with pytest.raises(ValueError, match=r"input 'x' has shape \[3, 32\]"):
            model.run({"x": X[0]})
    with pytest.raises(UserError, match="repeat must be a positive number"):
        load(path).benchmark({"x": X}, repeat=0)


# ---------------------------------------------------------------------------------------------
# the CLI: every subcommand's user errors
# ---------------------------------------------------------------------------------------------
def test_cli_compile_user_errors(built, tmp_path, capsys):
    root, _, _, ref = built
    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "text.onnx").write_text("not onnx")
    good = root / "m.onnx"
    cases = [([tmp_path / "empty.onnx"], "empty.onnx: an empty file, not an ONNX model"),
             ([tmp_path / "text.onnx"], "text.onnx: not an ONNX model"),
             ([tmp_path], "not a file"),
             ([tmp_path / "missing.onnx"], "missing.onnx: no such file"),
             ([good, "--target", "tpu"], "unknown target 'tpu'"),
             ([good, "--shape", "x=0x4x32"], "every dim must be a positive int"),
             ([good, "--shape", "x"], "--shape 'x': expected NAME=DIMxDIM"),
             ([good, "--sparse", "nope"], "valid tensor names"),
             ([good, "--expected-density", "2"], "expected_density")]
    for args, message in cases:
        user_error(capsys, ["compile", *args, "-o", tmp_path / "out.so"], message)
    user_error(capsys, ["compile", good, "-o", tmp_path / "no" / "out.so"], "the directory", "does not exist")
    user_error(capsys, ["compile", good], "-o/--output")
    assert not list(tmp_path.glob("*.so*")) and not (tmp_path / "no").exists()
    # an output name without .so gets it, and is what `run` reads
    assert main(["compile", str(good), "-o", str(tmp_path / "model")]) == 0
    assert f"wrote {tmp_path / 'model.so'} (+ {tmp_path / 'model.so'}.json)" in capsys.readouterr().out
    for got, want in zip(load(tmp_path / "model.so").run({"x": X}), ref):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_cli_run_user_errors(built, tmp_path, capsys):
    root, _, path, _ = built
    bare = tmp_path / "bare.so"
    shutil.copy(path, bare)                              # no metadata: the VM checks the inputs
    arrays = {"extra": {"x": X, "z": X}, "none": {}, "rank": {"x": X[0]}, "int": {"x": X.astype("int32")},
              "good": {"x": X}}
    for name, values in arrays.items():
        np.savez(tmp_path / f"{name}.npz", **values)
    inputs = lambda name: ["--inputs", tmp_path / f"{name}.npz"]  # noqa: E731
    user_error(capsys, ["run", path, *inputs("extra")], "unknown inputs ['z']", "extra.npz")
    user_error(capsys, ["run", path, *inputs("none")], "missing inputs ['x']")
    user_error(capsys, ["run", path, *inputs("rank")], "input 'x' has shape [3, 32]")
    user_error(capsys, ["run", bare, *inputs("rank")], "input 'x' (shape [3, 32]", "ndim 3")
    user_error(capsys, ["run", path, *inputs("int")], "input 'x' has dtype int32, the model takes float32")
    user_error(capsys, ["run", bare, *inputs("int")], "expect Tensor with dtype float32 but get int32")
    user_error(capsys, ["run", path, *inputs("good"), "--bench", "--repeat", "0"],
               "argument --repeat: expected a positive integer, got '0'")
    user_error(capsys, ["run", root / "m.onnx", *inputs("good")], "is an ONNX model", "pit-tvm compile")
    user_error(capsys, ["run", tmp_path / "none.so", *inputs("good")], "none.so: no such file")
    user_error(capsys, ["run", path, "--inputs", tmp_path / "absent.npz"], "cannot read --inputs")
    user_error(capsys, ["run", path, *inputs("good"), "--device", "tpu"], "device must be 'cpu' or 'cuda'")
    if not HAS_GPU:
        user_error(capsys, ["run", bare, *inputs("good"), "--device", "cuda"], "device 'cuda")
    assert main(["run", str(path), *map(str, inputs("good")), "--bench", "--repeat", "1"]) == 0
    assert "median time:" in capsys.readouterr().out


def test_cli_other_subcommands_user_errors(tmp_path, capsys):
    user_error(capsys, ["demo", "--repeat", "0"], "--repeat", "positive integer")
    user_error(capsys, ["demo", "--active", "1.5"], "--active", "(0, 1]")
    user_error(capsys, ["demo", "--micro-tile", "32by1"], "--micro-tile '32by1'")
    user_error(capsys, ["demo", "--target", "tpu"], "unknown target 'tpu'")
    if not HAS_GPU:
        user_error(capsys, ["demo", "--target", "cuda"], "no cuda")
    user_error(capsys, ["tune", "--k", "0", "--n", "64"], "--k", "positive integer")
    user_error(capsys, ["tune", "--k", "64", "--n", "64", "--trials", "0"], "--trials")
    user_error(capsys, ["analyze", tmp_path / "none.py"], "no such file")
    user_error(capsys, ["nope"], "invalid choice: 'nope'", prog="pit-tvm")
    assert main(["--help"]) == 0


@pytest.fixture(scope="module")
def cuda_library(tmp_path_factory):
    """The small model built for CUDA (built without a GPU: the library carries CUDA source)."""
    model = small_model(seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = compile_onnx(model, "cuda")
    path = Path(cm.export(tmp_path_factory.mktemp("cuda_lib") / "model.so"))
    bare = path.with_name("bare.so")
    shutil.copy(path, bare)                               # the same library, without metadata
    return model, path, bare


def test_cuda_library_on_the_cpu_is_a_user_error(cuda_library):
    _, path, bare = cuda_library
    for lib in (path, bare):                              # from the metadata, or from the library
        with pytest.raises(UserError, match="was built for CUDA; load it with device='cuda'"):
            load(lib, "cpu")


@pytest.mark.gpu
def test_device_and_library_must_match_on_a_gpu(built, cuda_library, tmp_path):
    """On a GPU: a CPU library is refused on 'cuda' (with or without metadata); a CUDA library
    without metadata loads on 'cuda' and matches onnxruntime."""
    _, _, path, _ = built
    bare_cpu = tmp_path / "bare_cpu.so"
    shutil.copy(path, bare_cpu)
    with pytest.raises(UserError, match=r"built for llvm \(the CPU\)"):
        load(path, "cuda")
    with pytest.raises(UserError, match="holds no CUDA kernels"):
        load(bare_cpu, "cuda")
    model, _, bare = cuda_library
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": X})
    for got, want in zip(load(bare, "cuda").run([X]), ref):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-2)
