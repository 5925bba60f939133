"""The MoE grouped matmuls on the ragged dot kernel: gate/up (act(gate) * up fused into the epilogue) and down,
against XLA's `jax.lax.ragged_dot` (the default), tokamax's Pallas ragged dot and JAX's Pallas grouped matmul
(`jax.experimental.pallas.ops.tpu.megablox.gmm`, MaxText's MoE kernel), with the same random routing.

Weights are in transformers' layout, rhs [E, N, K] (`rhs_transposed=True`; every implementation contracts the same
layout: megablox with `transpose_rhs`). gate/up: lhs [M, H] bf16 x [E, 2I, H] -> act(gate) * up [M, I] bf16; the
baselines run the [M, 2I] product in f32 and the epilogue in XLA (none fuses a gated epilogue). down: [M, I] bf16 x
[E, H, I] -> [M, H] f32, as experts_forward uses it. megablox runs at its default tiling (128, 128, 128), the row tile
capped at M.

Inputs are made on the device (benchmarks/inputs.py); the group sizes come from the routing on the host (numpy,
fixed seed), as the performance model needs them concrete.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tpu_kernels_jax.ragged_dot import api as ragged_dot_api

from .. import inputs, shapes
from ..suite import Baseline, Op, Suite, Targets
from . import _moe

BF16, F32 = jnp.bfloat16, jnp.float32


def _kernel_options(op, activation):
    """ragged_dot's keyword arguments for each op (the kernel path and its candidate tilings share them)."""
    if op == "gate_up":
        return dict(rhs_transposed=True, activation=activation, gated="concatenated", preferred_element_type=BF16)
    return dict(rhs_transposed=True, preferred_element_type=F32)


def kernel_gate_up(lhs, rhs, group_sizes, *, activation, blocks=None):
    return ragged_dot_api.ragged_dot(lhs, rhs, group_sizes, blocks=blocks, **_kernel_options("gate_up", activation))


def xla_gate_up(lhs, rhs, group_sizes, *, activation):
    return _moe.gated_epilogue(_moe.xla_ragged_dot(lhs, rhs, group_sizes, out_dtype=F32), activation, BF16)


def tokamax_gate_up(lhs, rhs, group_sizes, *, activation):
    return _moe.gated_epilogue(_moe.tokamax_ragged_dot(lhs, rhs, group_sizes, out_dtype=F32), activation, BF16)


def megablox_gate_up(lhs, rhs, group_sizes, *, activation):
    return _moe.gated_epilogue(_moe.megablox_ragged_dot(lhs, rhs, group_sizes, out_dtype=F32), activation, BF16)


def kernel_down(lhs, rhs, group_sizes, *, activation=None, blocks=None):
    return ragged_dot_api.ragged_dot(lhs, rhs, group_sizes, blocks=blocks, **_kernel_options("down", activation))


def xla_down(lhs, rhs, group_sizes, *, activation=None):
    return _moe.xla_ragged_dot(lhs, rhs, group_sizes, out_dtype=F32)


def tokamax_down(lhs, rhs, group_sizes, *, activation=None):
    return _moe.tokamax_ragged_dot(lhs, rhs, group_sizes, out_dtype=F32)


def megablox_down(lhs, rhs, group_sizes, *, activation=None):
    return _moe.megablox_ragged_dot(lhs, rhs, group_sizes, out_dtype=F32)


# (K, N of rhs [E, N, K], output width, output bytes per element) per op
def _dims(op, s):
    h, i = s["hidden"], s["intermediate"]
    return (h, 2 * i, i, 2) if op == "gate_up" else (i, h, h, 4)


def _specs(op, s):
    k, n, _, _ = _dims(op, s)
    return (
        jax.ShapeDtypeStruct((_moe.rows_of(s), k), BF16),
        jax.ShapeDtypeStruct((s["experts"], n, k), BF16),
        jax.ShapeDtypeStruct((s["experts"],), jnp.int32),
    )


def _model_args(op, s):
    """Matrices as specs, group sizes concrete (the kernel's grid and block indices follow them)."""
    lhs, rhs, _ = _specs(op, s)
    return lhs, rhs, jnp.asarray(_moe.group_sizes_of(s))


def _arrays(op, s, seed):
    """Random lhs and rhs (scaled by K^-1/2) made on the device; the routing's group sizes."""
    k, n, _, _ = _dims(op, s)
    key_lhs, key_rhs = inputs.keys(seed, 2)
    lhs = inputs.normal(key_lhs, (_moe.rows_of(s), k), BF16)
    rhs = inputs.normal(key_rhs, (s["experts"], n, k), BF16, scale=1 / np.sqrt(k))
    return lhs, rhs, jnp.asarray(_moe.group_sizes_of(s))


def _hbm_bytes(op, s):
    """The expert weights touched (groups with rows), lhs read once, the output written once."""
    k, n, n_out, out_bytes = _dims(op, s)
    m = _moe.rows_of(s)
    return _moe.experts_touched(s) * n * k * 2 + m * k * 2 + m * n_out * out_bytes + s["experts"] * 4


def _flops(op, s):
    k, n, _, _ = _dims(op, s)
    return 2 * _moe.rows_of(s) * k * n


def _candidates(op, s, gen):
    """The forward kernel's candidate tilings (ragged_dot_api.candidate_blocks) for this op's call; the sweep runs this
    under gen's device, which the tuning table reads."""
    return ragged_dot_api.candidate_blocks(*_specs(op, s), **_kernel_options(op, s["activation"]))


def _tokamax_unsupported(s):
    return _moe.tokamax_available() or _moe.tokamax_unsupported(s)


def _op(name, kernel, default, tokamax, megablox):
    return Op(
        name=name,
        kernel=kernel,
        default=default,
        specs=functools.partial(_specs, name),
        model_args=functools.partial(_model_args, name),
        arrays=functools.partial(_arrays, name),
        hbm_bytes=functools.partial(_hbm_bytes, name),
        mxu_flops=functools.partial(_flops, name),
        default_name="XLA ragged_dot",
        baselines=(
            Baseline("tokamax", tokamax, _tokamax_unsupported),
            Baseline("megablox", megablox, _moe.megablox_unsupported),
        ),
        static=lambda s: {"activation": s["activation"]},
        candidates=functools.partial(_candidates, name),
    )


# `--sweep` without --full: Qwen3's decode at 8 and 256 tokens and its 4096-row prefill
SWEEP = tuple(
    s
    for s in shapes.RAGGED_DOT_QUICK
    if s["model"] == "qwen3-30b-a3b" and (s["phase"], s.batch) in {("decode", 8), ("decode", 256), ("prefill", 4096)}
)

SUITE = Suite(
    kernel="ragged_dot",
    ops=(
        _op("gate_up", kernel_gate_up, xla_gate_up, tokamax_gate_up, megablox_gate_up),
        _op("down", kernel_down, xla_down, tokamax_down, megablox_down),
    ),
    shapes=shapes.RAGGED_DOT,
    quick_shapes=shapes.RAGGED_DOT_QUICK,
    sweep_shapes=SWEEP,
    targets=Targets(goal=_moe.GOAL, beats_default=True, custom=_moe.custom_targets),
    batch_unit="tokens (decode) / rows (prefill)",
)
