"""The Hopper (sm_90a) kernels written in TIRx, assembled from small named pieces.

Pieces shared by the GEMMs, the strips index and fused attention:

- :mod:`.config`: tile constants, :class:`~.config.WgmmaConfig`, the kernels' thread roles
- :mod:`.planner`: which kernel takes a shape, the tile-width cost model, the few-rows tiers
- :mod:`.smem`: shared-memory swizzles, wgmma matrix descriptors, TMA tensor maps
- :mod:`.barriers`: named barriers (``bar.sync`` ids) and thread exit
- :mod:`.ring`: the full / empty mbarrier ring between a loader and the consumer warpgroups
- :mod:`.epilogue`: GELU (erf form) and the accumulator -> output epilogue
- :mod:`.lowering`: TIRx -> plain TIR, with programmatic dependent launch (:mod:`.dependent_launch`)
- :mod:`.strips`: the strips listing's state words and the strip-closing step

Kernels: :mod:`.gemm` (the rows / dense / tiles GEMMs' entry points, bodies in
:mod:`.gemm_body`), :mod:`.compact_a` (thin micro-tiles' A gather);
:mod:`pit_tvm.schedules.wgmma_strips` and :mod:`pit_tvm.schedules.attention` build on the same
pieces.  Design and measurements: docs/design/hopper_kernels.md.
"""
