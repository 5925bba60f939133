"""Public JAX API of ragged paged attention: one call for a batch mixing prefill chunks and decode tokens over a
paged KV cache in flash-attn's layout. Input validation, block choice, the visit lists (built on the device from the
batch's metadata) and the layout changes around the kernel. Semantics: see reference.py.
"""

import jax.numpy as jnp

from ..common import chip
from ..common.interpret import interpret_eager_cpu_calls
from ..flash_attention import checks as attention_checks
from . import checks, kernel, schedule, tuning
from .tuning import PagedAttentionBlocks


@interpret_eager_cpu_calls
def ragged_paged_attention(
    q,
    k_cache,
    v_cache,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs=None,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks=None,
    k_scale=None,
    v_scale=None,
    blocks: PagedAttentionBlocks | None = None,
):
    """Attention of a ragged batch of queries over a paged KV cache.

    q [T, Hq, D]: the batch's query tokens, sequence s at rows cu_q_lens[s]:cu_q_lens[s + 1] (int32 [N + 1]);
    rows past cu_q_lens[num_seqs] are padding and come out as zeros. k_cache [pages, page_size, Hkv, D], v_cache
    [pages, page_size, Hkv, Dv] (flash-attn's paged layout; page_size a multiple of 16), in q's dtype or float8_e4m3fn
    with k_scale / v_scale (stored = value / scale; a float or a float32 array [] / [1]). kv_lens int32 [N]: each
    sequence's context, its new tokens included (they must already be in the cache); page_indices int32 [N, pages]:
    sequence s's context position p is in page page_indices[s, p // page_size]. num_seqs: None (all N), an int, or
    an int32 array [1] (a run-time count: sequences past it are ignored). Hq a multiple of Hkv (GQA: each page read
    once for all query heads of its kv head). causal: bottom-right aligned (a sequence's queries are the last
    positions of its context); window_size (left, right) with -1 unbounded; softcap > 0 caps the logits; sinks [Hq]
    logits join each row's softmax (gpt-oss); softmax_scale None for D ** -0.5. -> out [T, Hq, Dv] in q's dtype.

    Metadata on the host (concrete arrays) is checked: offsets increasing, lengths within the page table, no query
    longer than its context, page indices within the cache. On the device (traced) it is clamped instead, so broken
    metadata can give wrong rows but never reads memory outside the cache or writes outside the output.
    """
    hq, hkv, d, dv, page_size = checks.check_caches(q, k_cache, v_cache)
    scale, causal, window, softcap = attention_checks.check_options(softmax_scale, causal, window_size, softcap, d)
    sinks = attention_checks.check_sinks(sinks, hq)
    k_scale = checks.check_scale("k_scale", k_scale, k_cache.dtype)
    v_scale = checks.check_scale("v_scale", v_scale, v_cache.dtype)
    scales = None  # static scales (None or floats) are the kernel's constants: no XLA op builds them
    if isinstance(k_scale, float | None) and isinstance(v_scale, float | None):
        static_scales = (1.0 if k_scale is None else k_scale, 1.0 if v_scale is None else v_scale)
    else:
        static_scales = None
        scales = jnp.concatenate([_scale_array(k_scale), _scale_array(v_scale)])
    tuning.check_blocks_type(blocks)
    tokens, num_pages = q.shape[0], k_cache.shape[0]
    num_seqs = checks.check_metadata(
        kv_lens, page_indices, cu_q_lens, num_seqs, tokens=tokens, num_pages=num_pages, page_size=page_size
    )
    if tokens == 0:
        return jnp.zeros((0, hq, dv), q.dtype)
    n, pages_per_seq = page_indices.shape
    group = hq // hkv
    compute_dtype = jnp.float32 if q.dtype == jnp.float16 else q.dtype  # float16 runs as float32 on TPU
    info = chip.current_tpu_info()
    chosen = tuning.resolve_blocks(
        blocks,
        tokens=tokens,
        num_seqs=n,
        group=group,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        kv_heads=hkv,
        head_dim=d,
        v_head_dim=dv,
        q_dtype=compute_dtype,
        cache_dtype=k_cache.dtype,
        window_size=(window[0], 0 if causal else window[1]),
        info=info,
    )
    block_q = chosen.queries_per_block
    padded = -(-tokens // block_q) * block_q
    itemsize = k_cache.dtype.itemsize
    head_major = kernel.head_major_cache(hkv=hkv, page_size=page_size, cache_itemsize=itemsize)
    merged, merged_view, strided_heads = kernel.visit_heads(
        hkv=hkv, head_dim=d, v_head_dim=dv, block_rows=block_q * group, page_size=page_size, cache_dtype=k_cache.dtype
    )
    layout = kernel.Layout(
        scales=static_scales,
        tokens=padded,
        q_heads=hq,
        kv_heads=hkv,
        head_dim=d,
        v_head_dim=dv,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        pages_per_block=chosen.pages_per_block,
        block_q=block_q,
        softmax_scale=scale,
        softcap=softcap,
        window_size=(window[0], 0 if causal else window[1]),
        merged=merged,
        merged_view=merged_view,
        head_major=head_major,
        strided_heads=strided_heads,
        parts=chosen.visits_per_step,
        float8_operands=chosen.float8_operands,
    )
    size = schedule.visit_bound(
        tokens=tokens,
        num_q_blocks=padded // block_q,
        num_seqs=n,
        block_q=block_q,
        block_kv=layout.block_kv,
        blocks_per_seq=layout.blocks_per_seq,
        window_size=window,
        causal=causal,
        parts=layout.parts,
    )
    smem = 4 * (3 * size + n * pages_per_seq)  # the visit lists (three int32 words a visit) and the page table
    if smem > tuning.SMEM_BUDGET_BYTES:
        raise ValueError(
            f"page_indices: {n} sequences x {pages_per_seq} pages with blocks of {layout.block_kv} keys and "
            f"{block_q} queries need up to {size} visits and {smem // 1024} KiB of SMEM for the page table and visit "
            f"lists, more than the {tuning.SMEM_BUDGET_BYTES // 1024} KiB the kernel keeps; use "
            f"larger pages or blocks (PagedAttentionBlocks)"
        )
    words, kv_blocks, rows, count, kv_eff, cu_eff = schedule.visits(
        kv_lens,
        cu_q_lens,
        num_seqs,
        tokens=tokens,
        padded=padded,
        block_q=block_q,
        page_size=page_size,
        pages_per_block=layout.pages_per_block,
        blocks_per_seq=layout.blocks_per_seq,
        max_context=layout.max_context,
        causal=causal,
        window_size=window,
        size=size,
        parts=layout.parts,
    )
    q_rows = jnp.pad(q.astype(compute_dtype), ((0, padded - tokens), (0, 0), (0, 0)))
    pages = page_indices.reshape(-1)  # clamped to the cache where the kernel reads them
    sink_rows = None
    if sinks is not None:
        per_row = jnp.tile(sinks.astype(jnp.float32).reshape(hkv, 1, group), (1, block_q, 1))
        sink_rows = jnp.broadcast_to(per_row.reshape(hkv, block_q * group, 1), (hkv, block_q * group, 128))
    if layout.merged_view:  # the same bytes in HBM (kernel.merged_cache_view): no copy
        k_cache = k_cache.reshape(num_pages, page_size * hkv, d)
        v_cache = v_cache.reshape(num_pages, page_size * hkv, dv)
    if layout.head_major:  # XLA's own layout of such a cache (kernel.head_major_cache): the same bytes, no copy
        k_cache, v_cache = k_cache.swapaxes(1, 2), v_cache.swapaxes(1, 2)
    out = kernel.paged_attention(
        q_rows,
        k_cache,
        v_cache,
        words,
        kv_blocks,
        rows,
        pages,
        count,
        kv_eff,
        cu_eff,
        scales,
        sink_rows,
        layout=layout,
        vmem_limit_bytes=chosen.vmem_limit_bytes,
    )
    return out[:tokens].astype(q.dtype)


def _scale_array(scale):
    """A checked cache scale (None, a float or a float32 [1]) as a float32 [1]."""
    if scale is None or isinstance(scale, float):
        return jnp.full((1,), 1.0 if scale is None else scale, jnp.float32)
    return scale
