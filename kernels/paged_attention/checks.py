"""Input checks of ragged paged attention, shared by the JAX api and the torch ops: each raises TypeError/ValueError
naming the argument, what was expected and what was given, before anything is traced. Metadata values (lengths, page
indices) are checked on concrete (host) arrays; on traced ones the kernel clamps them (see api.py)."""

import jax.numpy as jnp
import numpy as np

from ..common.validation import check_array, is_concrete
from ..flash_attention.checks import MAX_HEAD_DIM

INT32 = (jnp.dtype(jnp.int32),)
FP8 = jnp.dtype(jnp.float8_e4m3fn)
PAGE_MULTIPLE = 16  # a page is whole sublane tiles for every cache dtype's VMEM layout (16-bit: 16 rows)


def check_caches(q, k_cache, v_cache):
    """Shapes and dtypes of q [T, Hq, D] and the caches [pages, page_size, Hkv, D / Dv]; returns
    (Hq, Hkv, D, Dv, page_size)."""
    dtype = check_array("q", q, ndim=3)
    compute = jnp.dtype(jnp.float32) if dtype == jnp.float16 else dtype
    cache_dtypes = tuple(dict.fromkeys((dtype, compute, FP8)))
    cache_dtype = check_array("k_cache", k_cache, ndim=4, dtypes=cache_dtypes)
    check_array("v_cache", v_cache, ndim=4, dtypes=(cache_dtype,))
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise ValueError(
            f"v_cache: expected the pages, page size and kv heads of k_cache {tuple(k_cache.shape[:3])}, got "
            f"{tuple(v_cache.shape)}"
        )
    hq, d = q.shape[1], q.shape[2]
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache: expected the head dim of q ({d}), got shape {tuple(k_cache.shape)}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q: expected a number of heads that is a multiple of the caches' {hkv} kv heads, got {hq}")
    dv = v_cache.shape[3]
    for name, dim in (("q", d), ("v_cache", dv)):
        if not 0 < dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: expected a head dim from 1 to {MAX_HEAD_DIM}, got {dim}")
    if page_size == 0 or page_size % PAGE_MULTIPLE:
        raise ValueError(
            f"k_cache: expected a page size (dim 1) that is a multiple of {PAGE_MULTIPLE}, got {page_size}"
        )
    if k_cache.shape[0] == 0:
        raise ValueError(f"k_cache: expected at least one page, got shape {tuple(k_cache.shape)}")
    return hq, hkv, d, dv, page_size


def check_scale(name, scale, cache_dtype):
    """A cache scale: None (1), a Python float, or a float32 array of shape [] or [1]; required for a float8 cache.
    Returns None, the float (static: the kernel takes it as a constant) or the array as [1]."""
    if scale is None:
        if jnp.dtype(cache_dtype) == FP8:
            raise ValueError(f"{name}: expected a scale for the float8_e4m3fn cache (stored = value / scale), got None")
        return None
    if isinstance(scale, (float, int, np.floating, np.integer)) and not isinstance(scale, bool):
        if not np.isfinite(scale) or scale <= 0:
            raise ValueError(f"{name}: expected a finite number > 0, got {scale}")
        return float(scale)
    check_array(name, scale, dtypes=(jnp.dtype(jnp.float32),))
    if tuple(scale.shape) not in ((), (1,)):
        raise ValueError(f"{name}: expected shape () or (1,), one scale for the whole cache, got {tuple(scale.shape)}")
    if is_concrete(scale):
        value = float(np.asarray(scale).reshape(-1)[0])
        if not np.isfinite(value) or value <= 0:
            raise ValueError(f"{name}: expected a finite number > 0, got {value}")
    return scale.reshape(1)


def check_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, *, tokens, num_pages, page_size):
    """Shapes and dtypes of the ragged batch's metadata and, on host arrays, its values. Returns num_seqs as an
    int32 array [1] (None: every sequence of kv_lens)."""
    check_array("kv_lens", kv_lens, ndim=1, dtypes=INT32)
    check_array("page_indices", page_indices, ndim=2, dtypes=INT32)
    check_array("cu_q_lens", cu_q_lens, ndim=1, dtypes=INT32)
    n = kv_lens.shape[0]
    if n == 0:
        raise ValueError("kv_lens: expected at least one sequence, got shape (0,)")
    if page_indices.shape[0] != n or page_indices.shape[1] == 0:
        raise ValueError(
            f"page_indices: expected shape ({n}, pages per sequence >= 1), one row per sequence of kv_lens, got "
            f"{tuple(page_indices.shape)}"
        )
    if cu_q_lens.shape[0] != n + 1:
        raise ValueError(f"cu_q_lens: expected shape ({n + 1},), sequences + 1, got {tuple(cu_q_lens.shape)}")
    if num_seqs is None:
        live = n
        num_seqs = jnp.full((1,), n, jnp.int32)
    elif isinstance(num_seqs, (int, np.integer)) and not isinstance(num_seqs, bool):
        live = int(num_seqs)
        if not 0 <= live <= n:
            raise ValueError(f"num_seqs: expected 0 to {n} (the sequences of kv_lens), got {live}")
        num_seqs = jnp.full((1,), live, jnp.int32)
    else:
        check_array("num_seqs", num_seqs, dtypes=INT32)
        if tuple(num_seqs.shape) not in ((), (1,)):
            raise ValueError(f"num_seqs: expected an int or an int32 array of shape () or (1,), got {num_seqs.shape}")
        live = int(np.asarray(num_seqs).reshape(-1)[0]) if is_concrete(num_seqs) else None
        if live is not None and not 0 <= live <= n:
            raise ValueError(f"num_seqs: expected 0 to {n} (the sequences of kv_lens), got {live}")
        num_seqs = num_seqs.reshape(1)
    if live is not None and all(is_concrete(a) for a in (kv_lens, page_indices, cu_q_lens)):
        _check_values(
            np.asarray(kv_lens)[:live],
            np.asarray(page_indices)[:live],
            np.asarray(cu_q_lens)[: live + 1],
            tokens=tokens,
            num_pages=num_pages,
            page_size=page_size,
        )
    return num_seqs


def _check_values(kv_lens, page_indices, cu, *, tokens, num_pages, page_size):
    if cu[0] != 0:
        raise ValueError(f"cu_q_lens: expected to start at 0, got {int(cu[0])}")
    q_lens = np.diff(cu)
    if np.any(q_lens < 0):
        raise ValueError(f"cu_q_lens: expected non-decreasing offsets, got {cu.tolist()}")
    if cu[-1] > tokens:
        raise ValueError(f"cu_q_lens: expected offsets up to the {tokens} query tokens, got {int(cu[-1])}")
    capacity = page_indices.shape[1] * page_size
    for s, (kv_len, q_len) in enumerate(zip(kv_lens, q_lens)):
        if not 0 <= kv_len <= capacity:
            raise ValueError(
                f"kv_lens: expected lengths from 0 to {capacity} (page_indices' {page_indices.shape[1]} pages of "
                f"{page_size}), got {int(kv_len)} for sequence {s}"
            )
        if q_len > kv_len:
            raise ValueError(
                f"cu_q_lens: sequence {s} has {int(q_len)} queries but a context of {int(kv_len)} (kv_lens counts the "
                f"new tokens too, so a query cannot be longer than its context)"
            )
        used = page_indices[s, : -(-int(kv_len) // page_size)]
        bad = used[(used < 0) | (used >= num_pages)]
        if bad.size:
            raise ValueError(
                f"page_indices: expected pages from 0 to {num_pages - 1} (k_cache's pages), got {int(bad[0])} in "
                f"sequence {s}"
            )
