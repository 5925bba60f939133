"""Input checks of the flash attention entry points, shared by the JAX api and the torch ops: each raises
TypeError/ValueError naming the argument, what was expected and what was given, before anything is traced."""

import math

import jax.numpy as jnp
import numpy as np

from ..common.validation import check_array, check_bool, is_concrete

MAX_HEAD_DIM = 512


def check_options(softmax_scale, causal, window_size, softcap, head_dim):
    causal = check_bool("causal", causal)
    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"softmax_scale: expected a Python float or None, got {type(softmax_scale).__name__}")
    softmax_scale = float(softmax_scale)
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale: expected a finite number > 0, got {softmax_scale}")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size: expected a pair (left, right) of ints, got {window_size!r}")
    window = []
    for side, w in zip(("left", "right"), window_size):
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)):
            raise TypeError(f"window_size: expected ints, got {side} = {w!r}")
        if w < -1:
            raise ValueError(f"window_size: expected -1 (unbounded) or a size >= 0, got {side} = {int(w)}")
        window.append(int(w))
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating, np.integer)):
        raise TypeError(f"softcap: expected a Python float, got {type(softcap).__name__}")
    softcap = float(softcap)
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap: expected a finite number >= 0 (0 disables it), got {softcap}")
    return softmax_scale, causal, tuple(window), softcap


def check_qkv(q, k, v, ndim):
    """Shapes of q, k, v with the heads in dim -2 and head dims in -1; returns (dtype, Hq, Hkv, D, Dv)."""
    dtype = check_array("q", q, ndim=ndim)
    check_array("k", k, ndim=ndim, dtypes=(dtype,))
    check_array("v", v, ndim=ndim, dtypes=(dtype,))
    if tuple(k.shape[:-1]) != tuple(v.shape[:-1]):
        raise ValueError(
            f"v: expected the leading dimensions of k {tuple(k.shape[:-1])} (rows, kv heads), got {tuple(v.shape)}"
        )
    if ndim == 4 and k.shape[0] != q.shape[0]:
        raise ValueError(f"k: expected the batch size of q ({q.shape[0]}), got shape {tuple(k.shape)}")
    hq, hkv, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"k: expected the head dim of q ({d}), got shape {tuple(k.shape)}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q: expected a number of heads that is a multiple of k's {hkv} kv heads, got {hq}")
    for name, dim in (("q", d), ("v", dv)):
        if not 0 < dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: expected a head dim from 1 to {MAX_HEAD_DIM}, got {dim}")
    return dtype, hq, hkv, d, dv


def check_sinks(sinks, q_heads):
    if sinks is None:
        return None
    check_array("sinks", sinks, ndim=1)
    if sinks.shape[0] != q_heads:
        raise ValueError(f"sinks: expected shape ({q_heads},), one logit per query head, got {tuple(sinks.shape)}")
    return sinks


def check_cu_seqlens(name, cu, rows):
    check_array(name, cu, ndim=1, dtypes=(jnp.dtype(jnp.int32),))
    if cu.shape[0] < 2:
        raise ValueError(f"{name}: expected at least 2 entries (sequences + 1), got shape {tuple(cu.shape)}")
    if is_concrete(cu):
        values = np.asarray(cu)
        if values[0] != 0:
            raise ValueError(f"{name}: expected to start at 0, got {int(values[0])}")
        if np.any(np.diff(values) < 0):
            raise ValueError(f"{name}: expected non-decreasing offsets, got {values.tolist()}")
        if values[-1] != rows:
            raise ValueError(f"{name}: expected to end at the token count {rows}, got {int(values[-1])}")
        return int(np.diff(values).max())
    return None


def check_max_seqlen(name, value, actual):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected a Python int, got {type(value).__name__}")
    value = int(value)
    if value < 0:
        raise ValueError(f"{name}: expected a length >= 0, got {value}")
    if actual is not None and value < actual:
        raise ValueError(f"{name}: expected at least the longest sequence, {actual}, got {value}")
    return value
