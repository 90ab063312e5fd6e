"""TVMScript functions for ``pit-tvm analyze`` tests (loaded by path, never imported)."""
from tvm.script import ir as I
from tvm.script import tirx as T


@T.prim_func(s_tir=True)
def matmul(A: T.Buffer((64, 32), "float32"), B: T.Buffer((32, 16), "float32"),
           C: T.Buffer((64, 16), "float32")):
    for i, j, k in T.grid(64, 16, 32):
        with T.sblock("C"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                C[vi, vj] = T.float32(0)
            C[vi, vj] = C[vi, vj] + A[vi, vk] * B[vk, vj]


@I.ir_module
class Module:
    @T.prim_func(s_tir=True)
    def shift(A: T.Buffer((16,), "float32"), B: T.Buffer((16,), "float32")):
        for i in range(15):
            with T.sblock("shift"):
                vi = T.axis.spatial(15, i)
                B[vi] = A[vi + 1]

    @T.prim_func(s_tir=True)
    def relu(A: T.Buffer((8, 8), "float32"), B: T.Buffer((8, 8), "float32")):
        for i, j in T.grid(8, 8):
            with T.sblock("relu"):
                vi, vj = T.axis.remap("SS", [i, j])
                B[vi, vj] = T.max(A[vi, vj], T.float32(0))


NOT_A_FUNCTION = 42
