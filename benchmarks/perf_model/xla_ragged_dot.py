"""XLA's own Mosaic kernel for `lax.ragged_dot`: its grid and block traffic, from the group sizes.

On a TPU XLA lowers a ragged dot (rows in groups, one right-hand matrix a group) to two Mosaic kernels of its own, with
no pallas_call in the program: `ragged-dot-metadata`, which turns the group sizes into a tile schedule, and the grouped
matmul, whose grid (n tiles, scheduled m tiles, k tiles) has its middle dimension sized at run time. As its body reads
(jax 0.10.2's libtpu, v5e): the scalar operands are the group offsets [G + 1], for each scheduled index its group and
its m tile [m tiles + G - 1 each] and the count of scheduled indices [1]; the blocks are lhs [tm, tk] at (m tile, k),
rhs [1, tk, tn] at (group, k, n) and out [tm, tn] at (m tile, n), double-buffered like a pallas_call's. The schedule is
megablox's grouped matmul's: each non-empty group visits, in order, every m tile its rows touch, so a tile that
straddles a group boundary is visited once for each of its groups, consecutively (its output block stays in VMEM in
between); an empty group visits nothing.

With the group sizes known (concrete in the program's inputs, or computed from them: the MoE experts' routing), the
grid and the bytes each step fetches follow as for a pallas_call: a block is fetched when its index differs from the
previous step's, written back when the next step's differs. The rhs block is a group's weights, fetched again at each
change of group: at decode sizes one visit a group, so the kernel streams the touched groups' weights.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from .traffic import block_bytes, block_moves

_SIGNATURE_RE = re.compile(r"func\.func @main\(([^)]*)\)")
_MEMREF_RE = re.compile(r"memref<([\dx]+)x(\w+), #tpu\.memory_space<(\w+)>>")
_BOUNDS_RE = re.compile(r"iteration_bounds = array<i64: ([-\d, ]+)>")
_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i8": 1, "f8E4M3FN": 1, "f8E5M2": 1, "i4": 0.5, "f4E2M1FN": 0.5}


@dataclasses.dataclass(frozen=True)
class RaggedDotKernel:
    """The grouped matmul's tiling, read from its body."""

    tm: int
    tk: int
    tn: int
    n_tiles: int
    k_tiles: int
    groups: int
    max_tiles: int  # the schedule's length: m tiles + groups - 1
    lhs_itemsize: float
    rhs_itemsize: float
    out_itemsize: float


def parse(body: str) -> RaggedDotKernel | None:
    """The tiling of XLA's ragged-dot kernel from its Mosaic body (MLIR text), or None when the body is not that
    kernel's shape (four SMEM operands: offsets, group ids, m tile ids, count; lhs, rhs, out blocks; a grid whose middle
    dimension is sized at run time)."""
    sig, bounds = _SIGNATURE_RE.search(body or ""), _BOUNDS_RE.search(body or "")
    if sig is None or bounds is None:
        return None
    refs = [(tuple(int(d) for d in dims.split("x")), dtype, space) for dims, dtype, space in _MEMREF_RE.findall(sig[1])]
    grid = [int(d) for d in bounds[1].split(",")]
    spaces = [space for _, _, space in refs]
    if spaces != ["smem"] * 4 + ["vmem"] * 3 or len(grid) != 3 or grid[1] >= 0 or min(grid[0], grid[2]) < 1:
        return None
    (offsets, _, _), (ids, _, _), _, (count, _, _), (lhs, lt, _), (rhs, rt, _), (out, ot, _) = refs
    if len(lhs) != 2 or len(rhs) != 3 or rhs[0] != 1 or len(out) != 2 or count != (1,) or lt not in _ITEMSIZE:
        return None
    if rt not in _ITEMSIZE or ot not in _ITEMSIZE or (lhs[0], rhs[2]) != out or lhs[1] != rhs[1]:
        return None
    return RaggedDotKernel(
        tm=lhs[0],
        tk=lhs[1],
        tn=rhs[2],
        n_tiles=grid[0],
        k_tiles=grid[2],
        groups=offsets[0] - 1,
        max_tiles=ids[0],
        lhs_itemsize=_ITEMSIZE[lt],
        rhs_itemsize=_ITEMSIZE[rt],
        out_itemsize=_ITEMSIZE[ot],
    )


def schedule(group_sizes, tm: int) -> tuple[np.ndarray, np.ndarray]:
    """(group, m tile) of every scheduled index, in order: each non-empty group's rows [start, end) visit the m tiles
    from start // tm to (end - 1) // tm."""
    sizes = np.asarray(group_sizes, np.int64)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    groups, tiles = [], []
    for g in np.flatnonzero(sizes > 0):
        first, last = starts[g] // tm, (ends[g] - 1) // tm
        tiles.append(np.arange(first, last + 1))
        groups.append(np.full(last - first + 1, g))
    if not tiles:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(groups), np.concatenate(tiles)


def step_traffic(kernel: RaggedDotKernel, group_sizes, rows: int, k: int, n: int):
    """Per grid step, in grid order (n tiles outermost, then the schedule, then k tiles): (bytes fetched for the step's
    inputs, bytes written back after it, block DMAs of each). `rows`, `k`, `n`: lhs [rows, k] and rhs [groups, k, n];
    blocks at the arrays' edges move only their part inside."""
    group_ids, m_tiles = schedule(group_sizes, kernel.tm)
    if len(group_ids) == 0:
        return (np.zeros(0),) * 4
    tm, tk, tn = kernel.tm, kernel.tk, kernel.tn
    # every grid point's block indices: axes (n tile, scheduled index, k tile), flattened in grid order
    nn, jj, kk = np.meshgrid(
        np.arange(kernel.n_tiles), np.arange(len(group_ids)), np.arange(kernel.k_tiles), indexing="ij"
    )
    nn, jj, kk = nn.ravel(), jj.ravel(), kk.ravel()
    lhs_idx = np.stack([m_tiles[jj], kk], 1)
    rhs_idx = np.stack([group_ids[jj], kk, nn], 1)
    out_idx = np.stack([m_tiles[jj], nn], 1)
    lhs_new, rhs_new = block_moves(lhs_idx, "input"), block_moves(rhs_idx, "input")
    out_last = block_moves(out_idx, "output")
    lhs_bytes = block_bytes(lhs_idx * (tm, tk), (tm, tk), (rows, k), kernel.lhs_itemsize)
    rhs_bytes = block_bytes(rhs_idx[:, 1:] * (tk, tn), (tk, tn), (k, n), kernel.rhs_itemsize)
    out_bytes = block_bytes(out_idx * (tm, tn), (tm, tn), (rows, n), kernel.out_itemsize)
    in_b = lhs_new * lhs_bytes + rhs_new * rhs_bytes
    in_d = lhs_new.astype(np.float64) + rhs_new
    out_b = out_last * out_bytes
    return in_b.astype(np.float64), out_b.astype(np.float64), in_d, out_last.astype(np.float64)
