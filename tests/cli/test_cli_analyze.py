"""`pit-tvm analyze` on a TVMScript file and on an ONNX model."""
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pit_tvm.cli.main import main

DATA = Path(__file__).resolve().parents[1] / "data"
EXAMPLE = DATA / "rules_example.py"


def _sections(text):
    """``{function name: {(block, axis): row cells}}`` from the analyze output."""
    out = {}
    for chunk in text.strip().split("\n\n"):
        head, *lines = chunk.splitlines()
        assert head.startswith("== ") and head.endswith(" ==")
        rows = {}
        for line in lines[2:]:  # header + rule line
            cells = line.split(maxsplit=6)
            rows[(cells[0], cells[1])] = cells
        out[head[3:-3]] = rows
    return out


def _run(capsys, *argv):
    rc = main(["analyze", *map(str, argv)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_tvmscript_file(capsys):
    rc, out, err = _run(capsys, EXAMPLE)
    assert rc == 0 and err == ""
    sections = _sections(out)
    # globals: one PrimFunc and an IRModule with two; the int global is ignored
    assert set(sections) == {"matmul", "Module.relu", "Module.shift"}
    mm = sections["matmul"]
    assert mm[("C", "vi")][2:6] == ["spatial", "yes", "SRead+SWrite", "A[0]r,"]
    assert mm[("C", "vk")][2:5] == ["reduction", "yes", "SRead"]
    assert mm[("root", "-")][-1] == "no iteration variables"
    shift = sections["Module.shift"][("shift", "vi")]
    assert shift[2:5] == ["spatial", "no", "-"]
    assert shift[-1].endswith("compound index `vi + 1` in dim 0 of A")
    relu = sections["Module.relu"]
    assert all(relu[("relu", ax)][3] == "yes" for ax in ("vi", "vj"))


def test_tvmscript_block_filter(capsys):
    rc, out, _ = _run(capsys, EXAMPLE, "--block", "relu")
    assert rc == 0
    sections = _sections(out)
    assert list(sections) == ["Module.relu"]
    assert set(sections["Module.relu"]) == {("relu", "vi"), ("relu", "vj")}  # no root row


def test_unknown_block(capsys):
    rc, out, err = _run(capsys, EXAMPLE, "--block", "nope")
    assert rc == 2 and out == ""
    assert "no sblock named 'nope'" in err
    assert "matmul: ['root', 'C']" in err and "Module.relu: ['root', 'relu']" in err


@pytest.fixture
def mlp_onnx(tmp_path):
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((32, 16)).astype(np.float32), "w2")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("MatMul", ["r", "w2"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])],
        initializer=[w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "mlp.onnx"
    onnx.save(model, str(path))
    return path


def test_onnx_model(capsys, mlp_onnx):
    rc, out, err = _run(capsys, mlp_onnx)
    assert rc == 0 and err == ""
    sections = _sections(out)
    assert set(sections) == {"matmul", "matmul1", "relu"}
    for name in ("matmul", "matmul1"):
        rows = sections[name]
        assert [(k[1], v[2], v[3], v[4]) for k, v in rows.items() if k[0] == "matmul"] == [
            ("v_i0", "spatial", "yes", "SRead+SWrite"),
            ("v_i1", "spatial", "yes", "SRead+SWrite"),
            ("v_k", "reduction", "yes", "SRead"),
        ]
        assert rows[("matmul", "v_i0")][-1].endswith("full overwrite")  # symbolic batch rows
    relu_rows = [v for k, v in sections["relu"].items() if k[0] != "root"]
    assert len(relu_rows) == 2 and all(v[3] == "yes" and v[4] == "SRead+SWrite" for v in relu_rows)


def test_missing_file(capsys, tmp_path):
    rc, out, err = _run(capsys, tmp_path / "absent.onnx")
    assert rc == 2 and out == ""
    assert "absent.onnx: no such file" in err


def test_unsupported_extension(capsys, tmp_path):
    path = tmp_path / "model.txt"
    path.write_text("hello")
    rc, _, err = _run(capsys, path)
    assert rc == 2
    assert "unsupported extension '.txt'; expected one of .py, .onnx" in err


def test_broken_inputs(capsys, tmp_path):
    bad_py = tmp_path / "broken.py"
    bad_py.write_text("raise RuntimeError('boom')\n")
    rc, _, err = _run(capsys, bad_py)
    assert rc == 2 and "failed to import: RuntimeError: boom" in err

    empty_py = tmp_path / "empty.py"
    empty_py.write_text("X = 1\n")
    rc, _, err = _run(capsys, empty_py)
    assert rc == 2 and "no TensorIR PrimFunc found" in err

    bad_onnx = tmp_path / "bad.onnx"
    bad_onnx.write_bytes(b"not a protobuf at all \xff\xfe")
    rc, _, err = _run(capsys, bad_onnx)
    assert rc == 2 and "bad.onnx: not a readable ONNX model" in err


def test_file_argument_required(capsys):
    # (main returns argparse's exit code; the usage error is one line)
    assert main(["analyze"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pit-tvm analyze: error:" in err and "file" in err
