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
  Where the generation cuts tiles into row chunks (ROW_CHUNKS_PER_TILE), a shared tile costs about its rows once and
  tm <= M / groups instead.

The working set (double-buffered lhs, weight and output blocks, the f32 accumulator and the body's f32 temporaries)
must fit VMEM_SHARE of the core's VMEM; tk shrinks first (to a divisor of K that is a multiple of 128), then tn.
Every entry is meant to be proven by the deviceless compile check at the benchmark shapes on v5e, v6e and v7x.
"""

import dataclasses

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import chip
from ..common.blocks import LANES, check_block_dim, check_vmem_fit, pow2_floor, sublane_multiple

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
# Row chunks of the forward kernel's partial visits (kernel.py): a visit to a tile it shares with other groups
# multiplies only the chunks holding its rows. With random routing most tiles are shared, and each visit multiplied
# the whole tile: Qwen3's gate/up at 32,768 rows took 1,963 us at tm 128 against 1,363 us for the same rows in groups
# that never straddle a tile. The table cuts a tile into ROW_CHUNKS_PER_TILE chunks (0: whole tiles) and, as a
# straddled tile then costs about its rows once, lets tm grow to a group's average rows (choose_tm). Measured on the
# v5e (device time, `--sweep --kernel ragged_dot --full --shape phase=prefill`, Qwen3 / Gemma 4 expert shapes):
# at 32,768 rows whole tiles of 128 take gate/up 1,965 / 2,467 us and down 1,596 / 1,762; tiles of 256 in 4 chunks
# 1,460 / 1,994 and 1,165 / 1,563 (1.21-1.37x); at 131,072 rows (tm 256 either way) 0.99-1.15x whole tiles; at
# 4,096 rows (tm 128) 1.00-1.10x. v6e and v7x stay on whole tiles until measured there (the performance model does
# not time the per-count branches).
ROW_CHUNKS_PER_TILE = {"v5e": 4, "v6e": 0, "v7x": 0}
# One branch per chunk count, each its own unrolled matmul: past a point the kernel's code outgrows the core and every
# visit slows severalfold (measured v5e: 4.6e9 multiply-adds over the branches, Gemma 4's gate/up in 8 chunks of 32
# at tm 256, 7,495 us against 2,269 in 4 chunks of 32 at tm 128; 3.6e9, Qwen3's gate/up in 8 chunks of 32 at tm 256,
# 1,414 us, as fast as any tiling). The table keeps whole tiles past the largest count measured to run well
# (gpt-oss's gate/up, 3.8e9 in 4 chunks of 64 at tm 256, keeps them until measured).
ROW_CHUNK_BRANCH_MACS_MAX = (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8) * 32 * 2048 * (2 * 768)
# The chunks the sweep tries: one, two and four bf16 sublane tiles.
SWEEP_ROW_CHUNKS = (16, 32, 64)


@dataclasses.dataclass(frozen=True)
class MatmulBlocks:
    """Tiles of one call of the grouped-matmul kernel (kernel.ragged_dot_forward): out [M, N] = lhs [M, K] @ rhs[g].

    Inside `RaggedDotBlocks` a field left None is the table's choice at that call's shape, searched with the given
    fields held fixed, and a tile at least as large as its dimension means the whole dimension. The kernel itself
    always receives every field set.
    """

    tm: int | None = None  # rows of lhs and of the output per m tile: a multiple of their sublane tile
    tk: int | None = None  # contraction columns per grid step: a multiple of 128 (tk >= K: one step, no refetch)
    tn: int | None = None  # output columns per grid step (of each of gate and up when gated): a multiple of 128
    vmem_limit_bytes: int | None = None  # scoped VMEM asked of Mosaic; None: the working set + 50 % + slack
    # forward kernel with tk = K: a visit sharing its tile with other groups multiplies only the chunks of row_chunk
    # rows holding its rows (a divisor of tm, a multiple of the sublane tile); 0: the whole tile
    row_chunk: int | None = None


@dataclasses.dataclass(frozen=True)
class TransposedMatmulBlocks:
    """Tiles of the transposed grouped matmul (the rhs gradient): out[g] (P, Q) = a[rows of g]^T @ b[rows of g]."""

    tm: int | None = None  # rows of a and b per visit (the contraction): a multiple of their sublane tile
    tp: int | None = None  # columns of a per output block: a multiple of 128
    tq: int | None = None  # columns of b per output block: a multiple of 128
    vmem_limit_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class RaggedDotBlocks:
    """`blocks=` of ragged_dot: the tiles of every kernel the op runs, forward and backward. A part left None, or a
    field left None in it, is the tuning table's choice for that kernel's shape: `RaggedDotBlocks()` is the table.

    forward    the kernel that computes the output: lhs [M, K] @ rhs [K, N] with the epilogue fused (tn then counts
               the columns of each of gate and up); for a gated layout that cannot be fused (interleaved, or halves
               that are not whole blocks) the plain matmul of all N columns in f32, whose epilogue runs in XLA.
    recompute  the backward's recomputation of the f32 pre-activation [M, N] (all N columns, no epilogue), run when
               there is an activation, a gate or a row_scale to differentiate.
    lhs_grad   d lhs = g [M, N] @ rhs^T: the forward kernel with rhs read the other way round, so its tk runs over N
               and its tn over K.
    rhs_grad   d rhs[g] = lhs[rows of g]^T @ g[rows of g], [K, N] (g^T @ lhs, [N, K], when rhs_transposed): the
               transposed kernel with tm rows of the contraction per visit and (tp, tq) output blocks.
    """

    forward: MatmulBlocks | None = None
    recompute: MatmulBlocks | None = None
    lhs_grad: MatmulBlocks | None = None
    rhs_grad: TransposedMatmulBlocks | None = None


def check_part(owner: str, value, cls):
    """A part of a blocks dataclass: None or an instance of `cls`."""
    if value is not None and not isinstance(value, cls):
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        raise TypeError(f"{owner}: expected {article} {cls.__name__} or None, got {type(value).__name__} {value!r}")
    return value


def check_ragged_dot_blocks(blocks, owner: str = "blocks") -> RaggedDotBlocks:
    """The structure of a `blocks=` argument (before any shape is known): a RaggedDotBlocks of the right parts."""
    check_part(owner, blocks, RaggedDotBlocks)
    blocks = blocks or RaggedDotBlocks()
    for part in ("forward", "recompute", "lhs_grad"):
        check_part(f"{owner}.{part}", getattr(blocks, part), MatmulBlocks)
    check_part(f"{owner}.rhs_grad", blocks.rhs_grad, TransposedMatmulBlocks)
    return blocks


def _given_tile(owner: str, field: str, value, dim: int, multiple: int, why: str, dim_name: str) -> int | None:
    """A caller's tile (None: the table chooses it), checked against the layout and clamped to the dimension."""
    if value is None:
        return None
    return check_block_dim(owner, field, value, dim=dim, multiple=multiple, why=why, dim_name=dim_name)


def _vmem_limit(owner: str, working_set: int, given, info, *, checked: bool) -> int:
    """The scoped VMEM a kernel asks for: the caller's, else its working set + 50 % + slack. A caller's blocks
    (`checked`) must fit it; the table's own choices are what they have always been and are proven by compiles."""
    limit = given if given is not None else chip.scoped_vmem_limit(info, working_set, VMEM_SLACK_BYTES)
    if checked:
        check_vmem_fit(owner, working_set, limit, info)
    return limit


def _dtype_names(*dtypes) -> str:
    return " / ".join(dict.fromkeys(str(jnp.dtype(d)) for d in dtypes))


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


def _generation(info) -> str:
    """The generation whose tables apply to `info`'s chip (v6e's for one the tables do not list)."""
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


def choose_tm(m: int, num_groups: int, dtype, generation: str, rhs_transposed: bool = False, chunked=False) -> int:
    """Rows per m tile. Whole-tile visits: about half a group's average rows (a tile shared by groups is multiplied
    once per group); `chunked` visits (row chunks) pay about a shared tile's rows once, so a group's average."""
    sub = sublane_multiple(dtype)
    tm = pow2_floor(max(1, m // max(1, num_groups if chunked else 2 * num_groups)))
    # At least TM_MIN rows: every visit pushes its group's whole weight block through the MXU, which costs the same
    # for 16 rows as for 128, so small tiles multiply that cost by the visits (tiles + groups - 1) while the masked
    # rows they save are nearly free. Modeled v6e (random top-8 of 128 experts), with the floor against the M / (2 *
    # groups) rule alone: decode B = 256 at 90-93 % of the HBM roofline against 62-67 %, B = 64 97-98 % against
    # 88-90 %, prefill M = 4096 83-89 % against 49-56 %.
    floor = max(TM_MIN, TM_MIN_TRANSPOSED.get(generation, TM_MIN)) if rhs_transposed else TM_MIN
    tm = max(sub, floor, min(TM_MAX[generation], tm))
    return m if m <= tm else tm


def forward_working_set(tm, tk, tn, *, k, lhs_dtype, rhs_dtype, out_dtype, streams=1) -> int:
    """VMEM bytes of the forward kernel: double-buffered lhs, weight and output blocks, the f32 accumulator (when K
    takes several steps) and the body's f32 temporaries; `streams` weight streams (2: gate and up). A quantized
    (1-byte) weight block is also held cast to lhs's dtype."""
    lb, rb, ob = (jnp.dtype(d).itemsize for d in (lhs_dtype, rhs_dtype, out_dtype))
    ws = 2 * tm * tk * lb + 2 * streams * tk * tn * rb + 2 * tm * tn * ob
    if rb == 1:
        ws += streams * tk * tn * lb
    return ws + (0 if tk >= k else streams * tm * tn * 4) + F32_TEMPORARIES * streams * tm * tn * 4


def _tn_options(n: int, gen: str, gated: bool, half_n) -> list[int]:
    # In the transposed layout tn is the weight block's second-minor dim (sublanes); the output block is (tm, tn)
    # either way, so tn is a multiple of 128 or all of n.
    options = _tile_options(n, TN_MAX[gen], LANES, prefer_divisors=False)
    if gated and half_n is not None:
        options = [t for t in options if n % t == 0] or [n]
    return options


MXFP4_TN = 1536  # the forward's default output tile against MXFP4 rhs (its blocks widened whole along K)
MXFP4_TN_OTHERS = (512, 1024)  # narrower ones the MoE sweep models (wider splits 2880 columns unevenly)


def tn_options(n: int, info, gated: bool, half_n) -> list[int]:
    """The output tiles (tn) the forward's table considers for n output columns on `info`'s generation."""
    return _tn_options(n, _generation(info), gated, half_n)


def _tk_options(k: int, gen: str) -> list[int]:
    return _tile_options(k, TK_MAX[gen], LANES, prefer_divisors=True)


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
    fixed: MatmulBlocks | None = None,
    owner: str = "blocks",
) -> MatmulBlocks:
    """Blocks for the forward kernel (and the lhs-gradient kernel, which is the forward with rhs transposed).

    n is the width of the output. With `gated`, rhs has 2 * n columns and the gate/up blocks are tn wide each; for
    the concatenated layout tn must divide n (`half_n`), so the up block sits at a whole block index.

    `fixed`: a caller's tiles (the `owner` part of blocks=, named in errors); its fields are checked against the
    layout and held fixed while the table chooses the others, and the result is checked to fit VMEM.
    """
    info = info or chip.current_tpu_info()
    gen = _generation(info)
    fixed = fixed or MatmulBlocks()
    sub = max(sublane_multiple(lhs_dtype), sublane_multiple(out_dtype))
    tm = _given_tile(owner, "tm", fixed.tm, m, sub, f"the sublane tile of {_dtype_names(lhs_dtype, out_dtype)}", "M")
    tk = _given_tile(owner, "tk", fixed.tk, k, LANES, "lanes", "K")
    tn = _given_tile(owner, "tn", fixed.tn, n, LANES, "lanes", "N")
    if tn is not None and gated and half_n is not None and n % tn:
        raise ValueError(
            f"{owner}.tn: expected a divisor of the gated output width {n} (the up half's blocks start at a whole "
            f"block), got {fixed.tn}"
        )
    budget = int(info.vmem_capacity_bytes * VMEM_SHARE[gen])
    streams = 2 if gated else 1

    def fit(tm):
        """(tk, tn) for tiles of tm rows: the first pair of the options that fits the VMEM budget."""
        tn_options = [tn] if tn is not None else _tn_options(n, gen, gated, half_n)
        tk_options = [tk] if tk is not None else _tk_options(k, gen)
        fits = (
            (tk_, tn_)
            for tk_ in tk_options  # tk = K first: consecutive visits of a group share the weight block (no refetch)
            for tn_ in tn_options
            if forward_working_set(
                tm, tk_, tn_, k=k, lhs_dtype=lhs_dtype, rhs_dtype=rhs_dtype, out_dtype=out_dtype, streams=streams
            )
            <= budget
        )
        return next(fits, (tk_options[-1], tn_options[-1]))

    _check_row_chunk_type(owner, fixed.row_chunk)
    chunks = ROW_CHUNKS_PER_TILE.get(gen, 0) if fixed.row_chunk is None else 0
    if tm is None:
        tm = choose_tm(m, num_groups, lhs_dtype, gen, rhs_transposed, chunked=bool(chunks or fixed.row_chunk))
    chosen = fit(tm)
    if fixed.row_chunk is None:
        row_chunk = _table_row_chunk(tm, sub, chunks, k, chosen, streams)
        if not row_chunk and chunks and fixed.tm is None:
            # the table would chunk but cannot here: whole tiles take the smaller tm of unchunked visits
            tm = choose_tm(m, num_groups, lhs_dtype, gen, rhs_transposed)
            chosen = fit(tm)
    else:
        row_chunk = _given_row_chunk(owner, fixed.row_chunk, tm, sub, lhs_dtype, out_dtype, cut=tm < (fixed.tm or 0))
        if row_chunk and chosen[0] < k:
            raise ValueError(
                f"{owner}.row_chunk: row chunks need all of K in one step (tk >= K = {k}), got tk = {chosen[0]}"
            )
    ws = forward_working_set(
        tm, *chosen, k=k, lhs_dtype=lhs_dtype, rhs_dtype=rhs_dtype, out_dtype=out_dtype, streams=streams
    )
    limit = _vmem_limit(owner, ws, fixed.vmem_limit_bytes, info, checked=fixed != MatmulBlocks())
    return MatmulBlocks(tm=tm, tk=chosen[0], tn=chosen[1], vmem_limit_bytes=limit, row_chunk=row_chunk)


def _table_row_chunk(tm: int, sub: int, chunks: int, k: int, chosen, streams: int) -> int:
    """The table's row chunk: tm / chunks where that is whole sublane tiles, all of K is one step, and the branches'
    matmuls (one per chunk count, 1 + 2 + ... + chunks chunks of rows, each by K by the output columns) stay within
    ROW_CHUNK_BRANCH_MACS_MAX; otherwise 0 (whole tiles)."""
    if chunks < 2 or tm % chunks or (tm // chunks) % sub:
        return 0
    chunk = tm // chunks
    tk, tn = chosen
    branch_macs = chunks * (chunks + 1) // 2 * chunk * k * tn * streams
    return chunk if tk >= k and branch_macs <= ROW_CHUNK_BRANCH_MACS_MAX else 0


def _check_row_chunk_type(owner: str, given) -> None:
    if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 0):
        raise TypeError(f"{owner}.row_chunk: expected a non-negative int (0: whole tiles), got {given!r}")


def _given_row_chunk(owner: str, given: int, tm: int, sub: int, lhs_dtype, out_dtype, *, cut: bool = False) -> int:
    """A caller's row chunk, checked: 0, or a divisor of tm in whole sublane tiles (tm itself means whole tiles).
    `cut`: the caller's tile was cut to the M rows there are (decode: one row), and a chunk that does not divide the
    smaller tile runs it whole."""
    if cut and given and tm % given:
        return 0
    if given and (given % sub or tm % given):
        raise ValueError(
            f"{owner}.row_chunk: expected 0 or a divisor of tm = {tm} that is a multiple of {sub} (the sublane tile "
            f"of {_dtype_names(lhs_dtype, out_dtype)}), got {given}"
        )
    return 0 if given == tm else given


def candidate_blocks(
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
) -> list[MatmulBlocks]:
    """Legal forward-kernel blocks worth modeling at this shape (choose_blocks' arguments), the table's choice first.

    Each other candidate moves one tile a step from the table's choice and lets the table re-fit the rest to its
    VMEM budget: tm halved and doubled (masking waste against per-visit cost), the next wider and narrower tn and all
    of N (step size against lhs re-reads), tk split (when the table keeps all of K) or all of K (when it splits it),
    and with all of K whole tiles and each of SWEEP_ROW_CHUNKS at tm and at 2 tm.
    """
    info = info or chip.current_tpu_info()
    gen = _generation(info)
    kwargs = dict(
        num_groups=num_groups,
        lhs_dtype=lhs_dtype,
        rhs_dtype=rhs_dtype,
        out_dtype=out_dtype,
        rhs_transposed=rhs_transposed,
        gated=gated,
        half_n=half_n,
        info=info,
    )
    table = choose_blocks(m, k, n, **kwargs)
    tn_options = _tn_options(n, gen, gated, half_n)
    at = tn_options.index(table.tn) if table.tn in tn_options else 0
    moves = [MatmulBlocks(tm=table.tm // 2), MatmulBlocks(tm=table.tm * 2)]
    moves += [MatmulBlocks(tn=tn_options[i]) for i in (at - 1, at + 1) if 0 <= i < len(tn_options)]
    if table.tn < n:  # all of N in one block, past the table's widest (lhs read once; a wide block's step cost)
        moves.append(MatmulBlocks(tn=n))
    smaller_k = [t for t in _tk_options(k, gen) if t < k]
    if table.tk >= k and smaller_k:
        moves.append(MatmulBlocks(tk=smaller_k[0]))
    elif table.tk < k:
        moves.append(MatmulBlocks(tk=k))
    if table.tk >= k:  # whole tiles and each sweep chunk (only with all of K in one step), at tm and at 2 tm
        for tm in (table.tm, table.tm * 2):
            moves += [MatmulBlocks(tm=tm, row_chunk=chunk) for chunk in (0, *SWEEP_ROW_CHUNKS) if chunk < tm]
    candidates = [table]
    for move in moves:
        try:
            candidate = choose_blocks(m, k, n, fixed=move, **kwargs)
        except (TypeError, ValueError):  # not a legal tile here, or too large for VMEM
            continue
        if candidate not in candidates:
            candidates.append(candidate)
    return candidates


def transposed_working_set(tm, tp, tq, *, a_dtype, b_dtype, out_dtype) -> int:
    ab, bb, ob = (jnp.dtype(d).itemsize for d in (a_dtype, b_dtype, out_dtype))
    return 2 * tm * tp * ab + 2 * tm * tq * bb + 2 * tp * tq * ob + (1 + F32_TEMPORARIES) * tp * tq * 4


def choose_transposed_blocks(
    m: int,
    p: int,
    q: int,
    *,
    num_groups: int,
    a_dtype,
    b_dtype,
    out_dtype,
    info: pltpu.TpuInfo | None = None,
    fixed: TransposedMatmulBlocks | None = None,
    owner: str = "blocks",
) -> TransposedMatmulBlocks:
    """Blocks for out[g] (p, q) = a[rows]^T (p, tm) @ b[rows] (tm, q): tm rows per visit, (tp, tq) output blocks.

    Here tm is a contraction length: the larger the better, bounded by the masking waste as in the forward.
    `fixed` and `owner` as in choose_blocks.
    """
    info = info or chip.current_tpu_info()
    gen = _generation(info)
    fixed = fixed or TransposedMatmulBlocks()
    sub = max(sublane_multiple(a_dtype), sublane_multiple(b_dtype))
    tm = _given_tile(owner, "tm", fixed.tm, m, sub, f"the sublane tile of {_dtype_names(a_dtype, b_dtype)}", "M")
    tp = _given_tile(owner, "tp", fixed.tp, p, LANES, "lanes", "P")
    tq = _given_tile(owner, "tq", fixed.tq, q, LANES, "lanes", "Q")
    if tm is None:
        tm = pow2_floor(max(1, m // max(1, 2 * num_groups)))
        tm = max(128 if m >= 128 else sub, min(TM_MAX[gen], tm))
        tm = m if m <= tm else tm
    budget = int(info.vmem_capacity_bytes * VMEM_SHARE[gen])

    def working_set(tp, tq):
        return transposed_working_set(tm, tp, tq, a_dtype=a_dtype, b_dtype=b_dtype, out_dtype=out_dtype)

    tp_options = [tp] if tp is not None else _tile_options(p, 1024, LANES, prefer_divisors=False)
    tq_options = [tq] if tq is not None else _tile_options(q, 1024, LANES, prefer_divisors=False)
    chosen = next(
        ((tp, tq) for tp in tp_options for tq in tq_options if working_set(tp, tq) <= budget),
        (tp_options[-1], tq_options[-1]),
    )
    ws = working_set(*chosen)
    limit = _vmem_limit(owner, ws, fixed.vmem_limit_bytes, info, checked=fixed != TransposedMatmulBlocks())
    return TransposedMatmulBlocks(tm=tm, tp=chosen[0], tq=chosen[1], vmem_limit_bytes=limit)
