"""The kernel contract: records, gates, controls, runner, report."""

from .controls import oversize_threadgroup, relaunch, shift_rows, swap, transform_outputs, variant
from .devices import Device, Limits
from .record import EXACT, KINDS, Case, Control, Finding, KernelRecord, Launch, Shape, Source, Tolerance
from .registry import discover
from .report import Report
from .runner import NoMatch, run_contract

__all__ = [
    "Case", "Control", "Device", "EXACT", "Finding", "KINDS", "KernelRecord", "Launch", "Limits", "NoMatch",
    "Report", "Shape", "Source", "Tolerance", "discover", "oversize_threadgroup", "relaunch", "run_contract",
    "shift_rows", "swap", "transform_outputs", "variant",
]
