"""The record of one measured reference point."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class MeasuredPoint:
    """A kernel timed on a TPU, and how to rebuild it for the performance model.

    `fn(*args)` is the timed program, picklable by reference (a module-level function or a functools.partial of
    one), with `args` as `perf_model.model_function` takes them (ShapeDtypeStructs, or concrete arrays where values
    decide the work: group sizes). `measured_s` is the source's figure as it stands, in seconds; `dispatch_included`
    says the timing wrapped each call from the host (Python dispatch and launch are in it): such a figure is compared
    with the model's time plus the host's dispatch, estimated from the same source's dispatch-dominated points (those
    out of the fit: measured - modeled there, median), see table.py."""

    family: str  # kernels whose model shares its mechanisms: "pallas_matmul", "xla_matmul", "tokamax_ragged_dot", ...
    name: str  # unique, short: what and at which configuration
    gen: str  # TPU generation it was measured on
    measured_s: float
    source: str  # provenance: document / file, and the cell or key the figure is from
    fn: Callable
    args: tuple[Any, ...]
    in_fit: bool = True  # False: shown in the table, left out of the calibration (the reason goes in `note`)
    dispatch_included: bool = False
    timing: str = ""  # how it was timed; dispatch-included points timed the same way share one dispatch estimate
    note: str = ""
