"""The static shape of one attention call as the kernels see it, and what every kernel body shares: how a step's
heads sit in the lanes of its blocks, the mask of a visit, and the scores with scale and softcap.

Layout. q [Tq, Hq * D], k [Tk, Hkv * D], v [Tk, Hkv * Dv] (flash-attn's [B, S, H, D] and its varlen [T, H, D] viewed
with heads and head dim merged; the forward merges q's heads in registers where it can, forward.heads_in_place).
The query heads of kv head j are Hq / Hkv consecutive heads, so one grid step takes `kv_heads` kv heads and their
query heads as one lane block of each array: every K/V block is read once for all query heads of its group (GQA
without repeating K/V). A lane block must be a multiple of 128 lanes (or all heads), which sets the fewest kv heads
a step can take (two at head dim 64).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from ..common.blocks import LANES

# The running max's start: finite and below any real score, so exp2(-inf - max) = 0 for masked scores and
# exp2(max_before - max_after) stays finite for a row with nothing kept yet.
MAX_INIT = -1e30
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class Geometry:
    q_rows: int
    kv_rows: int
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    block_q: int
    block_kv: int
    kv_heads_per_step: int
    softmax_scale: float
    softcap: float

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.q_heads // self.kv_heads

    @property
    def heads_per_step(self) -> int:
        """Query heads per grid step."""
        return self.kv_heads_per_step * self.group

    @property
    def head_groups(self) -> int:
        """Grid steps along the heads: kv heads / kv heads per step."""
        return self.kv_heads // self.kv_heads_per_step

    @property
    def num_q_blocks(self) -> int:
        return -(-self.q_rows // self.block_q)

    @property
    def num_kv_blocks(self) -> int:
        return -(-self.kv_rows // self.block_kv)


def min_kv_heads_per_step(kv_heads: int, head_dim: int, v_head_dim: int, group: int) -> int:
    """The fewest kv heads per step whose lane blocks (K: n * D, V: n * Dv, Q: n * group * D, out: n * group * Dv)
    are whole multiples of 128 lanes, or all heads (a block equal to the full dimension is always legal)."""
    for n in range(1, kv_heads + 1):
        if kv_heads % n:
            continue
        widths = (n * head_dim, n * v_head_dim)
        if all(w % LANES == 0 for w in widths):
            return n
    return kv_heads


def sanitize_rows(x, block_index, block_rows: int, valid_rows: int):
    """Zero the rows of a ragged last block that lie past the array (their VMEM holds stale data, maybe NaN, and a
    zero weight times NaN is NaN in a matmul). A no-op select when the array is a whole number of blocks."""
    if valid_rows % block_rows == 0:
        return x
    limit = valid_rows - block_index * block_rows
    rows = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.where(rows < limit, x, jnp.zeros_like(x))


def keep_mask(lo, hi, kv_block, block_kv: int, *, transposed: bool = False):
    """The kept scores of a visit: lo <= key row <= hi. lo, hi: (bq, 1) query-row ranges -> (bq, bk); transposed:
    lo, hi (1, bq) -> (bk, bq)."""
    if transposed:
        keys = kv_block * block_kv + jax.lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
    else:
        keys = kv_block * block_kv + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
    return (keys >= lo) & (keys <= hi)


def dot_nt(a, b):
    """a @ b^T in f32 (both row-major blocks: the MXU takes the transposed operand natively)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision)


def dot_nn(a, b):
    """a @ b in f32."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32, precision=precision)


def dot_tn(a, b):
    """a^T @ b in f32 (the compiler transposes a)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32, precision=precision)


def query_scale(geometry: Geometry) -> float:
    """What q is multiplied by before q k^T: softmax_scale / softcap under a softcap (tanh comes first), else
    softmax_scale * log2(e), so that the product is already a log2-unit logit."""
    if geometry.softcap > 0:
        return geometry.softmax_scale / geometry.softcap
    return geometry.softmax_scale * LOG2_E


def log2_scores(raw, geometry: Geometry):
    """Logits in log2 units from the product of the scaled q (query_scale) and k."""
    if geometry.softcap > 0:
        return jnp.tanh(raw) * (geometry.softcap * LOG2_E)
    return raw


def lanes(x, width: int):
    """A lane-replicated (rows, 128) statistic as (rows, width): whole vregs repeated when width is a multiple of
    128 (no lane shuffles), a slice below 128, a broadcast otherwise (small full-dimension blocks only)."""
    if width % LANES == 0:
        return jnp.tile(x, (1, width // LANES))
    if width < LANES:
        return x[:, :width]
    return jnp.broadcast_to(x[:, :1], (x.shape[0], width))


def row_stat(x):
    """A (rows, 1) row reduction as a lane-replicated (rows, 128) statistic."""
    return jnp.broadcast_to(x, (x.shape[0], LANES))
