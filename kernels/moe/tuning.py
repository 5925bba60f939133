"""When experts_forward takes the fused small-batch kernel (small_batch.py), and with which chunk of the
intermediate dimension; None sends a call down the grouped-matmul path.

The small-batch kernel multiplies every touched expert by all T tokens, so it wins while that extra MXU work hides
under the weights' DMA: the routing ops it removes cost a fixed ~20 us, and its MXU work grows with T.
SMALL_BATCH_MAX_TOKENS is the largest decode batch where it is faster than the grouped path at both benchmark
models (modeled, benchmarks/ops/moe.py: Qwen3-30B-A3B and Gemma 4 26B-A4B shapes, random top-8 of 128, bf16):
v6e wins at every batch up to 256 (B = 256: 98.9 / 99.0 % of the HBM roofline vs 84.5 / 84.9 %; at 512 it loses,
81.2 / 56.9 % vs 84.8 / 83.1 %: the MXU work on unrouted tokens no longer hides under the DMA); v5e up to 128
(97.6 / 98.0 % vs 90.4 / 88.3 %; at 256 its slower MXU makes it lose, 82.2 / 58.2 % vs 83.2 / 80.8 %); v7x up to
64 (at 128 it is 80.8 / 80.4 % vs 79.1 / 81.2 %: a draw).

The chunk tc: the largest legal one whose weight blocks (gate, up and down columns of the chunk) stay within
STEP_BYTES. The first block's DMA has nothing to overlap with and is paid in full, so blocks should not be large;
but narrow chunks use the MXU badly (Gemma 4's I = 704 in chunks of 88 columns: 89 % of the roofline at B = 64,
in chunks of 176: 98 %; modeled v6e). 4 MiB gives 256-column chunks for Qwen3 (2048 hidden) and 176 for Gemma 4.
"""

import dataclasses

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from ..common import chip
from ..ragged_dot import tuning as ragged_dot_tuning
from .small_batch import WeightStream

SMALL_BATCH_MAX_TOKENS = {"v5e": 128, "v6e": 256, "v7x": 64}
# touched.py builds [E, E] matrices in VMEM: E = 4096 overflows v7x's scoped VMEM; 1024 compiles everywhere (test).
SMALL_BATCH_MAX_EXPERTS = 1024
STEP_BYTES = 4 << 20
VMEM_SHARE = 0.35
F32_TEMPORARIES = 3


@dataclasses.dataclass(frozen=True)
class SmallBatchPlan:
    swap_gate_up: bool  # read gate_up through swapaxes(1, 2): its stored orientation
    swap_down: bool
    up_streams: tuple[WeightStream, ...]
    down_i_axis: int
    tc: int
    vmem_limit_bytes: int


def _stored_i_axis(shape, logical_i_axis):
    swapped = ragged_dot_tuning.stored_minor_to_major_swapped(shape[1], shape[2])
    return (3 - logical_i_axis if swapped else logical_i_axis), swapped


def _legal(tc: int, i_axis: int, dim: int, sublanes: int) -> bool:
    if tc == dim:
        return True
    return tc % (128 if i_axis == 2 else sublanes) == 0


def plan_small_batch(
    tokens: int,
    hidden: int,
    intermediate: int,
    *,
    gate_up_shape,
    down_shape,
    weights_transposed: bool,
    gate_layout,
    has_gate_up_bias: bool,
    hidden_dtype,
    weight_dtype,
    down_dtype=None,
    info: pltpu.TpuInfo | None = None,
) -> SmallBatchPlan | None:
    info = info or chip.current_tpu_info()
    gen = chip.generation_name(info)
    if tokens == 0 or tokens > SMALL_BATCH_MAX_TOKENS.get(gen, 8) or gate_layout not in ("concatenated", None):
        return None
    if gate_up_shape[0] > SMALL_BATCH_MAX_EXPERTS:
        return None
    up_axis, swap_up = _stored_i_axis(gate_up_shape, 2 if weights_transposed else 1)
    down_axis, swap_down = _stored_i_axis(down_shape, 1 if weights_transposed else 2)
    n_up = 2 * intermediate if gate_layout else intermediate
    down_dtype = weight_dtype if down_dtype is None else down_dtype
    sub = max(ragged_dot_tuning.sublane_multiple(weight_dtype), ragged_dot_tuning.sublane_multiple(down_dtype))
    streams = 2 if gate_layout else 1
    wb = max(jnp.dtype(weight_dtype).itemsize, jnp.dtype(down_dtype).itemsize)
    hb = jnp.dtype(hidden_dtype).itemsize

    def legal(tc):
        ok = _legal(tc, up_axis, n_up, sub) and _legal(tc, down_axis, intermediate, sub)
        if has_gate_up_bias:
            ok = ok and _legal(tc, 2, n_up, sub)  # bias blocks (1, tc): lanes
        return ok

    options = [tc for tc in range(intermediate, 0, -1) if intermediate % tc == 0 and legal(tc)]
    if not options:
        return None

    def step_bytes(tc):
        return (streams + 1) * tc * hidden * wb

    fitting = [tc for tc in options if step_bytes(tc) <= STEP_BYTES]
    tc = fitting[0] if fitting else options[-1]
    working_set = (
        2 * step_bytes(tc)
        + 4 * tokens * hidden * hb
        + tokens * hidden * 4
        + F32_TEMPORARIES * tokens * (tc * streams + hidden) * 4
    )
    budget = int(info.vmem_capacity_bytes * VMEM_SHARE)
    if working_set > budget:
        return None
    up_streams = (
        (WeightStream(up_axis, 0), WeightStream(up_axis, intermediate // tc))
        if gate_layout
        else (WeightStream(up_axis, 0),)
    )
    limit = chip.scoped_vmem_limit(info, working_set, ragged_dot_tuning.VMEM_SLACK_BYTES)
    return SmallBatchPlan(
        swap_gate_up=swap_up,
        swap_down=swap_down,
        up_streams=up_streams,
        down_i_axis=down_axis,
        tc=tc,
        vmem_limit_bytes=limit,
    )
