"""Output types of the pallas_calls inside `jax.shard_map`.

With shard_map's default `check_vma=True` every value carries the manual mesh axes it varies over, and a
pallas_call must declare those of its outputs (it cannot infer them: the kernel body is opaque to JAX). Each kernel's
outputs depend on all of its operands, so they vary over the union of the operands' axes. Every pallas_call in this
package builds its `out_shape` with `out_struct`; outside shard_map (or with `check_vma=False`) the declaration is
empty and ignored.
"""

import jax
from jax.sharding import ManualAxisType


def varying_axes(*operands) -> frozenset:
    """The manual mesh axes any array leaf of `operands` (pytrees; None and Python scalars skipped) varies over."""
    axes = set()
    for leaf in jax.tree_util.tree_leaves(operands):
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            axis_type = getattr(jax.typeof(leaf), "manual_axis_type", None)
            if axis_type is not None:
                axes |= axis_type.varying
    return frozenset(axes)


def out_struct(shape, dtype, *operands) -> jax.ShapeDtypeStruct:
    """A pallas_call output of `shape` and `dtype` computed from `operands`: varying over the axes they vary over."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype, manual_axis_type=ManualAxisType(varying=varying_axes(*operands)))


def cotangent_like(cotangent, primal):
    """A custom VJP's cotangent for `primal` with the primal's varying axes, as jax.grad's own rules give it: summed
    over the axes only the cotangent varies over (an invariant weight used by every shard gets the sum of the shards'
    gradients), marked varying over those only the primal varies over. None passes through."""
    if cotangent is None or primal is None:
        return cotangent
    have, want = varying_axes(cotangent), varying_axes(primal)
    if extra := have - want:
        cotangent = jax.lax.psum(cotangent, tuple(sorted(extra)))
    if missing := want - have:
        cotangent = jax.lax.pcast(cotangent, tuple(sorted(missing)), to="varying")
    return cotangent


def cotangents_like(cotangents, primals) -> tuple:
    """cotangent_like over matching sequences."""
    return tuple(cotangent_like(c, p) for c, p in zip(cotangents, primals, strict=True))
