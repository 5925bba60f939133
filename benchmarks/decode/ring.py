"""Analytic time of the expert-parallel all-reduce over the v6e-8's ICI: XLA's compiled collectives carry no cycle
estimate (and its cost analysis charges them as HBM traffic), so the step composes this model instead.

Bidirectional ring all-reduce over n chips (the 2x4 torus holds a ring through all 8): each half of the message goes
round one direction, reduce-scatter then all-gather, 2 (n - 1) steps; every step moves 1/n of its half over one link
direction. Bandwidth: the published v6e ICI figure, 800 GB/s bidirectional per chip over 4 ports, i.e. 100 GB/s
per port and direction. Latency: ASSUMED, a fixed cost per ring step (no public v6e figure); a command-line option.
"""

from __future__ import annotations

ICI_CHIP_BIDIRECTIONAL_BYTES_PER_S = 800e9
ICI_PORTS = 4
LINK_BYTES_PER_S = ICI_CHIP_BIDIRECTIONAL_BYTES_PER_S / ICI_PORTS / 2  # one port, one direction
STEP_LATENCY_S = 1.0e-6  # ASSUMED per ring step


def all_reduce_s(nbytes: int, chips: int, *, step_latency_s: float = STEP_LATENCY_S) -> float:
    """Seconds for an all-reduce of `nbytes` (the message each chip holds) over `chips` chips in a ring."""
    if chips <= 1:
        return 0.0
    steps = 2 * (chips - 1)
    per_step_bytes = nbytes / 2 / chips  # each direction carries half the message, 1/n of it a step
    return steps * (step_latency_s + per_step_bytes / LINK_BYTES_PER_S)
