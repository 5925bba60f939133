"""Input checks shared by the api modules. Each raises TypeError/ValueError naming the argument, what was expected
and what was given, before anything is traced, so bad input never reaches Mosaic."""

import math

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _describe_dtypes(dtypes) -> str:
    return ", ".join(str(d) for d in dtypes)


def check_array(name: str, value, *, min_ndim: int = 0, ndim: int | None = None, dtypes=FLOAT_DTYPES):
    """Check that `value` is an array (concrete or traced) of an allowed dtype and rank; return its dtype."""
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"{name}: expected a jax array, got {type(value).__name__}")
    dtype = jnp.dtype(value.dtype)
    if dtypes is not None and dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in ({_describe_dtypes(dtypes)}), got {dtype}")
    if ndim is not None and len(value.shape) != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(value.shape)}")
    if len(value.shape) < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimension(s), got shape {tuple(value.shape)}")
    return dtype


def check_bool(name: str, value) -> bool:
    """A flag must be a bool (a string such as "no" would otherwise be taken as True)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def is_concrete(x) -> bool:
    """Values known now: a concrete jax or numpy array (not a tracer, not a ShapeDtypeStruct placeholder).

    Value checks (ranges, sums) run only on such arrays; under jit or export only shapes and dtypes are checked."""
    return isinstance(x, (jax.Array, np.ndarray)) and not isinstance(x, jax.core.Tracer)


def check_finite_nonnegative(name: str, value) -> float:
    """A static float parameter such as eps: a real number, finite, >= 0."""
    if isinstance(value, (jax.Array, np.ndarray)) or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a Python float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: expected a finite number >= 0, got {value}")
    return value


def check_finite(name: str, value) -> float:
    if isinstance(value, (jax.Array, np.ndarray)) or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a Python float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    return value
