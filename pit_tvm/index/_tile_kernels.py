"""The tile index in two kernels: a bandwidth-bound flag pass that also counts, then one
compaction kernel (which can also apply the dense fallback); with one tile column, in one.

1. ``flags`` (many CTAs of ``WPB`` warps): every lane reads ``VEC``-element vectors (16 bytes
   for fp16/bf16/fp32), consecutive lanes on consecutive addresses. The work is cut into
   *units* numbered in the flat (row-major tile) order: a unit is either one micro-tile whose
   ``L`` vectors are shared by a group of ``Lp`` lanes (``mc`` a multiple of ``VEC``: e.g.
   ``(1, 64)`` -> 8 lanes/tile, whole rows -> a warp per row, ``NI`` vectors per lane) and
   OR-ed with warp shuffles, or one vector holding ``TPV = VEC / mc`` whole micro-tiles
   (``mc`` < ``VEC``: e.g. ``(32, 1)`` -> 8 column tiles per lane, walking the 32 rows).
   Each lane loops over the ``mr`` rows of its tile-row; a lane holding one tile (at least 8
   loads) reads an eighth of them first and the rest only when its tile's lanes found no
   non-zero there (``FlagGeometry.early``: a non-zero tile is mostly read in part). CTA ``b``
   covers units ``[b*UPB, (b+1)*UPB)``, i.e. flat ids ``[b*FPB, (b+1)*FPB)``; it writes the int8 flags and,
   when the group order is the row-major tile order (``group="row"`` or one tile column), the
   number of set flags of its range into ``CNT[b]`` (otherwise a small count kernel does it).
2. ``compact`` (one CTA per ``CHC`` flat ids = ``FB`` flag blocks): the CTA sums ``CNT`` before
   its range (its base) and all of it (the total), scans its threads' flag counts in shared
   memory, writes its ids, the group pointers that start in its range and the ``-1`` tail.
   With ``density_threshold`` every CTA also decides ``total > threshold * capacity`` and then
   writes the dense index (every tile listed) instead: same result as the old separate
   ``densify`` kernels.

3. ``list_units`` (one tile column: the rows index) does both in one kernel: each CTA flags
   its tile-rows, then one atomic add on a zeroed state word gives it the positions of its
   listed ids (from the front) and unlisted ids (from the back), and the last CTA writes the
   count: faster than the flag and compaction kernels together
   (docs/design/measurements.md#index-kernels).

Apart from ``list_units``: no atomics; integer sums only, so results are byte-for-byte
deterministic. With a
``LoopStrategy`` of ``gpu=False, gpu_layout=True`` the same kernels run on the CPU with serial
thread loops; the only difference is the in-warp OR, which the group leader then computes
itself by running every lane's loads (tests use this to check the CUDA index math).
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from ._kernels import NT, LoopStrategy, make_block_scan

WPB = 8  # warps per flag CTA
NTC = NT  # threads per compaction CTA (the shared block scan's width)
KC = 32  # flags per compaction thread
FL_VEC = 16  # flags per vector load of the compaction (16 bytes)
LOG_NTC = 8
CHC_MIN = NTC * KC
_ELEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "bool": 1}
FULL_MASK = 0xFFFFFFFF
#: the one-group index's device state: one word, ``listed + units * UNITS_SCALE`` summed over
#: the CTAs, zero before a call and left zero by it (see ``list_units``).  A float64, because
#: CUDA's 64-bit integer atomicAdd takes ``unsigned long long`` and TVM prints uint64 as
#: ``uint64_t``; integer sums below 2**53 are exact in it, so a one-group index takes up to
#: 2**26 units (tile-rows).
STATE_WORDS = 1
STATE_DTYPE = "float64"
UNITS_SCALE = float(1 << 26)


def state_add(listed, units):
    """what a CTA adds to a listing state word: ``listed + units * UNITS_SCALE`` (this index's
    units are tile-rows; the strips kernels count themselves, one unit per CTA)"""
    return T.Cast(STATE_DTYPE, listed) + T.Cast(STATE_DTYPE, units) * T.float64(UNITS_SCALE)


def state_units(old):
    """the units the CTAs that added before summed, from the word an atomic add returned
    (float64; exact below 2**53)"""
    return T.floor(old / T.float64(UNITS_SCALE))


def state_listed(old):
    """the items the CTAs that added before listed (int32), from the word an atomic add returned"""
    return T.Cast("int32", old - state_units(old) * T.float64(UNITS_SCALE))


def state_completes(old, units):
    """int32 1 where the CTA adding one unit to the word ``old`` completes a strip of ``units``"""
    return T.Cast("int32", state_units(old) + T.float64(1) == T.float64(units))


def warp_ballot(pred):
    """CUDA ``__ballot_sync`` over the whole warp: bit l set where lane l's ``pred`` holds"""
    return T.call_extern("uint32", "__ballot_sync", T.uint32(0xFFFFFFFF), pred)


def lanes_below(ballot, lane):
    """(int32) the set bits of ``ballot`` below bit ``lane``: a listed item's rank in its warp"""
    return T.Cast("int32", T.popcount(T.bitwise_and(
        ballot, T.shift_left(T.uint32(1), T.Cast("uint32", lane)) - T.uint32(1))))


def _pow2_ceil(n):
    p = 1
    while p < n:
        p *= 2
    return p


@dataclass(frozen=True)
class FlagGeometry:
    vec: int  # elements per vector load
    tpv: int  # micro-tiles per unit (>1 only when mc < vec)
    uw: int  # columns per unit
    mcv: int  # elements of one vector that belong to one tile (vec when mc >= vec)
    L: int  # vectors per tile row segment (1 when mc < vec)
    lp: int  # lanes per unit (power of two <= 32)
    ni: int  # vectors per lane per row of a unit
    tpw: int  # units per warp step
    u: int  # warp steps per warp
    upb: int  # units per flag CTA
    fpb: int  # flat ids per flag CTA
    chc: int  # flat ids per compaction CTA
    fb: int  # flag CTAs per compaction CTA
    early: int  # loads of a lane's tile read before the rest (0: all at once)


def flag_geometry(cols, mr, mc, dtype) -> FlagGeometry:
    vmax = 1 if dtype == "bool" else 16 // _ELEM_BYTES[dtype]  # (no boolx16 in CUDA codegen)
    vec = 1
    v = vmax
    while v > 1:
        if cols % v == 0 and (mc % v == 0 or v % mc == 0):
            vec = v
            break
        v //= 2
    if mc % vec == 0:
        tpv, uw, mcv, L = 1, mc, vec, mc // vec
    else:
        tpv, uw, mcv, L = vec // mc, vec, mc, 1
    lp = min(32, _pow2_ceil(L))
    ni = -(-L // lp)
    tpw = 32 // lp
    loads = mr * ni
    u = 1
    while u * loads < 8 and u < 8:
        u *= 2
    upb = WPB * u * tpw
    fpb = upb * tpv
    chc = max(CHC_MIN, fpb)  # both powers of two: chc is a whole number of flag CTAs
    assert chc % fpb == 0
    # early exit: a lane holding one tile (u == tpv == 1, so at least 8 loads) first reads an
    # eighth of them, and the rest only if its tile's lanes found no non-zero there (a non-zero
    # tile is then mostly read in part: 4096 x 4096 fp16 rows, 1 of a row's 8 KiB)
    early = loads // 8 if u == 1 and tpv == 1 else 0
    return FlagGeometry(vec, tpv, uw, mcv, L, lp, ni, tpw, u, upb, fpb, chc, chc // fpb, early)


def nz_bits(dtype):
    """int32 that is non-zero iff the element is non-zero (-0.0 is zero, NaN is not)."""
    if dtype == "bool":
        return lambda v: T.Cast("int32", v)
    if dtype == "float32":
        return lambda v: T.bitwise_and(T.reinterpret("int32", v), T.int32(0x7FFFFFFF))
    return lambda v: T.bitwise_and(T.Cast("int32", T.reinterpret("uint16", v)), T.int32(0x7FFF))


def make_tile_kernels(st: LoopStrategy, cols, mr, mc, dtype, row_major_flat, density_threshold=None,
                      complement=False):
    """Macros ``flags_gpu(D, FL, CNT, R, NU_T, flat)``, ``count(FL, NF, CNT)`` and
    ``compact(FL, NF, P, G, CNT, NB, OFF, IDS)`` plus the geometry.  ``complement`` (one
    group only): ``compact`` lists the unflagged ids after the count instead of ``-1``."""
    g = flag_geometry(cols, mr, mc, dtype)
    gpu = st.gpu
    BX, TX, TY, SH = st.bx, st.tx, st.ty, st.shared
    # list_units' CTAs: in order on the CPU (its emulated atomics are plain read-modify-writes)
    CTA = (lambda n: T.thread_binding(n, thread="blockIdx.x")) if gpu else T.serial
    C = cols
    VEC, TPV, UW, MCV, L, LP, NI, TPW, U, UPB = g.vec, g.tpv, g.uw, g.mcv, g.L, g.lp, g.ni, g.tpw, g.u, g.upb
    CHC, FB, K = g.chc, g.fb, g.chc // NTC
    NU = C // UW if TPV > 1 else -(-C // mc)  # units per tile-row
    nz = nz_bits(dtype)
    LOG_LP = LP.bit_length() - 1
    need_v_check = NI * LP != L
    need_c_check = TPV == 1 and C % mc != 0
    LOADS, EARLY = mr * NI, g.early  # vector loads per lane per unit; read first (0: all at once)
    thr = density_threshold

    def over_threshold(count, nf):
        """the dense fallback's test: more than ``density_threshold`` of the ``nf`` tiles listed"""
        return T.Cast("float64", count) > T.float64(thr) * T.Cast("float64", nf)

    def vcheck(it, lane):
        return it * LP + lane < L if need_v_check else tirx.const(True, "bool")

    def ccheck(un, it, lane):
        return (un % NU) * UW + (it * LP + lane) * VEC < C if need_c_check else tirx.const(True, "bool")

    def in_range(un, ri, R, NUT, checked):
        if checked:
            return T.And(un < NUT, (un // NU) * mr + ri < R)
        return tirx.const(True, "bool")

    @T.macro
    def partial(D, accs, vb, R, NUT, b, ty, tx, u, lane, checked, j0, j1):
        # the lane's loads j0 <= j < j1 of unit u (load j: row j // NI of the tile-row, vector
        # j % NI).  checked=False: the whole CTA lies inside the data (no per-load bounds tests,
        # so the loads of the unrolled steps are independent and can all be in flight)
        un = b * UPB + (ty * U + u) * TPW + tx // LP
        for j in T.unroll(j0, j1):
            if in_range(un, j // NI, R, NUT, checked):
                if vcheck(j % NI, lane):
                    if ccheck(un, j % NI, lane):
                        for e in T.vectorized(VEC):
                            vb[e] = D[(un // NU) * mr + j // NI, (un % NU) * UW + ((j % NI) * LP + lane) * VEC + e]
                        for e in T.unroll(VEC):
                            accs[u * TPV + e // MCV] = T.bitwise_or(accs[u * TPV + e // MCV], nz(vb[e]))

    @T.macro
    def units(D, accs, vb, R, NUT, b, ty, tx, checked, j0, j1):
        # every unit of this lane (on the CPU the leader runs its lanes' loads itself)
        for u in T.unroll(U):
            if gpu:
                partial(D, accs, vb, R, NUT, b, ty, tx, u, tx % LP, checked, j0, j1)
            else:
                if tx % LP == 0:
                    for lane in range(LP):
                        partial(D, accs, vb, R, NUT, b, ty, tx, u, lane, checked, j0, j1)

    @T.macro
    def loads(D, accs, vb, R, NUT, b, ty, tx, j0, j1):
        if (b + 1) * UPB <= NUT and ((b + 1) * UPB - 1) // NU * mr + mr <= R:
            units(D, accs, vb, R, NUT, b, ty, tx, False, j0, j1)
        else:
            units(D, accs, vb, R, NUT, b, ty, tx, True, j0, j1)

    @T.macro
    def unit_or(accs):
        # OR each of the lane's flags over its unit's LP lanes (a no-op on the CPU, whose leader
        # lane ran them all)
        if gpu:
            for q in T.unroll(U * TPV):
                for s in T.unroll(LOG_LP):
                    accs[q] = T.bitwise_or(
                        accs[q],
                        T.tvm_warp_shuffle_xor(T.uint32(FULL_MASK), accs[q], T.shift_right(LP // 2, s), 32, 32),
                    )

    @T.macro
    def lane_flags(D, accs, vb, R, NUT, b, ty, tx):
        # accs[u * TPV + j] != 0 iff tile j of this lane's unit u is non-zero (valid in the unit's
        # leader lane, tx % LP == 0, after the in-warp OR)
        for q in T.unroll(U * TPV):
            accs[q] = 0
        if EARLY > 0:
            # one tile per lane: a non-zero among its first EARLY loads settles it
            loads(D, accs, vb, R, NUT, b, ty, tx, 0, EARLY)
            unit_or(accs)
            if accs[0] == 0:
                loads(D, accs, vb, R, NUT, b, ty, tx, EARLY, LOADS)
        else:
            loads(D, accs, vb, R, NUT, b, ty, tx, 0, LOADS)
        # (again after the branch, not in it: a warp's units may take different ways, and the
        # shuffles need every lane of the warp)
        unit_or(accs)

    @T.macro
    def flags(D, FL, CNT, R, NUT, flat):
        # flat(un, j, R) -> flat id of tile j of unit un
        for b in BX(T.max((NUT + (UPB - 1)) // UPB, 1)):
            sT = T.alloc_buffer((WPB * 32,), "int32", scope=SH)
            sW = T.alloc_buffer((WPB,), "int32", scope=SH)
            for ty in TY(WPB):
                for tx in TX(32):
                    accs = T.alloc_buffer((U * TPV,), "int32", scope="local")
                    vb = T.alloc_buffer((VEC,), dtype, scope="local")
                    cnt = T.alloc_buffer((1,), "int32", scope="local")
                    lane_flags(D, accs, vb, R, NUT, b, ty, tx)
                    cnt[0] = 0
                    for u in T.unroll(U):
                        if tx % LP == 0 and b * UPB + (ty * U + u) * TPW + tx // LP < NUT:
                            for j in T.unroll(TPV):
                                FL[flat(b * UPB + (ty * U + u) * TPW + tx // LP, j, R)] = T.Cast(
                                    "int8", T.Select(accs[u * TPV + j] != 0, 1, 0)
                                )
                                cnt[0] = cnt[0] + T.Select(accs[u * TPV + j] != 0, 1, 0)
                    if row_major_flat:
                        if gpu:
                            for s in T.unroll(5):
                                cnt[0] = cnt[0] + T.tvm_warp_shuffle_xor(
                                    T.uint32(FULL_MASK), cnt[0], T.shift_right(16, s), 32, 32
                                )
                            if tx == 0:
                                sW[ty] = cnt[0]
                        else:
                            sT[ty * 32 + tx] = cnt[0]
            if row_major_flat:
                if not gpu:
                    for ty in TY(WPB):
                        for tx in TX(32):
                            if tx == 0:
                                sW[ty] = 0
                                for j in range(32):
                                    sW[ty] = sW[ty] + sT[ty * 32 + j]
                for ty in TY(WPB):
                    for tx in TX(32):
                        if ty == 0 and tx == 0:
                            tot = T.alloc_buffer((1,), "int32", scope="local")
                            tot[0] = 0
                            for w in T.unroll(WPB):
                                tot[0] = tot[0] + sW[w]
                            CNT[b] = tot[0]  # CNT has max(#CTAs, 1) entries, like the grid

    def lane_unit_in_range(b, ty, tx, u, NUT):
        """this lane leads unit u of its warp (one tile-row per unit: TPV == 1) and it exists"""
        return T.And(tx % LP == 0, b * UPB + (ty * U + u) * TPW + tx // LP < NUT)

    @T.macro
    def fetch_add(ST, v, old):
        # old[0] = ST[0]; ST[0] += v: atomically on the GPU; the CPU emulation runs CTAs in order
        if gpu:
            old[0] = T.cuda.atomic_add(T.address_of(ST[0]), v)
        else:
            old[0] = ST[0]
            ST[0] = ST[0] + v

    @T.macro
    def list_units(D, ST, OFF, IDS, R, NUT):
        # One tile column (unit = tile-row = flat id): flags and listing in one kernel.  The
        # CTA counts its listed and unlisted units (warp scans), then one atomic add of
        # listed + units * UNITS_SCALE on ST[0] returns both sums over the CTAs that added before
        # it: its listed ids go from the front of IDS (at listed-before), its unlisted ones from
        # the back (at units-before - listed-before).  The CTA whose add completes the units is the
        # last one: it writes the count and zeroes ST for the next call.  The ids come out in
        # the order the CTAs add, which the consumers (permutation-invariant kernels) ignore.
        for b in CTA(T.max((NUT + (UPB - 1)) // UPB, 1)):
            sF = T.alloc_buffer((WPB * 32,), "int32", scope=SH)    # lane's listed units (bit u)
            sPc = T.alloc_buffer((WPB * 32,), "int32", scope=SH)   # listed before the lane, in its warp
            sPz = T.alloc_buffer((WPB * 32,), "int32", scope=SH)   # unlisted before the lane
            sWc = T.alloc_buffer((WPB,), "int32", scope=SH)        # warp totals
            sWz = T.alloc_buffer((WPB,), "int32", scope=SH)
            sOc = T.alloc_buffer((WPB,), "int32", scope=SH)        # warp offsets (+ the CTA's base)
            sOz = T.alloc_buffer((WPB,), "int32", scope=SH)
            for ty in TY(WPB):
                for tx in TX(32):
                    accs = T.alloc_buffer((U * TPV,), "int32", scope="local")
                    vb = T.alloc_buffer((VEC,), dtype, scope="local")
                    f = T.alloc_buffer((3,), "int32", scope="local")   # listed bits, listed, unlisted
                    lane_flags(D, accs, vb, R, NUT, b, ty, tx)
                    for q in T.unroll(3):
                        f[q] = 0
                    for u in T.unroll(U):
                        if lane_unit_in_range(b, ty, tx, u, NUT):
                            if accs[u] != 0:
                                f[0] = T.bitwise_or(f[0], T.shift_left(1, u))
                                f[1] = f[1] + 1
                            else:
                                f[2] = f[2] + 1
                    sF[ty * 32 + tx] = f[0]
                    if gpu:
                        inc = T.alloc_buffer((2,), "int32", scope="local")
                        inc[0] = f[1]
                        inc[1] = f[2]
                        for s in T.unroll(5):
                            up = T.alloc_buffer((2,), "int32", scope="local")
                            up[0] = T.tvm_warp_shuffle_up(T.uint32(FULL_MASK), inc[0], T.shift_left(1, s), 32, 32)
                            up[1] = T.tvm_warp_shuffle_up(T.uint32(FULL_MASK), inc[1], T.shift_left(1, s), 32, 32)
                            if tx >= T.shift_left(1, s):
                                inc[0] = inc[0] + up[0]
                                inc[1] = inc[1] + up[1]
                        sPc[ty * 32 + tx] = inc[0] - f[1]
                        sPz[ty * 32 + tx] = inc[1] - f[2]
                        if tx == 31:
                            sWc[ty] = inc[0]
                            sWz[ty] = inc[1]
                    else:
                        sPc[ty * 32 + tx] = f[1]
                        sPz[ty * 32 + tx] = f[2]
            if not gpu:
                for ty in TY(WPB):
                    for tx in TX(32):
                        if tx == 0:
                            sWc[ty] = 0
                            sWz[ty] = 0
                            for j in range(32):
                                run = T.alloc_buffer((2,), "int32", scope="local")
                                run[0] = sPc[ty * 32 + j]
                                run[1] = sPz[ty * 32 + j]
                                sPc[ty * 32 + j] = sWc[ty]
                                sPz[ty * 32 + j] = sWz[ty]
                                sWc[ty] = sWc[ty] + run[0]
                                sWz[ty] = sWz[ty] + run[1]
            for ty in TY(WPB):
                for tx in TX(32):
                    if ty == 0 and tx == 0:
                        tot = T.alloc_buffer((2,), "int32", scope="local")   # listed, unlisted
                        ex = T.alloc_buffer((2 * WPB,), "int32", scope="local")   # warp offsets
                        tot[0] = 0
                        tot[1] = 0
                        for w in T.unroll(WPB):
                            ex[w] = tot[0]
                            ex[WPB + w] = tot[1]
                            tot[0] = tot[0] + sWc[w]
                            tot[1] = tot[1] + sWz[w]
                        old = T.alloc_buffer((1,), STATE_DTYPE, scope="local")
                        fetch_add(ST, state_add(tot[0], tot[0] + tot[1]), old)
                        base = T.alloc_buffer((2,), "int32", scope="local")   # listed, units before
                        base[1] = T.Cast("int32", state_units(old[0]))
                        base[0] = state_listed(old[0])
                        for w in T.unroll(WPB):
                            sOc[w] = ex[w] + base[0]
                            sOz[w] = ex[WPB + w] + base[1] - base[0]
                        if base[1] + tot[0] + tot[1] == T.Cast("int32", NUT):
                            ST[0] = T.float64(0)   # every CTA has added: zero for the next call
                            OFF[0] = 0
                            OFF[1] = base[0] + tot[0]
                            if thr is not None:
                                # the dense fallback: the ids already list every unit
                                if over_threshold(base[0] + tot[0], NUT):
                                    OFF[1] = T.Cast("int32", NUT)
            for ty in TY(WPB):
                for tx in TX(32):
                    pos = T.alloc_buffer((3,), "int32", scope="local")   # listed, unlisted, bits
                    pos[0] = sOc[ty] + sPc[ty * 32 + tx]
                    pos[1] = sOz[ty] + sPz[ty * 32 + tx]
                    pos[2] = sF[ty * 32 + tx]
                    for u in T.unroll(U):
                        if lane_unit_in_range(b, ty, tx, u, NUT):
                            if T.bitwise_and(T.shift_right(pos[2], u), 1) != 0:
                                IDS[pos[0]] = T.Cast("int32", b * UPB + (ty * U + u) * TPW + tx // LP)
                                pos[0] = pos[0] + 1
                            else:
                                IDS[T.Cast("int32", NUT) - 1 - pos[1]] = T.Cast(
                                    "int32", b * UPB + (ty * U + u) * TPW + tx // LP)
                                pos[1] = pos[1] + 1

    @T.macro
    def block_reduce2(sA, sB):
        for step in T.unroll(LOG_NTC):
            for tx in TX(NTC):
                if tx < T.shift_right(NTC // 2, step):
                    sA[tx] = sA[tx] + sA[tx + T.shift_right(NTC // 2, step)]
                    sB[tx] = sB[tx] + sB[tx + T.shift_right(NTC // 2, step)]

    block_scan = make_block_scan(st)   # one CTA of NTC == NT threads

    @T.macro
    def count(FL, NF, CNT):
        # CNT[c] = set flags among flat ids [c*CHC, (c+1)*CHC) (when flags could not count)
        for c in BX(T.max((NF + (CHC - 1)) // CHC, 1)):
            sA = T.alloc_buffer((NTC,), "int32", scope=SH)
            sB = T.alloc_buffer((NTC,), "int32", scope=SH)
            for tx in TX(NTC):
                acc = T.alloc_buffer((1,), "int32", scope="local")
                acc[0] = 0
                for k in range(K):
                    if c * CHC + k * NTC + tx < NF:
                        acc[0] = acc[0] + T.Cast("int32", FL[c * CHC + k * NTC + tx])
                sA[tx] = acc[0]
                sB[tx] = 0
            block_reduce2(sA, sB)
            for tx in TX(NTC):
                if tx == 0:
                    CNT[c] = sA[0]

    fb_c = FB if row_major_flat else 1

    def fl_at(tx, k):
        """index of thread tx's k-th flag in the compaction's local copy"""
        return k if gpu else tx * K + k

    @T.macro
    def compact(FL, NF, P, G, CNT, NB, OFF, IDS):
        # NB: entries of CNT; CTA c covers CNT[c*fb_c : (c+1)*fb_c] = flat ids [c*CHC, (c+1)*CHC)
        for c in BX(T.max((NF + (CHC - 1)) // CHC, 1)):
            sP = T.alloc_buffer((NTC,), "int32", scope=SH)
            sQ = T.alloc_buffer((NTC,), "int32", scope=SH)
            sA = T.alloc_buffer((NTC,), "int32", scope=SH)
            sB = T.alloc_buffer((NTC,), "int32", scope=SH)
            # (a register array per thread on CUDA; on the CPU the serial "threads" need one each)
            fl = T.alloc_buffer((K if gpu else NTC * K,), "int8", scope="local")
            for tx in TX(NTC):
                p = T.alloc_buffer((1,), "int32", scope="local")
                q = T.alloc_buffer((1,), "int32", scope="local")
                p[0] = 0
                q[0] = 0
                for j in range((NB + (NTC - 1)) // NTC):
                    if j * NTC + tx < NB:
                        q[0] = q[0] + CNT[j * NTC + tx]
                        if j * NTC + tx < c * fb_c:
                            p[0] = p[0] + CNT[j * NTC + tx]
                sP[tx] = p[0]
                sQ[tx] = q[0]
                # this thread's K flags, read once as 16-byte vectors (FL is allocated in whole
                # chunks; flags past NF are masked below)
                for h in range(K // FL_VEC):
                    for e in T.vectorized(FL_VEC):
                        fl[fl_at(tx, h * FL_VEC + e)] = FL[c * CHC + tx * K + h * FL_VEC + e]
                acc = T.alloc_buffer((1,), "int32", scope="local")
                acc[0] = 0
                for k in T.unroll(K):
                    if c * CHC + tx * K + k < NF:
                        acc[0] = acc[0] + T.Cast("int32", fl[fl_at(tx, k)])
                sA[tx] = acc[0]
            block_reduce2(sP, sQ)
            block_scan(sA, sB)
            for tx in TX(NTC):
                dense = T.alloc_buffer((1,), "int32", scope="local")
                total = T.alloc_buffer((1,), "int32", scope="local")
                total[0] = sQ[0]  # (a shared load may not sit in a branch condition)
                dense[0] = 0
                if thr is not None:
                    if over_threshold(total[0], NF):
                        dense[0] = 1
                if dense[0] == 1:
                    for k in range(K):
                        if c * CHC + k * NTC + tx < NF:
                            IDS[c * CHC + k * NTC + tx] = T.Cast("int32", T.truncmod(c * CHC + k * NTC + tx, P))
                            if T.truncmod(c * CHC + k * NTC + tx, P) == 0:
                                OFF[T.truncdiv(c * CHC + k * NTC + tx, P)] = T.Cast("int32", c * CHC + k * NTC + tx)
                else:
                    pos = T.alloc_buffer((1,), "int32", scope="local")
                    pos[0] = sP[0]
                    if tx > 0:
                        pos[0] = pos[0] + sA[tx - 1]
                    for k in T.unroll(K):
                        if c * CHC + tx * K + k < NF:
                            if T.truncmod(c * CHC + tx * K + k, P) == 0:
                                OFF[T.truncdiv(c * CHC + tx * K + k, P)] = pos[0]
                            if fl[fl_at(tx, k)] != T.int8(0):
                                IDS[pos[0]] = T.Cast("int32", T.truncmod(c * CHC + tx * K + k, P))
                                pos[0] = pos[0] + 1
                            elif complement:
                                # flat id f is the (f - pos)-th unflagged one
                                IDS[total[0] + T.Cast("int32", c * CHC + tx * K + k) - pos[0]] = T.Cast(
                                    "int32", T.truncmod(c * CHC + tx * K + k, P))
                    if not complement:
                        for k in range(K):
                            if c * CHC + k * NTC + tx < NF:
                                if c * CHC + k * NTC + tx >= T.Cast("int64", total[0]):
                                    IDS[c * CHC + k * NTC + tx] = -1
                if c == 0:
                    if tx == 0:
                        if dense[0] == 1:
                            OFF[G] = T.Cast("int32", NF)
                        else:
                            OFF[G] = total[0]
                    if NF == 0:
                        # nothing to scan (e.g. zero rows): every group pointer is 0
                        for j in range((G + (NTC - 1)) // NTC):
                            if j * NTC + tx < G:
                                OFF[j * NTC + tx] = 0

    return g, NU, flags, count, compact, list_units
