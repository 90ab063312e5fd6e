"""The Hopper (sm_90a) kernels written in TIRx, assembled from small named pieces.

Pieces shared by the GEMMs, the strips index and fused attention:

- :mod:`.config`: tile constants, :class:`~.config.WgmmaConfig`, the kernels' thread roles
- :mod:`.planner`: which kernel takes a shape, the tile-width cost model, the few-rows tiers
- :mod:`.smem`: shared-memory swizzles, wgmma matrix descriptors, TMA tensor maps
- :mod:`.barriers`: named barriers (``bar.sync`` ids) and thread exit
- :mod:`.ring`: the full / empty mbarrier ring between a loader and the consumer warpgroups
- :mod:`.epilogue`: the accumulator -> output epilogue (bias, ReLU / GELU, row scale, residual)
- :mod:`.lowering`: TIRx -> plain TIR, with programmatic dependent launch (:mod:`.dependent_launch`)
- :mod:`.strips`: the strips listing's state words, the strip-closing step, a GEMM epilogue's listing

Kernels, one file per kind, each reading top to bottom: :mod:`.rows` (the rows kind, its
few-rows tiers, the dense GEMM), :mod:`.tiles` (micro-tiles along K, and its dense fallback),
:mod:`.compact_a` (thin micro-tiles' A gather), :mod:`.grouped` (a mixture-of-experts layer's
grouped GEMM, its expert tiles in :mod:`.experts`); the GEMMs share one body, :mod:`.gemm_body`,
with its loaders in :mod:`.loaders`, the tiers' store warpgroup in :mod:`.tiers` and the
tile's buffers and registers in :mod:`.operands`.  :mod:`pit_tvm.schedules.wgmma_strips` and
:mod:`pit_tvm.schedules.attention` build on the same pieces.

Design and measurements: docs/design/hopper_kernels.md.
"""
