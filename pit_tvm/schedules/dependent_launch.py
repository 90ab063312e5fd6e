"""Programmatic dependent launch: moved to :mod:`pit_tvm.schedules.hopper.dependent_launch`
(this path re-exports it)."""
from pit_tvm.schedules.hopper.dependent_launch import ENTRY, PDL_TAG, launches_dependent, with_dependent_launch

__all__ = ["PDL_TAG", "ENTRY", "with_dependent_launch", "launches_dependent"]
