"""Probe: the warp-specialized K loop of the dense wgmma kernel, its ring loaded by cp.async from
1, 2 or 4 loader warps instead of by TMA.

:mod:`pit_tvm.schedules.wgmma`'s dense kernel runs its K loop warp-specialized: a loader fills
the ring and signals each slot's ``full`` mbarrier, the two consumer warpgroups wait on it, run
the wgmma and release the slot on an ``empty`` mbarrier.  Its loader uses TMA.  Here the same
loop is loaded by cp.async from ``LOADERS`` threads (``cp.async.mbarrier.arrive.noinc``), the
way a gathered operand must be, to see what issuing the copies costs.  Dense fp16 (C = A @ B),
checked against torch and timed beside the kernel of pit_tvm and cuBLAS::

    python3 benchmarks/_ws_probe.py [MxKxN ...]

(H100 at 7e82e0d, which also had this loop loaded by TMA: 4096^3 1 / 2 / 4 loader warps 448 /
289 / 222 us, TMA 200, the all-threads kernel 219, cuBLAS 181.)
"""
from __future__ import annotations

import sys

import tvm
from tvm import tirx
from tvm.script import tirx as T

from pit_tvm.schedules.wgmma import _TARGET, _SWIZZLE_128B, lower_tirx

BM, BK, BN = 128, 64, 256


def ws_dense_func(K: int, N: int, STAGES: int = 4, LOADERS: int = 32):
    THREADS = 256 + LOADERS                # warpgroups 0 and 1 compute, the warps after them load
    KT = K // BK
    A_TILE, B_TILE = BM * BK, BK * BN
    B_BASE = STAGES * A_TILE
    ACC = BN // 2
    A_PER, B_PER = BM * BK // 8 // LOADERS, BK * 32 // LOADERS   # 16-byte chunks per loader per K tile
    A_STEP, B_STEP = LOADERS // 8, LOADERS // 32                    # rows between a loader's chunks
    C_ROW = BN + 8
    C_CHUNKS = BM * BN // 8 // 256
    wgmma = f"wgmma.mma_async.sync.aligned.m64n{BN}k16.f32.f16.f16"
    A_LBO, A_SBO = 1, 8 * BK * 2 // 16
    B_LBO, B_SBO = BK * 128 // 16, 1024 // 16

    @T.prim_func(s_tir=False)
    def kernel(a: T.handle, b: T.handle, c: T.handle):
        M = T.int64()
        A = T.match_buffer(a, (M, K), "float16")
        B = T.match_buffer(b, (K, N), "float16")
        C = T.match_buffer(c, (M, N), "float16")
        T.device_entry()
        bn, bm = T.cta_id([N // BN, T.Cast("int32", (M + BM - 1) // BM)])
        tid = T.thread_id([THREADS])
        smem = T.alloc_buffer([STAGES * (A_TILE + B_TILE)], "float16", scope="shared.dyn", align=1024)
        bars = T.alloc_buffer([2 * STAGES], "uint64", scope="shared", align=8)   # full[s], empty[s]
        acc = T.alloc_local([ACC], "float32")
        desc_a = T.alloc_local([1], "uint64")
        desc_b = T.alloc_local([1], "uint64")
        m = T.Cast("int32", M)
        p0 = bm * BM
        if tid == 0:
            for s in T.unroll(STAGES):
                T.ptx.mbarrier.init.shared.b64(bars.ptr_to([s]), T.uint32(LOADERS))
                T.ptx.mbarrier.init.shared.b64(bars.ptr_to([STAGES + s]), T.uint32(2))
        T.cuda.cta_sync()
        if tid >= 256:
            lane = tid - 256
            # A: chunk lane % 8 of rows lane / 8 + A_STEP j; B: chunk lane % 32 of rows lane / 32 + B_STEP i
            for kt in T.serial(KT):
                s = kt % STAGES
                if kt >= STAGES:
                    T.cuda.mbarrier_wait(bars.ptr_to([STAGES + s]), (kt // STAGES - 1) % 2)
                for j in T.unroll(A_PER):
                    r = lane // 8 + A_STEP * j
                    T.evaluate(T.ptx["cp.async.cg.shared.global"](
                        smem.ptr_to([s * A_TILE + r * BK + T.bitwise_xor(lane % 8, r % 8) * 8]),
                        A.ptr_to([T.min(p0 + r, m - 1), kt * BK + lane % 8 * 8]), 16,
                        T.Cast("uint32", T.if_then_else(p0 + r < m, 16, 0))))
                for i in T.unroll(B_PER):
                    kr = lane // 32 + B_STEP * i
                    T.evaluate(T.ptx["cp.async.cg.shared.global"](
                        smem.ptr_to([B_BASE + s * B_TILE + (lane % 32 // 8) * (BK * 64) + kr * 64
                                     + T.bitwise_xor(lane % 8, kr % 8) * 8]),
                        B.ptr_to([kt * BK + kr, bn * BN + lane % 32 * 8]), 16))
                T.ptx["cp.async.mbarrier.arrive.noinc.shared.b64"](bars.ptr_to([s]))
        else:
            wg = tid // 128
            for i in T.unroll(ACC):
                acc[i] = T.float32(0)
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_a[0]), smem.ptr_to([wg * 64 * BK]),
                                                  A_LBO, A_SBO, _SWIZZLE_128B)
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_b[0]), smem.ptr_to([B_BASE]),
                                                  B_LBO, B_SBO, _SWIZZLE_128B)
            for q in T.serial(KT):
                s = q % STAGES
                T.cuda.mbarrier_wait(bars.ptr_to([s]), (q // STAGES) % 2)
                T.ptx["fence.proxy.async.shared::cta"]()
                T.ptx.wgmma.fence.sync.aligned()
                for kk in T.unroll(BK // 16):
                    T.ptx[wgmma](
                        *[acc[i] for i in range(ACC)],
                        desc_a[0] + T.Cast("uint64", (s * A_TILE + kk * 16) // 8),
                        desc_b[0] + T.Cast("uint64", (s * B_TILE + kk * 16 * 64) // 8),
                        True, 1, 1, 0, 1)
                T.ptx.wgmma.commit_group.sync.aligned()
                T.ptx.wgmma.wait_group.sync.aligned(1)      # wgmma q - 1 retired: release its slot
                if q > 0:
                    if tid % 128 == 0:
                        T.ptx.mbarrier.arrive.shared.b64(bars.ptr_to([STAGES + (q - 1) % STAGES]), T.uint32(1))
            T.ptx.wgmma.wait_group.sync.aligned(0)
        T.cuda.cta_sync()
        if tid < 256:
            wg = tid // 128
            w = (tid % 128) // 32
            lane = tid % 32
            for nb in T.unroll(BN // 8):
                for i in T.unroll(2):
                    for e in T.vectorized(2):
                        smem[(wg * 64 + w * 16 + lane // 4 + 8 * i) * C_ROW + nb * 8 + (lane % 4) * 2 + e] = \
                            T.Cast("float16", acc[nb * 4 + i * 2 + e])
        T.cuda.cta_sync()
        if tid < 256:
            for j in T.unroll(C_CHUNKS):
                r = (tid + 256 * j) // (BN // 8)
                ch = (tid + 256 * j) % (BN // 8)
                if p0 + r < m:
                    for e in T.vectorized(8):
                        C[p0 + r, bn * BN + ch * 8 + e] = smem[r * C_ROW + ch * 8 + e]

    return lower_tirx(kernel, _TARGET)


def main(shapes):
    import torch
    from triton.testing import do_bench

    from pit_tvm.schedules.wgmma import wgmma_row_gather_func
    from pit_tvm.target import build

    as_tvm = tvm.runtime.from_dlpack
    for (m, k, n) in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        b = torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5
        c = torch.empty(m, n, device="cuda", dtype=torch.float16)
        ref = a.float() @ b.float()
        line = f"{m}x{k}x{n}: cuBLAS {do_bench(lambda: torch.matmul(a, b)) * 1e3:6.1f} us"
        kernels = {"pit dense (TMA loader)": wgmma_row_gather_func(k, n, dense=True),
                   **{f"cp.async, {w} loader warps": ws_dense_func(k, n, 4, 32 * w) for w in (1, 2, 4)}}
        for name, func in kernels.items():
            fn = build(tvm.IRModule({"main": func}), "cuda:sm_90a")["main"]
            c.fill_(7)
            fn(as_tvm(a), as_tvm(b), as_tvm(c))
            torch.cuda.synchronize()
            err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
            line += f"  {name} {do_bench(lambda: fn(as_tvm(a), as_tvm(b), as_tvm(c))) * 1e3:6.1f} us (err {err:.1e})"
        print(line, flush=True)


if __name__ == "__main__":
    main([tuple(int(x) for x in s.split("x")) for s in sys.argv[1:]]
         or [(4096, 4096, 4096), (4096, 2048, 8192), (4096, 8192, 2048), (8192, 8192, 8192)])
