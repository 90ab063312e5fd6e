"""Peer implementations the GPU benchmarks compare PIT against (imported lazily: they need torch/triton)."""
