"""The shape of a DMA in HBM: how many contiguous runs of bytes it reads or writes.

XLA lays out a TPU array of rank >= 2 in HBM in tiles of its two minor dimensions: 8 rows of 32-bit words x 128
lanes (4 KiB), a 16-bit dtype packing 2 rows per word (16 x 128 elements a tile), an 8-bit one 4 (32 x 128). Tiles
follow each other row-major (tile rows, then tile columns), and so do the outer dimensions. A block or a DMA slice is
then contiguous where it covers whole minor dimensions: a page of a paged cache (`pages.at[i]`) is one run, a
(128, 128) block of a (4096, 4096) bf16 matrix is 8 runs of one tile (4 KiB), and a slice of 8 of 16 heads of a
(page, heads, head_dim) page is one run of 2 KiB per page row (half of each tile). Rank-1 arrays are one run.
Selections are taken as aligned to their own size (block i starts at i x block), which BlockSpecs and page slices are.
"""

from __future__ import annotations

import math

import numpy as np

TILE_WORD_ROWS = 8  # 32-bit word rows of an HBM tile
TILE_LANES = 128


def hbm_runs(array_shape, selected, itemsize: int) -> int:
    """Contiguous runs a transfer of `selected` elements per dimension (1 for an indexed or squeezed dimension) of
    an HBM array of `array_shape` moves, in XLA's tiled TPU layout."""
    array_shape, selected = tuple(int(d) for d in array_shape), tuple(int(s) for s in selected)
    if len(array_shape) != len(selected):
        raise ValueError(f"selection {selected} does not match the array's rank {array_shape}")
    if len(array_shape) < 2 or math.prod(selected) == 0:
        return 1
    pack = max(1, 4 // max(1, itemsize))  # rows of the dtype in one 32-bit word row
    tile_rows = TILE_WORD_ROWS * pack
    rows, lanes = array_shape[-2], array_shape[-1]
    s_rows, s_lanes = selected[-2], selected[-1]
    # Physical dimensions, outermost first: outer dims, tile row, tile column, word row, lane, packed row in a word.
    physical = [*array_shape[:-2], -(-rows // tile_rows), -(-lanes // TILE_LANES), TILE_WORD_ROWS, TILE_LANES, pack]
    if s_rows >= rows:
        tile_row, word_row, sub = physical[-5], TILE_WORD_ROWS, pack
    elif s_rows >= tile_rows:
        tile_row, word_row, sub = -(-s_rows // tile_rows), TILE_WORD_ROWS, pack
    else:
        tile_row, word_row, sub = 1, -(-s_rows // pack), min(s_rows, pack)
    if s_lanes >= lanes:
        tile_col, lane = physical[-4], TILE_LANES
    elif s_lanes >= TILE_LANES:
        tile_col, lane = -(-s_lanes // TILE_LANES), TILE_LANES
    else:
        tile_col, lane = 1, s_lanes
    if rows < tile_rows:  # a small array's tile holds all its rows: the rows past them are padding, not data
        word_row = TILE_WORD_ROWS if s_rows >= rows else word_row
    if lanes < TILE_LANES and s_lanes >= lanes:
        lane = TILE_LANES
    chosen = [*selected[:-2], tile_row, tile_col, word_row, lane, sub]
    # The run ends at the innermost dimension the selection does not cover whole; the dimensions outside it repeat it.
    k = len(physical) - 1
    while k >= 0 and chosen[k] >= physical[k]:
        k -= 1
    return int(np.prod(chosen[:k], dtype=np.int64)) if k > 0 else 1


def ref_selection(ref):
    """(array shape, elements selected per array dimension) of a DMA's ref: a plain ref (the whole array) or one
    sliced by `.at[...]` (indexers, possibly chained); an integer index selects 1, a slice its size (the whole
    dimension when the size is a run-time value: an upper bound on the runs). None for another transform."""
    base = getattr(ref, "ref", None)
    transforms = tuple(getattr(ref, "transforms", ()))
    if base is None:
        shape = getattr(ref, "shape", None)
        return None if shape is None else (tuple(shape), tuple(shape))
    shape = tuple(base.shape)
    chosen = list(shape)
    live = list(range(len(shape)))  # the array dimension behind each dimension of the current view
    for t in transforms:
        indices = getattr(t, "indices", None)
        if indices is None or len(indices) != len(live):
            return None
        kept = []
        for dim, index in zip(live, indices):
            if type(index).__name__ == "Slice":
                size = index.size
                chosen[dim] = min(chosen[dim], int(size)) if isinstance(size, (int, np.integer)) else chosen[dim]
                kept.append(dim)
            else:  # an integer (or a traced scalar) index: that dimension is dropped
                chosen[dim] = 1
        live = kept
    return shape, tuple(chosen)
