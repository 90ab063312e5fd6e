"""PIT rule analysis (pit_tvm.rules) on TVMScript and Relax-legalised PrimFuncs."""
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from pit_tvm.rules import AxisAccess, PitRule, find_pit_rules, format_rules

SR = ("SRead",)
SRW = ("SRead", "SWrite")


def _acc(*items):
    """``_acc("A0r", "C1w")`` -> AxisAccess tuple (buffer, dim, r/w)."""
    out = []
    for item in items:
        *name, dim, role = item
        out.append(AxisAccess("".join(name), int(dim), "read" if role == "r" else "write"))
    return tuple(out)


def _by_axis(rules, block):
    return {r.axis: r for r in rules[block]}


# --------------------------------------------------------------------------- kernels


@T.prim_func(s_tir=True)
def matmul(A: T.Buffer((64, 32), "float32"), B: T.Buffer((32, 16), "float32"),
           C: T.Buffer((64, 16), "float32")):
    for i, j, k in T.grid(64, 16, 32):
        with T.sblock("C"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                C[vi, vj] = T.float32(0)
            C[vi, vj] = C[vi, vj] + A[vi, vk] * B[vk, vj]


@T.prim_func(s_tir=True)
def matmul_bt(A: T.Buffer((64, 32), "float32"), B: T.Buffer((16, 32), "float32"),
              C: T.Buffer((64, 16), "float32")):
    for i, j, k in T.grid(64, 16, 32):
        with T.sblock("C"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                C[vi, vj] = T.float32(0)
            C[vi, vj] = C[vi, vj] + A[vi, vk] * B[vj, vk]


@T.prim_func(s_tir=True)
def batch_matmul(A: T.Buffer((4, 64, 32), "float16"), B: T.Buffer((4, 32, 16), "float16"),
                 C: T.Buffer((4, 64, 16), "float32")):
    for b, i, j, k in T.grid(4, 64, 16, 32):
        with T.sblock("bmm"):
            vb, vi, vj, vk = T.axis.remap("SSSR", [b, i, j, k])
            with T.init():
                C[vb, vi, vj] = T.float32(0)
            C[vb, vi, vj] = C[vb, vi, vj] + T.Cast("float32", A[vb, vi, vk]) * T.Cast(
                "float32", B[vb, vk, vj])


@T.prim_func(s_tir=True)
def conv2d_nhwc(I_: T.Buffer((2, 10, 10, 8), "float32"), W: T.Buffer((3, 3, 8, 16), "float32"),
                O: T.Buffer((2, 8, 8, 16), "float32")):
    for n, h, w, f, rh, rw, rc in T.grid(2, 8, 8, 16, 3, 3, 8):
        with T.sblock("conv"):
            vn, vh, vw, vf, vrh, vrw, vrc = T.axis.remap("SSSSRRR", [n, h, w, f, rh, rw, rc])
            with T.init():
                O[vn, vh, vw, vf] = T.float32(0)
            O[vn, vh, vw, vf] = O[vn, vh, vw, vf] + I_[vn, vh + vrh, vw + vrw, vrc] * W[
                vrh, vrw, vrc, vf]


@T.prim_func(s_tir=True)
def conv2d_nhwc_s2(I_: T.Buffer((1, 17, 17, 8), "float32"), W: T.Buffer((3, 3, 8, 16), "float32"),
                   O: T.Buffer((1, 8, 8, 16), "float32")):
    for n, h, w, f, rh, rw, rc in T.grid(1, 8, 8, 16, 3, 3, 8):
        with T.sblock("conv"):
            vn, vh, vw, vf, vrh, vrw, vrc = T.axis.remap("SSSSRRR", [n, h, w, f, rh, rw, rc])
            with T.init():
                O[vn, vh, vw, vf] = T.float32(0)
            O[vn, vh, vw, vf] = O[vn, vh, vw, vf] + I_[vn, vh * 2 + vrh, vw * 2 + vrw, vrc] * W[
                vrh, vrw, vrc, vf]


@T.prim_func(s_tir=True)
def add_relu(A: T.Buffer((32, 8), "float32"), B: T.Buffer((32, 8), "float32"),
             C: T.Buffer((32, 8), "float32"), D: T.Buffer((32, 8), "float32")):
    for i, j in T.grid(32, 8):
        with T.sblock("add"):
            vi, vj = T.axis.remap("SS", [i, j])
            C[vi, vj] = A[vi, vj] + B[vi, vj]
    for i, j in T.grid(32, 8):
        with T.sblock("relu"):
            vi, vj = T.axis.remap("SS", [i, j])
            D[vi, vj] = T.max(C[vi, vj], T.float32(0))


@T.prim_func(s_tir=True)
def softmax(A: T.Buffer((16, 64), "float32"), S: T.Buffer((16, 64), "float32")):
    mx = T.sblock_alloc_buffer((16,))
    ex = T.sblock_alloc_buffer((16, 64))
    sm = T.sblock_alloc_buffer((16,))
    for i, k in T.grid(16, 64):
        with T.sblock("row_max"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                mx[vi] = T.float32(-3.4e38)
            mx[vi] = T.max(mx[vi], A[vi, vk])
    for i, j in T.grid(16, 64):
        with T.sblock("exp"):
            vi, vj = T.axis.remap("SS", [i, j])
            ex[vi, vj] = T.exp(A[vi, vj] - mx[vi])
    for i, k in T.grid(16, 64):
        with T.sblock("row_sum"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                sm[vi] = T.float32(0)
            sm[vi] = sm[vi] + ex[vi, vk]
    for i, j in T.grid(16, 64):
        with T.sblock("norm"):
            vi, vj = T.axis.remap("SS", [i, j])
            S[vi, vj] = ex[vi, vj] / sm[vi]


@T.prim_func(s_tir=True)
def rejected(A: T.Buffer((16,), "float32"), B: T.Buffer((16,), "float32"),
             C: T.Buffer((4,), "float32"), D: T.Buffer((16,), "float32"),
             E: T.Buffer((16,), "float32"), IDX: T.Buffer((16,), "int32"),
             F: T.Buffer((16,), "float32"), G: T.Buffer((4,), "float32")):
    for i in range(1, 16):
        with T.sblock("prefix"):
            vi = T.axis.spatial(16, i)
            B[vi] = B[vi - 1] + A[vi]
    for i, k in T.grid(4, 16):
        with T.sblock("non_comm"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                C[vi] = T.float32(0)
            C[vi] = C[vi] * T.float32(2) + A[vk]
    for i in range(16):
        with T.sblock("guarded"):
            vi = T.axis.spatial(16, i)
            T.where(i < 12)
            D[vi] = A[vi]
    for i in range(16):
        with T.sblock("select"):
            vi = T.axis.spatial(16, i)
            E[vi] = T.if_then_else(vi > 3, A[vi], T.float32(0))
    for i in range(16):
        with T.sblock("gather"):
            vi = T.axis.spatial(16, i)
            F[IDX[vi]] = A[vi]
    for i in range(16):
        with T.sblock("scan"):
            vi = T.axis.scan(16, i)
            T.reads(A[vi])
            T.writes(F[vi])
            F[vi] = A[vi]
    for i, k in T.grid(4, 16):
        with T.sblock("count"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                G[vi] = T.float32(0)
            G[vi] = G[vi] + T.float32(1)


@T.prim_func(s_tir=True)
def misc(A: T.Buffer((16,), "float32"), B: T.Buffer((16, 8), "float32"),
         C: T.Buffer((16,), "float32"), D: T.Buffer((16,), "float32"),
         E: T.Buffer((8,), "float32")):
    for i, j in T.grid(16, 8):
        with T.sblock("broadcast"):
            vi, vj = T.axis.remap("SS", [i, j])
            B[vi, vj] = A[vi]
    for i in range(16):
        with T.sblock("inplace"):
            vi = T.axis.spatial(16, i)
            C[vi] = C[vi] + A[vi]
    for i in range(16):
        with T.sblock("iota"):
            vi = T.axis.spatial(16, i)
            D[vi] = A[vi] * T.Cast("float32", vi)
    for i in range(8):
        with T.sblock("let_index"):
            vi = T.axis.spatial(8, i)
            T.reads(A[vi * 2])
            T.writes(E[vi])
            t = vi * 2
            E[vi] = A[t]
    for i, j in T.grid(8, 16):
        with T.sblock("colmin"):
            vj, vi = T.axis.remap("SR", [i, j])
            with T.init():
                E[vj] = T.float32(3.4e38)
            E[vj] = T.min(E[vj], B[vi, vj])


@I.ir_module
class RelaxMatmul:
    @R.function
    def main(x: R.Tensor((8, 32), "float32"), w: R.Tensor((32, 16), "float32")):
        y = R.matmul(x, w)
        return y


# --------------------------------------------------------------------------- tests


def test_matmul():
    rules = find_pit_rules(matmul)
    assert list(rules) == ["root", "C"]
    assert rules["root"] == []
    i, j, k = rules["C"]
    assert i == PitRule("C", "vi", 0, "spatial", True, SRW, _acc("A0r", "C0w"), None, True)
    assert j == PitRule("C", "vj", 1, "spatial", True, SRW, _acc("B1r", "C1w"), None, True)
    assert k == PitRule("C", "vk", 2, "reduction", True, SR, _acc("A1r", "B0r"), None, None)


def test_matmul_transposed_b():
    r = _by_axis(find_pit_rules(matmul_bt, "C"), "C")
    assert r["vj"].is_pit and r["vj"].accesses == _acc("B0r", "C1w")
    assert r["vk"].is_pit and r["vk"].accesses == _acc("A1r", "B1r")
    assert r["vk"].primitives == SR


def test_batch_matmul():
    rules = find_pit_rules(batch_matmul)["bmm"]
    assert [(r.axis, r.kind, r.is_pit, r.primitives) for r in rules] == [
        ("vb", "spatial", True, SRW),
        ("vi", "spatial", True, SRW),
        ("vj", "spatial", True, SRW),
        ("vk", "reduction", True, SR),
    ]
    assert rules[0].accesses == _acc("A0r", "B0r", "C0w")  # batch indexes every buffer
    assert rules[3].accesses == _acc("A2r", "B1r")  # casts around loads do not matter


@pytest.mark.parametrize(
    "func, h_index, w_index",
    [(conv2d_nhwc, "vh + vrh", "vw + vrw"), (conv2d_nhwc_s2, "vh * 2 + vrh", "vw * 2 + vrw")],
)
def test_conv2d_nhwc(func, h_index, w_index):
    r = _by_axis(find_pit_rules(func), "conv")
    assert [a for a, rule in r.items() if rule.is_pit] == ["vn", "vf", "vrc"]
    assert r["vn"].accesses == _acc("I_0r", "O0w") and r["vn"].primitives == SRW
    assert r["vf"].accesses == _acc("W3r", "O3w") and r["vf"].primitives == SRW
    assert r["vrc"].accesses == _acc("I_3r", "W2r") and r["vrc"].primitives == SR
    assert r["vh"].reason == f"compound index `{h_index}` in dim 1 of I_"
    assert r["vw"].reason == f"compound index `{w_index}` in dim 2 of I_"
    # the window axes are clean in W but compound in the input
    assert r["vrh"].kind == "reduction" and r["vrh"].accesses == _acc("W0r")
    assert r["vrh"].reason == f"compound index `{h_index}` in dim 1 of I_"
    assert r["vrw"].reason == f"compound index `{w_index}` in dim 2 of I_"
    assert all(rule.primitives == () for rule in r.values() if not rule.is_pit)
    # the output still gets its bare h/w index
    assert r["vh"].accesses == _acc("O1w")


def test_elementwise_add_relu():
    rules = find_pit_rules(add_relu)
    assert list(rules) == ["root", "add", "relu"]
    for block in ("add", "relu"):
        for pos, r in enumerate(rules[block]):
            assert (r.kind, r.is_pit, r.primitives, r.full_overwrite) == ("spatial", True, SRW, True)
            assert r.position == pos and r.reason is None
    assert rules["add"][1].accesses == _acc("A1r", "B1r", "C1w")
    assert rules["relu"][0].accesses == _acc("C0r", "D0w")


def test_softmax():
    rules = find_pit_rules(softmax)
    assert list(rules) == ["root", "row_max", "exp", "row_sum", "norm"]
    for block in ("row_max", "row_sum"):  # max and sum folds are commutative
        i, k = rules[block]
        assert (i.kind, i.is_pit, i.primitives) == ("spatial", True, SRW)
        assert (k.kind, k.is_pit, k.primitives) == ("reduction", True, SR)
    assert rules["row_max"][1].accesses == _acc("A1r")
    assert rules["row_sum"][1].accesses == _acc("ex1r")
    # exp / norm: the row axis reaches the 1-D row statistics too
    assert rules["exp"][0].accesses == _acc("A0r", "mx0r", "ex0w")
    assert rules["norm"][0].accesses == _acc("ex0r", "sm0r", "S0w")
    assert rules["norm"][1].accesses == _acc("ex1r", "S1w")
    assert all(r.is_pit for r in rules["norm"] + rules["exp"])


def test_rejected_cases():
    rules = find_pit_rules(rejected)
    prefix = rules["prefix"][0]
    assert not prefix.is_pit and prefix.primitives == ()
    assert prefix.reason == "compound index `vi - 1` in dim 0 of B"
    assert prefix.accesses == _acc("A0r", "B0w")

    i, k = rules["non_comm"]
    assert i.is_pit  # rows are still independent
    assert not k.is_pit and k.kind == "reduction"
    assert "not `C[...] <op> rhs` with a commutative, associative op" in k.reason
    assert "C[vi] * T.float32(2.0) + A[vk]" in k.reason

    guarded = rules["guarded"][0]
    assert not guarded.is_pit and guarded.reason == "appears in the block predicate `T.where(i < 12)`"
    assert guarded.full_overwrite is False

    sel = rules["select"][0]
    assert not sel.is_pit and sel.reason == "appears in a condition `vi > 3`"

    gather = rules["gather"][0]
    assert not gather.is_pit
    assert gather.reason == "indirect index `IDX[vi]` in dim 0 of F (through buffer IDX)"
    assert gather.accesses == _acc("IDX0r", "A0r")  # store indices are visited first

    scan = rules["scan"][0]  # an ordered (scan) iterator is never PIT, whatever its indices
    assert (scan.kind, scan.is_pit, scan.primitives) == ("ordered", False, ())
    assert scan.reason == "iterator type 'ordered' is neither spatial nor reduction"
    assert scan.accesses == _acc("A0r", "F0w") and scan.full_overwrite is None

    count_k = rules["count"][1]
    assert not count_k.is_pit
    assert count_k.reason == "indexes no buffer read: no data (and no sparsity) along it"


def test_boundary_cases():
    rules = find_pit_rules(misc)
    i, j = rules["broadcast"]
    assert i.is_pit and i.primitives == SRW
    # j indexes only the output: nothing to gather, but rows can still be scattered
    assert j.is_pit and j.primitives == ("SWrite",) and j.accesses == _acc("B1w")

    inplace = rules["inplace"][0]
    assert inplace.is_pit and inplace.full_overwrite is False  # reads the old C: no init
    assert inplace.accesses == _acc("C0r", "A0r", "C0w")

    iota = rules["iota"][0]
    assert not iota.is_pit
    assert iota.reason == 'used as a value in `A[vi] * T.Cast("float32", vi)`'

    let_index = rules["let_index"][0]  # an index through a bound variable is still compound
    assert not let_index.is_pit and let_index.reason == "compound index `t` in dim 0 of A"
    assert let_index.accesses == _acc("E0w")

    # block iter var order differs from loop order; min is a commutative fold
    vj, vi = rules["colmin"]
    assert (vj.axis, vj.position, vj.kind, vj.is_pit) == ("vj", 0, "spatial", True)
    assert (vi.axis, vi.position, vi.kind, vi.is_pit) == ("vi", 1, "reduction", True)
    assert vi.accesses == _acc("B0r")


def test_relax_legalized_matmul():
    mod = relax.transform.LegalizeOps()(RelaxMatmul)
    func = mod["matmul"]
    rules = find_pit_rules(func)
    assert list(rules) == ["root", "matmul"]
    i, j, k = rules["matmul"]
    assert (i.axis, i.kind, i.is_pit, i.primitives) == ("v_i0", "spatial", True, SRW)
    assert (j.axis, j.kind, j.is_pit, j.primitives) == ("v_i1", "spatial", True, SRW)
    assert (k.axis, k.kind, k.is_pit, k.primitives) == ("v_k", "reduction", True, SR)
    assert i.accesses == _acc("x0r", "matmul0w")
    assert k.accesses == _acc("x1r", "w0r")
    assert i.full_overwrite is True


@I.ir_module
class RelaxArgmax:
    @R.function
    def main(x: R.Tensor((4, 16, 8), "float32")):
        y = R.argmax(x, axis=1)
        return y


def test_relax_legalized_argmax():
    """Two-output reduction written with bound variables: rows are PIT, the fold is not."""
    mod = relax.transform.LegalizeOps()(RelaxArgmax)
    rules = find_pit_rules(mod["argmax"])
    red = [b for b in rules if b.endswith("red_temp")]
    assert len(red) == 1
    ax0, ax1, k = rules[red[0]]
    assert ax0.is_pit and ax1.is_pit and ax0.primitives == SRW
    assert AxisAccess("x", 0, "read") in ax0.accesses and AxisAccess("x", 2, "read") in ax1.accesses
    assert k.kind == "reduction" and not k.is_pit
    assert "appears in a condition" in k.reason  # argmax ties break on the position itself
    assert "the update is not a single buffer store" in k.reason


def test_block_filter_and_errors():
    only = find_pit_rules(softmax, block="row_sum")
    assert list(only) == ["row_sum"]
    with pytest.raises(ValueError, match=r"no sblock named 'nope'.*'row_max', 'exp'"):
        find_pit_rules(softmax, block="nope")
    with pytest.raises(TypeError, match="got an IRModule"):
        find_pit_rules(tvm.IRModule({"main": matmul}))
    with pytest.raises(TypeError, match="got int"):
        find_pit_rules(3)


def test_format_rules():
    text = format_rules(find_pit_rules(conv2d_nhwc_s2))
    lines = text.splitlines()
    assert lines[0].split() == ["block", "axis", "kind", "PIT", "primitives", "accesses",
                                "reason", "/", "note"]
    rows = {line.split()[1]: line for line in lines[2:] if line.startswith("conv")}
    assert rows["vf"].split()[:6] == ["conv", "vf", "spatial", "yes", "SRead+SWrite", "W[3]r,"]
    assert "compound index `vh * 2 + vrh` in dim 1 of I_" in rows["vh"]
    assert rows["vrc"].split()[2:5] == ["reduction", "yes", "SRead"]
    assert "root" in text and "no iteration variables" in text


# --------------------------------------------------------------------------- fuzz


def _shifted(stride, offset):
    @T.prim_func(s_tir=True)
    def f(A: T.Buffer((64,), "float32"), B: T.Buffer((8,), "float32")):
        for i in range(8):
            with T.sblock("B"):
                vi = T.axis.spatial(8, i)
                B[vi] = A[vi * stride + offset]

    return f


def _conv1d(stride, dilation, offset):
    @T.prim_func(s_tir=True)
    def f(A: T.Buffer((2, 64, 4), "float32"), W: T.Buffer((3, 4, 8), "float32"),
          B: T.Buffer((2, 8, 8), "float32")):
        for n, x, c, r, rc in T.grid(2, 8, 8, 3, 4):
            with T.sblock("conv"):
                vn, vx, vc, vr, vrc = T.axis.remap("SSSRR", [n, x, c, r, rc])
                with T.init():
                    B[vn, vx, vc] = T.float32(0)
                B[vn, vx, vc] = B[vn, vx, vc] + A[vn, vx * stride + vr * dilation + offset, vrc] * W[
                    vr, vrc, vc]

    return f


@settings(max_examples=25, deadline=None)
@given(stride=st.integers(1, 4), offset=st.integers(0, 3))
def test_fuzz_shifted_index(stride, offset):
    (rule,) = find_pit_rules(_shifted(stride, offset))["B"]
    assert rule.is_pit == (stride == 1 and offset == 0)
    if not rule.is_pit:
        assert rule.reason.startswith("compound index `") and "in dim 0 of A" in rule.reason
        assert rule.accesses == _acc("B0w")


@settings(max_examples=15, deadline=None)
@given(stride=st.integers(1, 3), dilation=st.integers(1, 2), offset=st.integers(0, 2))
def test_fuzz_conv1d_window(stride, dilation, offset):
    r = _by_axis(find_pit_rules(_conv1d(stride, dilation, offset)), "conv")
    assert {a for a, rule in r.items() if rule.is_pit} == {"vn", "vc", "vrc"}
    for axis in ("vx", "vr"):
        assert "in dim 1 of A" in r[axis].reason and r[axis].reason.startswith("compound index")
