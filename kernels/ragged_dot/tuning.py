"""Block sizes (tm, tk, tn) for the ragged-dot kernels, per TPU generation.

How the kernels use them (see kernel.py): the forward grid is (n tiles, visits, k tiles), a visit being one
(m tile, group) pair, so the weight block of a group, (tk, tn), is re-used by consecutive visits of that group when
tk covers all of K (its block index does not change, so the pipeline does not refetch it). Hence:

- tk = K whenever (K, tn) weight blocks fit the VMEM budget for some tn: the weights are then read from HBM once per
  n tile per group, never once per m tile, which is what decode needs (it is a stream of expert weights at HBM speed).
- tn as wide as the budget allows (up to TN_MAX): each step moves a big weight block (a few MiB), which hides the
  fixed per-step cost, and lhs is re-read once per n tile, so fewer n tiles means less lhs traffic in prefill.
- tm trades MXU work against masking waste. A tile that straddles a group boundary is computed once per group, so
  the MXU does about (1 + groups * tm / M) times the useful work; tm is the largest power of two with
  tm <= M / (2 * groups), clamped to [TM_MIN, TM_MAX]; when M fits in one tile, tm = M. The floor TM_MIN = 128
  exists because each visit pushes a whole weight block through the MXU whatever its row count (see choose_tm);
  weights read transposed have a floor of 256 on v6e/v7x (TM_MIN_TRANSPOSED: the block's transpose must hide).

The working set (double-buffered lhs, weight and output blocks, the f32 accumulator and the body's f32 temporaries)
must fit VMEM_SHARE of the core's VMEM; tk shrinks first (to a divisor of K that is a multiple of 128), then tn.
Every entry is meant to be proven by the deviceless compile check at the benchmark shapes on v5e, v6e and v7x.
"""

import dataclasses

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import chip

# Upper bounds per generation. v5e's MXUs are 128 wide and its HBM half as fast, so its blocks are smaller.
TM_MAX = {"v5e": 256, "v6e": 512, "v7x": 512}
TN_MAX = {"v5e": 1024, "v6e": 2048, "v7x": 2048}
TK_MAX = {"v5e": 4096, "v6e": 8192, "v7x": 8192}
TM_MIN = 128
# Floor for weights read transposed ([N, K] blocks: transformers' layout), where each step also transposes its weight
# block for the MXU. At 128 rows that work shows (modeled v6e, M = 32768, K 2048, N 1536: 3846 cycles a step against
# 2305 for the same block read [K, N]); at 256 rows it hides under the MXU's own (4110 vs 4036), and Qwen3's
# prefill gate/up models 834 us against 1083 at 128 rows. Blocks read [K, N] keep TM_MIN: their straddling tiles
# cost more than the larger tile saves (Gemma 4's down, stored [E, 704, 2816]: 7-12 % slower at 256).
TM_MIN_TRANSPOSED = {"v5e": 128, "v6e": 256, "v7x": 256}
# Share of the core's VMEM the working set may use (v7x has 64 MiB per core, v5e/v6e 128 MiB).
VMEM_SHARE = {"v5e": 0.35, "v6e": 0.35, "v7x": 0.4}
# Scoped VMEM these kernels (and the MoE small-batch kernel) ask for beyond their working set's 50 % headroom.
VMEM_SLACK_BYTES = 2 << 20
# f32 (tm, tn) temporaries live in the kernel body besides the accumulator (dot result, epilogue values).
F32_TEMPORARIES = 3


@dataclasses.dataclass(frozen=True)
class RaggedDotBlocks:
    tm: int
    tk: int
    tn: int
    vmem_limit_bytes: int


@dataclasses.dataclass(frozen=True)
class TransposedBlocks:
    """Blocks of the transposed grouped matmul (the rhs gradient): out[g] = a[rows of g]^T @ b[rows of g]."""

    tm: int  # rows of a and b per visit (the contraction)
    tp: int  # columns of a per output block
    tq: int  # columns of b per output block
    vmem_limit_bytes: int


def sublane_multiple(dtype) -> int:
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def _tile_options(dim: int, cap: int, multiple: int, *, prefer_divisors: bool) -> list[int]:
    """Legal tile sizes for a dimension, best first: the full dim if <= cap, then (unless prefer_divisors) the
    balanced split (equal tiles rounded up to `multiple`, the last one partial), then divisors that are multiples of
    `multiple`. A partial last block is harmless along N (columns past N are never written) and masked along K."""
    out = [dim] if dim <= cap else []
    # Balanced splits into 1, 2, 3, ... tiles (so a VMEM-bound choice shrinks gradually, not to one lane tile).
    balanced = sorted(
        {max(multiple, pl.cdiv(pl.cdiv(dim, c), multiple) * multiple) for c in range(max(1, pl.cdiv(dim, cap)), 17)},
        reverse=True,
    )
    balanced = [t for t in balanced if t <= cap and t < dim]
    divisors = [t for t in range(min(cap, dim) // multiple * multiple, 0, -multiple) if dim % t == 0 and t != dim]
    if prefer_divisors:
        out += divisors or balanced
    else:
        out += sorted(set(balanced) | set(divisors), reverse=True)
    return list(dict.fromkeys(out)) or [multiple]


def _generation(info):
    g = chip.generation_name(info)
    return g if g in TM_MAX else "v6e"


def _padded_tiles(sublane_dim: int, lane_dim: int) -> int:
    return pl.cdiv(sublane_dim, 8) * 8 * pl.cdiv(lane_dim, 128) * 128


def stored_minor_to_major_swapped(rows: int, cols: int) -> bool:
    """Whether XLA on TPU stores a [..., rows, cols] array with `rows` as its minor (lane) dimension.

    Its default layout tiles the last two dimensions by (8, 128) and puts whichever of them pads less on the lanes:
    a [E, 2816, 704] weight (Gemma 4's down_proj) is stored as [E, 704, 2816], because 704 is not a multiple of 128
    and 2816 is. A Mosaic kernel reads its operands in the logical row-major layout, so handing it such a weight as
    is makes XLA relayout the whole tensor on every call; reading its transpose instead is a free bitcast. Ties keep
    the logical layout. (tests/test_ragged_dot.py checks this rule against the compiler's choice.)
    """
    return _padded_tiles(cols, rows) < _padded_tiles(rows, cols)


def choose_tm(m: int, num_groups: int, dtype, generation: str, rhs_transposed: bool = False) -> int:
    sub = sublane_multiple(dtype)
    tm = _pow2_floor(max(1, m // max(1, 2 * num_groups)))
    # At least TM_MIN rows: every visit pushes its group's whole weight block through the MXU, which costs the same
    # for 16 rows as for 128, so small tiles multiply that cost by the visits (tiles + groups - 1) while the masked
    # rows they save are nearly free. Modeled v6e (random top-8 of 128 experts), with the floor against the M / (2 *
    # groups) rule alone: decode B = 256 at 90-93 % of the HBM roofline against 62-67 %, B = 64 97-98 % against
    # 88-90 %, prefill M = 4096 83-89 % against 49-56 %.
    floor = max(TM_MIN, TM_MIN_TRANSPOSED.get(generation, TM_MIN)) if rhs_transposed else TM_MIN
    tm = max(sub, floor, min(TM_MAX[generation], tm))
    return m if m <= tm else tm


def choose_blocks(
    m: int,
    k: int,
    n: int,
    *,
    num_groups: int,
    lhs_dtype,
    rhs_dtype,
    out_dtype,
    rhs_transposed: bool,
    gated: bool = False,
    half_n: int | None = None,
    info: pltpu.TpuInfo | None = None,
) -> RaggedDotBlocks:
    """Blocks for the forward kernel (and the lhs-gradient kernel, which is the forward with rhs transposed).

    n is the width of the output. With `gated`, rhs has 2 * n columns and the gate/up blocks are tn wide each; for
    the concatenated layout tn must divide n (`half_n`), so the up block sits at a whole block index.
    """
    info = info or chip.current_tpu_info()
    gen = _generation(info)
    tm = choose_tm(m, num_groups, lhs_dtype, gen, rhs_transposed)
    lb, rb, ob = (jnp.dtype(d).itemsize for d in (lhs_dtype, rhs_dtype, out_dtype))
    # In the transposed layout tn is the weight block's second-minor dim (sublanes); the output block is (tm, tn)
    # either way, so tn is a multiple of 128 or all of n.
    n_multiple = 128
    budget = int(info.vmem_capacity_bytes * VMEM_SHARE[gen])
    streams = 2 if gated else 1

    def working_set(tk, tn):
        single_k = tk >= k
        ws = 2 * tm * tk * lb + 2 * streams * tk * tn * rb + 2 * tm * tn * ob
        ws += (0 if single_k else streams * tm * tn * 4) + F32_TEMPORARIES * streams * tm * tn * 4
        return ws

    tn_options = _tile_options(n, TN_MAX[gen], n_multiple, prefer_divisors=False)
    if gated and half_n is not None:
        tn_options = [t for t in tn_options if n % t == 0] or [n]
    tk_options = _tile_options(k, TK_MAX[gen], 128, prefer_divisors=True)
    # tk = K first: it lets consecutive visits of a group share the weight block (no refetch per m tile).
    for tk in tk_options:
        for tn in tn_options:
            if working_set(tk, tn) <= budget:
                return _blocks(tm, tk, tn, working_set(tk, tn), info)
    tn, tk = tn_options[-1], tk_options[-1]
    return _blocks(tm, tk, tn, working_set(tk, tn), info)


def _blocks(tm, tk, tn, ws, info):
    limit = chip.scoped_vmem_limit(info, ws, VMEM_SLACK_BYTES)
    return RaggedDotBlocks(tm=tm, tk=tk, tn=tn, vmem_limit_bytes=limit)


def choose_transposed_blocks(
    m: int, p: int, q: int, *, num_groups: int, a_dtype, b_dtype, out_dtype, info: pltpu.TpuInfo | None = None
) -> TransposedBlocks:
    """Blocks for out[g] (p, q) = a[rows]^T (p, tm) @ b[rows] (tm, q): tm rows per visit, (tp, tq) output blocks.

    Here tm is a contraction length: the larger the better, bounded by the masking waste as in the forward.
    """
    info = info or chip.current_tpu_info()
    gen = _generation(info)
    ab, bb, ob = (jnp.dtype(d).itemsize for d in (a_dtype, b_dtype, out_dtype))
    sub = max(sublane_multiple(a_dtype), sublane_multiple(b_dtype))
    tm = _pow2_floor(max(1, m // max(1, 2 * num_groups)))
    tm = max(128 if m >= 128 else sub, min(TM_MAX[gen], tm))
    tm = m if m <= tm else tm
    budget = int(info.vmem_capacity_bytes * VMEM_SHARE[gen])

    def working_set(tp, tq):
        return 2 * tm * tp * ab + 2 * tm * tq * bb + 2 * tp * tq * ob + (1 + F32_TEMPORARIES) * tp * tq * 4

    tp_options = _tile_options(p, 1024, 128, prefer_divisors=False)
    tq_options = _tile_options(q, 1024, 128, prefer_divisors=False)
    for tp in tp_options:
        for tq in tq_options:
            if working_set(tp, tq) <= budget:
                limit = chip.scoped_vmem_limit(info, working_set(tp, tq), VMEM_SLACK_BYTES)
                return TransposedBlocks(tm=tm, tp=tp, tq=tq, vmem_limit_bytes=limit)
    tp, tq = tp_options[-1], tq_options[-1]
    limit = chip.scoped_vmem_limit(info, working_set(tp, tq), VMEM_SLACK_BYTES)
    return TransposedBlocks(tm=tm, tp=tp, tq=tq, vmem_limit_bytes=limit)
