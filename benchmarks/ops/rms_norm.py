"""RMSNorm and fused residual-add + RMSNorm against the plain JAX path XLA compiles (the references)."""

import jax
import jax.numpy as jnp

from tpu_kernels_jax.common import chip
from tpu_kernels_jax.rms_norm import api, reference, tuning

from .. import shapes
from ..suite import Baseline, Op, Suite, Targets

EPS = 1e-6
SWEEP = {(8, 2048), (4096, 2048), (4096, 4096), (32768, 4096)}  # (tokens, hidden) swept without --full


def kernel_rms_norm(x, weight, *, blocks=None):
    return api.rms_norm(x, weight, EPS, blocks=blocks)


def default_rms_norm(x, weight):
    return reference.rms_norm_reference(x, weight, EPS)


def kernel_fused_add_rms_norm(x, residual, weight, *, blocks=None):
    return api.fused_add_rms_norm(x, residual, weight, EPS, blocks=blocks)


def default_fused_add_rms_norm(x, residual, weight):
    return reference.fused_add_rms_norm_reference(x, residual, weight, EPS)


# What the chip streams for an op's traffic, measured beside it: XLA's one elementwise fusion reading and writing the
# same arrays. Measured on the v5e, equal read and write bytes stream at 80.1-80.5 % of its 819 GB/s in every
# implementation (XLA, Pallas blocks of 1-8 MiB, two or three buffers, two concurrent streams), reads alone at 90-92 %.
COPY = "XLA copy (same bytes)"


def copy_rms_norm(x, weight):
    """x read, an array of its size written: rms_norm's traffic with no norm."""
    return x * 2


def copy_fused_add_rms_norm(x, residual, weight):
    """x and residual read, two arrays of their size written: fused_add_rms_norm's traffic with no norm."""
    return x + residual, x - residual


def _rows(shape):
    return jax.ShapeDtypeStruct((shape["tokens"], shape["hidden"]), jnp.dtype(shape.dtype))


def _weight(shape):
    return jax.ShapeDtypeStruct((shape["hidden"],), jnp.dtype(shape.dtype))


def _candidates(shape, gen):
    """The tuning module's candidate row blocks for x of this shape on `gen` (both ops share one table)."""
    return tuning.candidate_blocks(**api.tuning_arguments(_rows(shape)), info=chip.tpu_info_for(gen))


def _row_bytes(shape):
    return shape["tokens"] * shape["hidden"] * jnp.dtype(shape.dtype).itemsize


SUITE = Suite(
    kernel="rms_norm",
    ops=(
        Op(
            name="rms_norm",
            kernel=kernel_rms_norm,
            default=default_rms_norm,
            specs=lambda s: (_rows(s), _weight(s)),
            # read x, write out, read the weight once
            hbm_bytes=lambda s: 2 * _row_bytes(s) + s["hidden"] * jnp.dtype(s.dtype).itemsize,
            candidates=_candidates,
            baselines=(Baseline(COPY, copy_rms_norm),),
        ),
        Op(
            name="fused_add_rms_norm",
            kernel=kernel_fused_add_rms_norm,
            default=default_fused_add_rms_norm,
            specs=lambda s: (_rows(s), _rows(s), _weight(s)),
            # read x and residual, write out and the sum, read the weight once
            hbm_bytes=lambda s: 4 * _row_bytes(s) + s["hidden"] * jnp.dtype(s.dtype).itemsize,
            candidates=_candidates,
            baselines=(Baseline(COPY, copy_fused_add_rms_norm),),
        ),
    ),
    shapes=shapes.RMS_NORM,
    # decode, prefill and long prefill at Qwen3's hidden size and at 4096
    sweep_shapes=tuple(s for s in shapes.RMS_NORM if (s["tokens"], s["hidden"]) in SWEEP),
    targets=Targets(
        goal=">= 85 % of the HBM roofline at >= 4096 tokens, faster than XLA at every shape",
        min_efficiency=0.85,
        min_efficiency_from_batch=4096,
        beats_default=True,
    ),
)
