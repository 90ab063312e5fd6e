"""PIT rule analysis: which axes of a TensorIR block are permutation invariant.

See :mod:`pit_tvm.rules.analysis` for the rules and the reasons an axis is rejected.
"""
from .analysis import AxisAccess, PitRule, find_pit_rules, format_rules

__all__ = ["AxisAccess", "PitRule", "find_pit_rules", "format_rules"]
