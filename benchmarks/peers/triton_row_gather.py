"""Row-granular dynamic-sparsity peers in Triton: a fused gather/scatter GEMM and two ways to build its index.

Copied from our research peer scripts (``/work/shared/research/triton_row_gather_peer.py`` and
``triton_row_index_peer.py``, written for pit-tvm's peer survey on the H100, 2026-11-22), with the
kernels unchanged and the script bodies turned into functions. The GEMM is the PIT approach done
by hand (as in MInference): rows of A listed in ``idx[:cnt]`` are gathered inside the kernel, and
the result rows are stored to the same rows of C (the caller zero-fills C).

Index builders (no host sync in either):
* :func:`index_torch_ops`: ``any`` + ``cumsum`` + ``scatter`` (``build_index_nosync`` in the script).
* :func:`index_triton`: a row-flag kernel that reads A once, then one block that scans and
  compacts in ascending order (``triton_row_index_peer.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def gather_mm(A, B, C, IDX, cnt_ptr, M, N, K, sa, sb, sc,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    cnt = tl.load(cnt_ptr)
    n_m = tl.cdiv(cnt, BM)
    n_n = tl.cdiv(N, BN)
    pm = pid // n_n
    pn = pid % n_n
    if pm >= n_m:
        return
    rm = pm * BM + tl.arange(0, BM)
    rows = tl.load(IDX + rm, mask=rm < cnt, other=0)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    a_ptr = A + rows[:, None] * sa + rk[None, :]
    b_ptr = B + rk[:, None] * sb + rn[None, :]
    for k in range(0, K, BK):
        a = tl.load(a_ptr, mask=(rm < cnt)[:, None], other=0.0)
        b = tl.load(b_ptr)
        acc += tl.dot(a, b)
        a_ptr += BK
        b_ptr += BK * sb
    tl.store(C + rows[:, None] * sc + rn[None, :], acc.to(tl.float16), mask=(rm < cnt)[:, None])


# (BM, BN, BK, num_warps, num_stages), the script's candidates
CONFIGS = [(128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 32, 4, 4)]


def gather_mm_into(a, b, c, idx, cnt, cfg):
    """``c[idx[:cnt]] = a[idx[:cnt]] @ b`` (fp16; M, N multiples of the tile; K of BK)."""
    bm, bn, bk, w, st = cfg
    m, k = a.shape
    n = b.shape[1]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    gather_mm[grid](a, b, c, idx, cnt, m, n, k, a.stride(0), b.stride(0), c.stride(0),
                    BM=bm, BN=bn, BK=bk, GROUP=8, num_warps=w, num_stages=st)
    return c


def index_torch_ops(a):
    """(idx int32[M], cnt int32[1]) of the non-zero rows of ``a``, from torch ops, no host sync."""
    cap = a.shape[0]
    nz = (a != 0).any(dim=1)
    pos = torch.cumsum(nz.to(torch.int32), 0) - 1
    cnt = pos[-1:].add(1)
    idx = torch.zeros(cap, dtype=torch.int32, device=a.device)
    idx.scatter_(0, torch.where(nz, pos, cap - 1).long(), torch.arange(cap, device=a.device, dtype=torch.int32))
    return idx, cnt


@triton.jit
def row_flags(A, F, M, K, sa, BR: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * BR + tl.arange(0, BR)
    acc = tl.zeros((BR,), dtype=tl.int32)
    for k in range(0, K, BK):
        c = k + tl.arange(0, BK)
        a = tl.load(A + r[:, None] * sa + c[None, :], mask=(r < M)[:, None] & (c < K)[None, :], other=0.0)
        acc |= tl.max((a != 0).to(tl.int32), axis=1)
    tl.store(F + r, acc, mask=r < M)


@triton.jit
def compact(F, IDX, CNT, M, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    base = 0
    for start in range(0, M, BLOCK):
        o = start + offs
        f = tl.load(F + o, mask=o < M, other=0)
        pos = tl.cumsum(f, axis=0) - f + base
        tl.store(IDX + pos, o.to(tl.int32), mask=(f != 0) & (o < M))
        base += tl.sum(f, axis=0)
    tl.store(CNT, base)


def index_triton(a, br=16, bk=256):
    """(idx int32[M], cnt int32[1]) of the non-zero rows of ``a``: two Triton kernels, no host sync."""
    m, k = a.shape
    flags = torch.empty(m, dtype=torch.int32, device=a.device)
    idx = torch.empty(m, dtype=torch.int32, device=a.device)
    cnt = torch.empty(1, dtype=torch.int32, device=a.device)
    row_flags[(triton.cdiv(m, br),)](a, flags, m, k, a.stride(0), BR=br, BK=bk, num_warps=4)
    compact[(1,)](flags, idx, cnt, m, BLOCK=1024, num_warps=4)
    return idx, cnt


def tune(a, b, bench, configs=CONFIGS):
    """The fastest config for the GEMM alone (index given), timed with ``bench(fn) -> ms``.

    Returns ``(cfg, ms, failures)``; configs that fail to compile or run are listed in failures.
    """
    idx, cnt = index_torch_ops(a)
    c = torch.zeros(a.shape[0], b.shape[1], device=a.device, dtype=torch.float16)
    best, failures = None, []
    for cfg in configs:
        try:
            ms = bench(lambda cfg=cfg: gather_mm_into(a, b, c, idx, cnt, cfg))
        except Exception as err:  # noqa: BLE001 - a config that does not fit is skipped
            failures.append(f"{cfg}: {str(err).splitlines()[0][:120] if str(err) else type(err).__name__}")
            continue
        if best is None or ms < best[1]:
            best = (cfg, ms)
    if best is None:
        raise RuntimeError("no Triton gather GEMM config ran: " + "; ".join(failures))
    return best[0], best[1], failures
