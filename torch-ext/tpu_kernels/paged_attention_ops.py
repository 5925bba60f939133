"""Torch ops for attention over a paged KV cache: `ragged_paged_attention` (the JAX api's one call for a batch mixing
prefill chunks and decode tokens), flash-attn's `flash_attn_with_kvcache` (new K/V written into the cache in place,
optional rotary, then attention) and the paged branch of `flash_attn_varlen_func` (block_table given).

flash_attn_with_kvcache composes two ops, each a kernel: the KV cache write at the slots the block table names (in
place: on a `tpu` tensor the caches are donated to the kernel, on a CPU tensor the interpret-mode result is copied
back into the same storage), and ragged_paged_attention over the updated pages. The write is reshape_and_cache_flash,
or with rotary_cos / rotary_sin rope_and_reshape_and_cache_flash, which rotates the new k (and q, when q's rows sit
at the new keys' positions) in the kernel that writes k (flash-attn's half-width cos/sin tables gathered at the
tokens' positions in the same program); a q at other positions is rotated by the rotary op first. A non-paged cache
[B, S_cache, Hkv, D] is viewed (not copied) as pages: each batch row a run of S_cache / page_size pages.

Inference only: no autograd; inputs that require grad are refused. Metadata (cache_seqlens, block_table, kv_lens,
page tables, offsets) is checked by value on host tensors; on device tensors it is not read (that would cost a sync):
the kernels then clamp or skip out-of-range entries (never reading or writing outside the cache) and results for
such sequences are unspecified.
"""

import contextlib
import dataclasses
import json

import jax
import numpy as np
import torch

from tpu_kernels_jax.flash_attention import checks as attention_checks
from tpu_kernels_jax.paged_attention import api
from tpu_kernels_jax.paged_attention import checks as paged_checks
from tpu_kernels_jax.paged_attention.tuning import PagedAttentionBlocks, check_blocks_type

from . import _torch_checks as checks
from . import kv_cache_ops, rotary_ops
from ._op_registry import define_op, static_json

# A non-paged cache is viewed as pages of the largest multiple of 16 (the kernel's page granularity) up to this many
# rows that divides its length.
MAX_VIEW_PAGE = 256


# The JAX function the op is made from (annotations drive the torch schema, TorchTPU's jax_op convention). window_size
# crosses as two ints; blocks as canonical JSON of PagedAttentionBlocks ("" for the tuning table's).
def _ragged_paged_attention_jax(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array | None,
    sinks: jax.Array | None,
    k_scale: jax.Array | None,
    v_scale: jax.Array | None,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    blocks: str,
) -> jax.Array:
    return api.ragged_paged_attention(
        q,
        k_cache,
        v_cache,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=(window_left, window_right),
        softcap=softcap,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
        blocks=PagedAttentionBlocks(**json.loads(blocks)) if blocks else None,
    )


def _fake_ragged(q, k_cache, v_cache, *rest):
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))


ragged_paged_attention_op = define_op("ragged_paged_attention", _ragged_paged_attention_jax, _fake_ragged)


# ---------------------------------------------------------------------------------------------------- validation
def _values(name, value):
    """Host values (numpy) of a real CPU tensor, else a placeholder; None and Python scalars pass through."""
    if not isinstance(value, torch.Tensor):
        return value
    return checks.values_or_placeholder(name, value)


def _host(*tensors) -> bool:
    """True when every given tensor's values can be read without a device sync (real CPU tensors, not tracing)."""
    return not checks.tracing() and all(
        type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors if t is not None
    )


def _refuse_grad(function, tensors: dict):
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(f"{name}: {function} is inference only (no gradient), got a tensor that requires grad")


def _check_devices(first: tuple, others: dict):
    name, tensor = first
    checks.check_tensor(name, tensor)
    for other, t in others.items():
        if t is not None:
            checks.check_tensor(other, t, device=tensor.device)


def _blocks_json(blocks) -> str:
    check_blocks_type(blocks)
    return "" if blocks is None else static_json("blocks", dataclasses.asdict(blocks))


def _scale_tensor(name, value, device):
    """k_scale / v_scale as the op's float32 tensor [1] (a Python float becomes one), or None."""
    if value is None or isinstance(value, torch.Tensor):
        return None if value is None else value.reshape(1)
    return torch.full((1,), float(value), dtype=torch.float32, device=device)


def _num_seqs_tensor(value, device):
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return checks.as_int32("num_seqs", value).reshape(1)
    return torch.full((1,), int(value), dtype=torch.int32, device=device)


def _options(q_shape, softmax_scale, causal, window_size, softcap):
    """(softmax_scale, causal, window_left, window_right, softcap) as the op takes them, checked by the JAX api's own
    option checks (outside tracing)."""
    if checks.tracing():
        scale = q_shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        return scale, bool(causal), int(window_size[0]), int(window_size[1]), float(softcap)
    scale, causal, (left, right), softcap = attention_checks.check_options(
        softmax_scale, causal, window_size, softcap, q_shape[-1]
    )
    return scale, causal, left, right, softcap


# ---------------------------------------------------------------------------------------------- ragged paged attention
def ragged_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_lens: torch.Tensor,
    page_indices: torch.Tensor,
    cu_q_lens: torch.Tensor,
    num_seqs: int | torch.Tensor | None = None,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    blocks: PagedAttentionBlocks | None = None,
) -> torch.Tensor:
    """Attention of a ragged batch of queries (prefill chunks and decode tokens mixed) over a paged KV cache.

    q [T, Hq, D]: sequence s's queries are rows cu_q_lens[s]:cu_q_lens[s + 1] (int32 [N + 1], int64 cast once);
    rows past cu_q_lens[num_seqs] are padding and come out as zeros. k_cache [pages, page_size, Hkv, D], v_cache
    [pages, page_size, Hkv, Dv] (flash-attn's paged layout, page_size a multiple of 16) in q's dtype, or
    float8_e4m3fn with k_scale / v_scale (stored = value / scale; a float or a float32 tensor [] / [1]). kv_lens [N]:
    each sequence's context, its new tokens included (they must already be in the cache: the queries are the last
    positions of the context); page_indices [N, pages]: context position p of sequence s is in page
    page_indices[s, p // page_size]. num_seqs: None (all N), an int or an int32 tensor [1] (sequences past it are
    ignored). causal (bottom-right), window_size (left, right; -1 unbounded), softcap, sinks [Hq] (float32 logits
    joining each row's softmax), softmax_scale (None: D ** -0.5), blocks (PagedAttentionBlocks, None: the tuning
    table's) as the JAX api. -> out [T, Hq, Dv] in q's dtype. Inference only.
    """
    tensors = {
        "k_cache": k_cache,
        "v_cache": v_cache,
        "kv_lens": kv_lens,
        "page_indices": page_indices,
        "cu_q_lens": cu_q_lens,
        "num_seqs": num_seqs if isinstance(num_seqs, torch.Tensor) else None,
        "sinks": sinks,
        "k_scale": k_scale if isinstance(k_scale, torch.Tensor) else None,
        "v_scale": v_scale if isinstance(v_scale, torch.Tensor) else None,
    }
    _check_devices(("q", q), tensors)
    _refuse_grad("ragged_paged_attention", {"q": q, "k_cache": k_cache, "v_cache": v_cache, "sinks": sinks})
    kv_lens, page_indices, cu_q_lens = (
        checks.as_int32(name, t)
        for name, t in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens))
    )
    if isinstance(num_seqs, torch.Tensor):
        num_seqs = checks.as_int32("num_seqs", num_seqs)
    options = _options(q.shape, softmax_scale, causal, window_size, softcap)
    blocks_json = _blocks_json(blocks)
    if not checks.tracing() and not checks.has_symbolic_shape(q, k_cache, v_cache, page_indices, cu_q_lens):
        ph_q = checks.placeholder("q", q)
        hq = paged_checks.check_caches(
            ph_q, checks.placeholder("k_cache", k_cache), checks.placeholder("v_cache", v_cache)
        )[0]
        attention_checks.check_sinks(checks.placeholder("sinks", sinks), hq)
        paged_checks.check_scale("k_scale", _values("k_scale", k_scale), _jax_dtype(k_cache))
        paged_checks.check_scale("v_scale", _values("v_scale", v_scale), _jax_dtype(v_cache))
        paged_checks.check_metadata(
            _values("kv_lens", kv_lens),
            _values("page_indices", page_indices),
            _values("cu_q_lens", cu_q_lens),
            _values("num_seqs", num_seqs),
            tokens=q.shape[0],
            num_pages=k_cache.shape[0],
            page_size=k_cache.shape[1],
        )
    return ragged_paged_attention_op(
        checks.contiguous(q),
        _cache_view("k_cache", k_cache),
        _cache_view("v_cache", v_cache),
        checks.contiguous(kv_lens),
        checks.contiguous(page_indices),
        checks.contiguous(cu_q_lens),
        _num_seqs_tensor(num_seqs, q.device),
        checks.contiguous(sinks),
        _scale_tensor("k_scale", k_scale, q.device),
        _scale_tensor("v_scale", v_scale, q.device),
        *options,
        blocks_json,
    )


def _jax_dtype(t: torch.Tensor):
    return checks.placeholder("cache", t).dtype


def _cache_view(name, cache):
    """The cache as the ops take it: itself when contiguous (a cache is read where it lies; .contiguous() of a
    strided view would copy the whole cache on every call, so it is refused instead)."""
    if not cache.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous cache (it is read and written where it lies), got strides {cache.stride()}"
        )
    return cache


@contextlib.contextmanager
def _renamed(names: dict):
    """The JAX api and the inner ops name their own arguments (kv_lens, page_indices, ...); errors name the argument
    the caller passed (cache_seqlens, block_table, ...)."""
    try:
        yield
    except (TypeError, ValueError) as error:
        message = str(error)
        for inner, outer in names.items():
            if message.startswith(inner + ":"):
                raise type(error)(outer + message[len(inner) :]) from None
        raise


def _int_tensor(name, value, ndim):
    """An int32 (int64 cast once) tensor of `ndim` dimensions."""
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name}: expected an int32 (or int64) tensor, got {value.dtype}")
    if value.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(value.shape)}")
    return checks.as_int32(name, value)


# ------------------------------------------------------------------------------------------ flash_attn_with_kvcache
def _refuse_kvcache_options(cache_batch_idx, cache_leftpad, alibi_slopes, num_splits, return_softmax_lse):
    """flash-attn arguments these kernels do not implement: an error naming the argument, never silently ignored."""
    if cache_batch_idx is not None:
        raise ValueError(
            "cache_batch_idx: indexing the cache's batch rows is not implemented by tpu-kernels (expected None; a "
            "paged cache with block_table addresses any rows)"
        )
    if cache_leftpad is not None:
        raise ValueError("cache_leftpad: left-padded caches are not implemented by tpu-kernels (expected None)")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: ALiBi is not implemented by tpu-kernels (expected None)")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise TypeError(f"num_splits: expected an int >= 0, got {num_splits!r}")
    if return_softmax_lse is not False:
        raise ValueError(
            f"return_softmax_lse: returning the softmax log-sum-exp is not implemented by tpu-kernels (expected False, "
            f"got {return_softmax_lse!r})"
        )


def view_page_size(length: int) -> int:
    """The page size a non-paged cache of `length` rows per sequence is viewed with: the largest multiple of 16 up
    to MAX_VIEW_PAGE that divides it."""
    if length <= 0 or length % paged_checks.PAGE_MULTIPLE:
        raise ValueError(
            f"k_cache: a cache without block_table is read as pages of a multiple of {paged_checks.PAGE_MULTIPLE} "
            f"rows, so its length (dim 1) must be a multiple of {paged_checks.PAGE_MULTIPLE}, got {length}"
        )
    return max(
        p for p in range(paged_checks.PAGE_MULTIPLE, MAX_VIEW_PAGE + 1, paged_checks.PAGE_MULTIPLE) if not length % p
    )


def _paged_view(k_cache, v_cache, batch):
    """A non-paged cache [B_cache, S_cache, Hkv, D] as pages [B_cache * S_cache / page, page, Hkv, D] (a view: the
    writes land in the caller's cache) and the page table of its first `batch` rows."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4:
            raise ValueError(
                f"{name}: expected [batch, seqlen_cache, kv_heads, head_dim], got shape {tuple(cache.shape)}"
            )
        if not cache.is_contiguous():
            raise ValueError(
                f"{name}: expected a contiguous cache (it is written in place), got strides {cache.stride()}"
            )
    rows, length = k_cache.shape[:2]
    if rows < batch:
        raise ValueError(f"k_cache: expected at least the {batch} batch rows of q, got shape {tuple(k_cache.shape)}")
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise ValueError(
            f"v_cache: expected the batch, length and kv heads of k_cache {tuple(k_cache.shape[:3])}, got "
            f"{tuple(v_cache.shape)}"
        )
    page = view_page_size(length)
    per_row = length // page
    views = [c.view(rows * per_row, page, *c.shape[2:]) for c in (k_cache, v_cache)]
    table = torch.arange(batch * per_row, dtype=torch.int32, device=k_cache.device).view(batch, per_row)
    return views[0], views[1], table


def _host_kvcache_checks(cache_seqlens, table, new, seqlen_q, page, num_pages, paged):
    """Values of cache_seqlens and block_table on the host: lengths in range, used pages inside the cache, no cache
    slot written twice, no query longer than its context."""
    lengths, pages = cache_seqlens.numpy(), table.numpy()
    capacity = pages.shape[1] * page
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"cache_seqlens: expected lengths >= 0, got {int(lengths.min())}")
    for b, length in enumerate(lengths.tolist()):
        total = length + new
        if total > capacity:
            where = f"block_table's {pages.shape[1]} pages of {page}" if paged else f"the cache's {capacity} rows"
            raise ValueError(
                f"cache_seqlens: sequence {b} holds {length} tokens; with {new} new ones it needs {total} rows, more "
                f"than {where}"
            )
        if seqlen_q > total:
            raise ValueError(
                f"q: sequence {b} has {seqlen_q} queries but a context of {total} (cache_seqlens + new tokens): a "
                f"query cannot be longer than its context"
            )
        used = pages[b, : -(-total // page)]
        bad = used[(used < 0) | (used >= num_pages)]
        if bad.size:
            raise ValueError(
                f"block_table: expected page indices from 0 to {num_pages - 1} (k_cache's pages) for the pages "
                f"sequence {b} uses, got {int(bad[0])}"
            )
    if new:
        position = lengths[:, None] + np.arange(new)[None, :]
        slots = np.take_along_axis(pages, position // page, axis=1) * page + position % page
        unique, counts = np.unique(slots, return_counts=True)
        if (counts > 1).any():
            raise ValueError(
                f"block_table: two new tokens would be written to one cache slot ({int(unique[counts > 1][0])}): "
                f"sequences share a page they write to"
            )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two real host tensors share bytes of one storage (e.g. transformers' paged cache: K and V page views
    of one flat buffer). Device, fake and meta tensors are not inspected."""
    if not _host(a, b) or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (a, b)]
    return spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]


def _slots(cache_seqlens, table, new, page):
    """Slot (page * page_size + offset) of each new token, [B * new]; positions outside the table get -1 (skipped:
    unchecked device metadata never writes outside the cache)."""
    position = cache_seqlens[:, None] + torch.arange(new, dtype=torch.int32, device=table.device)[None, :]
    index = torch.div(position, page, rounding_mode="floor")
    inside = (position >= 0) & (index < table.shape[1])
    pages = torch.gather(table, 1, index.clamp(0, table.shape[1] - 1).long())
    slots = torch.where(inside, pages * page + position % page, torch.full_like(position, -1))
    return slots.reshape(-1).to(torch.int32)


def _rotary_positions(rotary_cos, cache_seqlens, steps, per_row):
    """Positions [B, steps] of flash-attn's rotary: row i at cache_seqlens + i when per_row, else every row at
    cache_seqlens; on host tensors each must have a row of the tables."""
    offsets = torch.arange(steps, dtype=torch.int32, device=cache_seqlens.device)[None, :]
    positions = cache_seqlens[:, None] + (offsets if per_row else torch.zeros_like(offsets))
    if _host(cache_seqlens) and positions.numel():
        last = int(positions.max())
        if last >= rotary_cos.shape[0]:
            raise ValueError(
                f"rotary_cos: expected a row per position up to {last} (cache_seqlens + new tokens), got "
                f"{rotary_cos.shape[0]} rows"
            )
    return positions


def _rotate_query(q, rotary_cos, rotary_sin, positions, interleaved):
    """q [B, Sq, Hq, D] rotated by the rotary op at positions [B, Sq] (flash-attn's half-width tables gathered and
    widened to the op's [B, Sq, rotary_dim]): for queries whose positions are not the new keys' (see
    flash_attn_with_kvcache)."""
    index = positions.clamp(0, rotary_cos.shape[0] - 1).long()
    tables = []
    for t in (rotary_cos, rotary_sin):
        rows = t[index]
        tables.append(rows.repeat_interleave(2, dim=-1) if interleaved else torch.cat([rows, rows], dim=-1))
    return rotary_ops.apply_rotary(q, None, *tables, interleaved=interleaved, layout="bshd")[0]


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash-attn 2's flash_attn_with_kvcache: append the new k / v to the KV cache in place, then attend.

    q [B, Sq, Hq, D]. k_cache / v_cache: paged [num_blocks, page_block_size, Hkv, D / Dv] with block_table [B,
    max_blocks] (int32, int64 cast once; page_block_size a multiple of 16), or [B_cache >= B, S_cache, Hkv, D / Dv]
    without it (S_cache a multiple of 16; read as pages in place). k [B, Snew, Hkv, D], v [B, Snew, Hkv, Dv] or both
    None: token j of sequence b is written at position cache_seqlens[b] + j of its cache, in place (the caller's
    tensors keep their storage; only those slots change). cache_seqlens: an int or [B] tensor, the tokens already
    cached (None: the whole cache, without new k / v). rotary_cos / rotary_sin [seqlen_ro, rotary_dim / 2] (float32,
    bfloat16 or float16, only with k / v): q and the new k are rotated before the attention, k's token j at position
    cache_seqlens + j (in the kernel that writes it), q's row i at cache_seqlens + i when causal or local
    (window_size != (-1, -1)), else at cache_seqlens; rotary_interleaved: GPT-J pairs (2i, 2i + 1) when True, halves
    (i, i + rotary_dim / 2) when False. Attention over
    cache_seqlens + Snew keys per sequence: causal bottom-right aligned, window_size (left, right), softcap,
    softmax_scale (None: D ** -0.5), s_aux [Hq] sink logits (gpt-oss). -> out [B, Sq, Hq, Dv] in q's dtype.

    float32 or bfloat16 (the cache in q's dtype). Inference only. num_splits (flash-attn's split-KV count, a
    scheduling choice that does not change the result) is accepted and has no effect: the kernel's tiling comes from
    its tuning table. Not implemented (an error if set): cache_batch_idx, cache_leftpad, alibi_slopes,
    return_softmax_lse.
    """
    _refuse_kvcache_options(cache_batch_idx, cache_leftpad, alibi_slopes, num_splits, return_softmax_lse)
    others = {"k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "rotary_cos": rotary_cos}
    others |= {"rotary_sin": rotary_sin, "block_table": block_table, "s_aux": s_aux}
    if isinstance(cache_seqlens, torch.Tensor):
        others["cache_seqlens"] = cache_seqlens
    _check_devices(("q", q), others)
    _refuse_grad("flash_attn_with_kvcache", {"q": q, **others})
    if q.dim() != 4:
        raise ValueError(f"q: expected [batch, seqlen_q, heads, head_dim], got shape {tuple(q.shape)}")
    batch, seqlen_q = q.shape[:2]
    if (k is None) != (v is None):
        raise ValueError(
            f"{'v' if v is None else 'k'}: expected k and v together (both new tokens or neither), got None"
        )
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(
            f"{'rotary_sin' if rotary_sin is None else 'rotary_cos'}: expected rotary_cos and rotary_sin together, "
            "got None"
        )
    if rotary_cos is not None and k is None:
        raise ValueError(
            "rotary_cos: rotary embedding applies with new k and v to append (flash-attn's rule), got k=None"
        )
    new = 0
    if k is not None:
        for name, x, cache in (("k", k, k_cache), ("v", v, v_cache)):
            if x.dim() != 4 or x.shape[0] != batch or tuple(x.shape[2:]) != tuple(cache.shape[2:]):
                raise ValueError(
                    f"{name}: expected [{batch}, new tokens, {cache.shape[2]}, {cache.shape[3]}] (q's batch, the "
                    f"cache's kv heads and head dim), got shape {tuple(x.shape)}"
                )
        if v.shape[1] != k.shape[1]:
            raise ValueError(f"v: expected {k.shape[1]} new tokens (k's), got shape {tuple(v.shape)}")
        new = k.shape[1]

    if block_table is not None:
        table = _int_tensor("block_table", block_table, 2)
        if table.shape[0] != batch:
            raise ValueError(
                f"block_table: expected [{batch}, max_blocks] (one row per sequence of q), got {tuple(table.shape)}"
            )
        k_pages, v_pages = _cache_view("k_cache", k_cache), _cache_view("v_cache", v_cache)
        if k_pages.dim() != 4:
            raise ValueError(
                f"k_cache: expected [num_blocks, page_block_size, kv_heads, head_dim] with block_table, got shape "
                f"{tuple(k_pages.shape)}"
            )
    else:
        k_pages, v_pages, table = _paged_view(k_cache, v_cache, batch)
    page = k_pages.shape[1]
    capacity = table.shape[1] * page

    if cache_seqlens is None:
        if new:
            raise ValueError(
                "cache_seqlens: expected the cached lengths (an int or a [batch] tensor) to append k and v at, got None"
            )
        seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, torch.Tensor):
        seqlens = _int_tensor("cache_seqlens", cache_seqlens, 1)
        if seqlens.shape[0] != batch:
            raise ValueError(
                f"cache_seqlens: expected shape ({batch},), one length per sequence, got {tuple(seqlens.shape)}"
            )
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    else:
        raise TypeError(f"cache_seqlens: expected None, an int or an int32 tensor, got {type(cache_seqlens).__name__}")
    if _host(seqlens, table) and not checks.has_symbolic_shape(q, k_pages):
        _host_kvcache_checks(seqlens, table, new, seqlen_q, page, k_pages.shape[0], block_table is not None)

    window_size = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    names = {"key_cache": "k_cache", "value_cache": "v_cache", "key": "k", "value": "v"}
    if new and _overlap(k_pages, v_pages):
        # The write updates each cache as one array (donated on TPU, copied back whole on CPU): with shared bytes,
        # writing one would restore the other's old rows.
        raise ValueError(
            "v_cache: expected a tensor that shares no memory with k_cache (the new k and v are written in place, "
            "each cache as a whole array), got overlapping views of one buffer"
        )
    if rotary_cos is not None:
        kv_cache_ops.check_rotary(rotary_cos, rotary_sin, q.shape[-1], rotary_interleaved)
        per_row = bool(causal) or window_size != (-1, -1)
        k_positions = _rotary_positions(rotary_cos, seqlens, new, True)
        # q rotates in the write's kernel when its rows sit at the new keys' positions (decode, and causal or local
        # chunks of the new tokens); otherwise (q at cache_seqlens, or a q longer or shorter than the new tokens) the
        # rotary op rotates it first, and the kernel rotates the key alone.
        fused_q = seqlen_q == new and (per_row or new == 1)
        if not fused_q:
            q_positions = _rotary_positions(rotary_cos, seqlens, seqlen_q, per_row)
            q = _rotate_query(q, rotary_cos, rotary_sin, q_positions, rotary_interleaved)
        with _renamed(names | {"query": "q"}):
            q_rot = kv_cache_ops.rope_and_reshape_and_cache_flash(
                q.reshape(batch * seqlen_q, *q.shape[2:]) if fused_q else None,
                k.reshape(batch * new, *k.shape[2:]),
                v.reshape(batch * new, *v.shape[2:]),
                k_pages,
                v_pages,
                _slots(seqlens, table, new, page),
                rotary_cos,
                rotary_sin,
                k_positions.reshape(-1),
                rotary_interleaved=rotary_interleaved,
            )
        if fused_q:
            q = q_rot.view(q.shape)
    elif new:
        with _renamed(names):
            kv_cache_ops.reshape_and_cache_flash(
                k.reshape(batch * new, *k.shape[2:]),
                v.reshape(batch * new, *v.shape[2:]),
                k_pages,
                v_pages,
                _slots(seqlens, table, new, page),
            )
    cu_q_lens = torch.arange(0, (batch + 1) * seqlen_q, max(seqlen_q, 1), dtype=torch.int32, device=q.device)[
        : batch + 1
    ]
    with _renamed({"kv_lens": "cache_seqlens", "page_indices": "block_table", "sinks": "s_aux"}):
        out = ragged_paged_attention(
            q.reshape(batch * seqlen_q, *q.shape[2:]),
            k_pages,
            v_pages,
            seqlens + new,
            table,
            cu_q_lens,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            sinks=s_aux,
        )
    return out.view(batch, seqlen_q, *out.shape[1:])


# ------------------------------------------------------------------------------- flash_attn_varlen_func, block_table
def flash_attn_varlen_paged(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    block_table,
    softmax_scale,
    causal,
    window_size,
    softcap,
    s_aux,
):
    """flash_attn_varlen_func's paged form (called by it when block_table is given): k / v are the paged caches
    [num_blocks, page_block_size, Hkv, D / Dv], sequence s's context is its cu_seqlens_k[s + 1] - cu_seqlens_k[s]
    first positions in pages block_table[s], its queries rows cu_seqlens_q[s]:cu_seqlens_q[s + 1] of q, the last
    positions of that context (causal bottom-right). Routed to ragged_paged_attention. Inference only."""
    _check_devices(
        ("q", q),
        {
            "k": k,
            "v": v,
            "cu_seqlens_q": cu_seqlens_q,
            "cu_seqlens_k": cu_seqlens_k,
            "block_table": block_table,
            "s_aux": s_aux,
        },
    )
    _refuse_grad("flash_attn_varlen_func with block_table", {"q": q, "k": k, "v": v, "s_aux": s_aux})
    cu_q = _int_tensor("cu_seqlens_q", cu_seqlens_q, 1)
    cu_k = _int_tensor("cu_seqlens_k", cu_seqlens_k, 1)
    table = _int_tensor("block_table", block_table, 2)
    if cu_k.shape != cu_q.shape:
        raise ValueError(
            f"cu_seqlens_k: expected the shape of cu_seqlens_q {tuple(cu_q.shape)} (one entry per sequence + 1), got "
            f"{tuple(cu_k.shape)}"
        )
    if table.shape[0] + 1 != cu_q.shape[0]:
        raise ValueError(
            f"block_table: expected {cu_q.shape[0] - 1} rows (one per sequence of cu_seqlens_q), got shape "
            f"{tuple(table.shape)}"
        )
    if _host(cu_q, cu_k):
        for name, cu, value in (("cu_seqlens_q", cu_q, max_seqlen_q), ("cu_seqlens_k", cu_k, max_seqlen_k)):
            offsets = cu.numpy()
            if offsets.size and offsets[0] != 0:
                raise ValueError(f"{name}: expected to start at 0, got {int(offsets[0])}")
            lengths = np.diff(offsets)
            if (lengths < 0).any():
                raise ValueError(f"{name}: expected non-decreasing offsets, got {offsets.tolist()}")
            longest = int(lengths.max()) if lengths.size else 0
            if isinstance(value, torch.Tensor):
                value = int(value.item()) if value.numel() == 1 else value
            attention_checks.check_max_seqlen(name.replace("cu_seqlens", "max_seqlen"), value, longest)
    kv_lens = cu_k[1:] - cu_k[:-1]
    names = {"k_cache": "k", "v_cache": "v", "kv_lens": "cu_seqlens_k", "page_indices": "block_table"}
    with _renamed(names | {"cu_q_lens": "cu_seqlens_q", "sinks": "s_aux"}):
        return ragged_paged_attention(
            q,
            k,
            v,
            kv_lens,
            table,
            cu_q,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            sinks=s_aux,
        )
