"""Torch custom ops for the ragged dot and the MoE experts forward, their autograd, and `experts_forward`, the
function transformers' experts interface calls (`ALL_EXPERTS_FUNCTIONS.register("tpu_ragged_dot", experts_forward)`).
"""

import json

import jax
import jax.numpy as jnp
import torch

from tpu_kernels_jax.moe import api as moe_api
from tpu_kernels_jax.moe.tuning import ExpertsBlocks
from tpu_kernels_jax.ragged_dot import api as ragged_dot_api

from . import _torch_checks as checks
from ._op_registry import define_op, static_json

_NO_GATE = "none"  # gate_layout=None as a torch schema string


def _f32(x):
    """float16 runs through the kernels as float32 (TPUs have no float16 arithmetic); results are cast back."""
    return x.astype(jnp.float32) if x is not None and x.dtype == jnp.float16 else x


# The JAX functions the ops are made from. Annotations drive the torch schema (TorchTPU's jax_op convention).
def _ragged_dot_jax(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, rhs_transposed: bool) -> jax.Array:
    out = ragged_dot_api.ragged_dot(_f32(lhs), _f32(rhs), group_sizes, rhs_transposed=rhs_transposed)
    return out.astype(jnp.promote_types(lhs.dtype, rhs.dtype))


def _experts_forward_jax(
    hidden_states: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    gate_up_bias: jax.Array | None,
    down_bias: jax.Array | None,
    activation: str,
    gate_layout: str,
    weights_transposed: bool,
    blocks: str,
) -> jax.Array:
    out = moe_api.experts_forward(
        _f32(hidden_states),
        top_k_index,
        top_k_weights,
        _f32(gate_up_proj),
        _f32(down_proj),
        _f32(gate_up_bias),
        _f32(down_bias),
        activation=activation,
        gate_layout=None if gate_layout == _NO_GATE else gate_layout,
        weights_transposed=weights_transposed,
        blocks=ExpertsBlocks.from_dict(json.loads(blocks)) if blocks else None,
    )
    return out.astype(hidden_states.dtype)


def experts_blocks_json(blocks: ExpertsBlocks | None) -> str:
    """experts_forward's `blocks` as the op's static string: canonical JSON of ExpertsBlocks.to_dict(), or "" for
    None (the tuning table)."""
    if blocks is None:
        return ""
    if not isinstance(blocks, ExpertsBlocks):  # checked here too: under tracing moe_api.check_inputs does not run
        raise TypeError(f"blocks: expected an ExpertsBlocks or None, got {type(blocks).__name__} {blocks!r}")
    return static_json("blocks", blocks.to_dict())


def _fake_ragged_dot(lhs, rhs, group_sizes, rhs_transposed):
    n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
    return lhs.new_empty((lhs.shape[0], n), dtype=torch.promote_types(lhs.dtype, rhs.dtype))


def _fake_experts_forward(hidden_states, *args):
    return torch.empty_like(hidden_states)


ragged_dot_op = define_op("ragged_dot", _ragged_dot_jax, _fake_ragged_dot, grads=("lhs", "rhs"))
experts_forward_op = define_op(
    "experts_forward",
    _experts_forward_jax,
    _fake_experts_forward,
    grads=("hidden_states", "top_k_weights", "gate_up_proj", "down_proj", "gate_up_bias", "down_bias"),
)


def ragged_dot(
    lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *, rhs_transposed: bool = False
) -> torch.Tensor:
    """Grouped matmul with `jax.lax.ragged_dot` semantics: lhs [M, K] rows sorted by group, rhs [G, K, N] (or
    [G, N, K] with rhs_transposed), group_sizes [G] (int32 or int64); rows past sum(group_sizes) are zero. float32,
    bfloat16 or float16 (run as float32); the result has the promoted dtype of lhs and rhs. Differentiable in lhs
    and rhs."""
    checks.check_tensor("lhs", lhs)
    checks.check_tensor("rhs", rhs, device=lhs.device)
    checks.check_tensor("group_sizes", group_sizes, device=lhs.device)
    group_sizes = checks.as_int32("group_sizes", group_sizes)
    if not checks.tracing() and not checks.has_symbolic_shape(lhs, rhs, group_sizes):
        ragged_dot_api.check_inputs(
            checks.placeholder("lhs", lhs, float16_as_float32=True),
            checks.placeholder("rhs", rhs, float16_as_float32=True),
            checks.values_or_placeholder("group_sizes", group_sizes),
            preferred_element_type=None,
            rhs_transposed=rhs_transposed,
            group_offset=0,
            num_local_groups=None,
            bias=None,
            activation=None,
            gated=None,
        )
    tensors = (checks.contiguous(t) for t in (lhs, rhs, group_sizes))
    return ragged_dot_op(*tensors, bool(rhs_transposed))


_SILU = {"SiLU", "SiLUActivation"}
_GELU_TANH = {"GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation"}


def activation_name(act_fn) -> str:
    """Map a transformers / torch activation module to the kernel's activation, or raise."""
    name = type(act_fn).__name__
    if name in _SILU:
        return "silu"
    if name in _GELU_TANH or (isinstance(act_fn, torch.nn.GELU) and act_fn.approximate == "tanh"):
        return "gelu_tanh"
    raise ValueError(
        f"self.act_fn: experts_forward supports SiLU and tanh-approximated GELU activations, got {name}; "
        "use another experts implementation for this model"
    )


def experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    blocks: ExpertsBlocks | None = None,
) -> torch.Tensor:
    """transformers' experts interface: register with
    `ALL_EXPERTS_FUNCTIONS.register("tpu_ragged_dot", kernel.experts_forward)` and load the model with
    `experts_implementation="tpu_ragged_dot"`.

    Reads self.gate_up_proj / self.up_proj, self.down_proj, their biases (self.has_bias), self.is_transposed,
    self.is_concatenated, self.has_gate, self.act_fn. hidden_states and the expert weights in float32, bfloat16 or
    float16 (run as float32); top_k_index int32 or int64 (the router's, cast once; on a host tensor the ids must
    fit int32 and be >= 0). Expert ids >= self.num_experts are expert-parallel sentinels and contribute nothing.
    Returns [T, H] in hidden_states.dtype. Differentiable in the hidden states, the routing weights and the expert
    weights and biases.

    `blocks` (keyword-only; transformers' three-argument call leaves it None, the tuning table's choice): an
    ExpertsBlocks (tpu_kernels_jax.moe.tuning, also `kernel.jax.ExpertsBlocks`) forcing the path and the tiles of
    its kernels, forward and backward. Blocks that do not fit these inputs raise the JAX api's errors, which name
    the field (e.g. "blocks.chunk: ...").
    """
    if getattr(self, "has_post_expert_norm", False):
        raise ValueError(
            "self.has_post_expert_norm: experts with a post-expert norm are not supported by experts_forward"
        )
    apply_gate = getattr(type(self), "_apply_gate", None)
    has_gate = getattr(self, "has_gate", True)
    if has_gate and apply_gate is not None and apply_gate.__name__ != "_default_apply_gate":
        raise ValueError(
            f"self._apply_gate: {type(self).__name__} has a custom gating function, which experts_forward does not "
            "implement (it fuses act(gate) * up)"
        )
    activation = activation_name(self.act_fn)
    gate_layout = (
        ("concatenated" if getattr(self, "is_concatenated", True) else "interleaved") if has_gate else _NO_GATE
    )
    gate_up = self.gate_up_proj if has_gate else self.up_proj
    has_bias = getattr(self, "has_bias", False)
    gate_up_bias = (self.gate_up_proj_bias if has_gate else self.up_proj_bias) if has_bias else None
    down_bias = self.down_proj_bias if has_bias else None
    transposed = bool(getattr(self, "is_transposed", False))

    checks.check_tensor("hidden_states", hidden_states)
    device = hidden_states.device
    for name, t in [
        ("top_k_index", top_k_index),
        ("top_k_weights", top_k_weights),
        ("gate_up_proj", gate_up),
        ("down_proj", self.down_proj),
    ]:
        checks.check_tensor(name, t, device=device)
    top_k_index = checks.as_int32("top_k_index", top_k_index)
    if not checks.tracing() and not checks.has_symbolic_shape(hidden_states, top_k_index, top_k_weights):

        def ph(name, t):
            return checks.placeholder(name, t, float16_as_float32=True)

        moe_api.check_inputs(
            ph("hidden_states", hidden_states),
            checks.values_or_placeholder("top_k_index", top_k_index),
            ph("top_k_weights", top_k_weights),
            ph("gate_up_proj", gate_up),
            ph("down_proj", self.down_proj),
            ph("gate_up_bias", gate_up_bias),
            ph("down_bias", down_bias),
            activation=activation,
            gate_layout=None if gate_layout == _NO_GATE else gate_layout,
            weights_transposed=transposed,
            blocks=blocks,
        )
    if gate_up.shape[0] != self.num_experts:
        raise ValueError(f"self.num_experts: {self.num_experts} does not match the {gate_up.shape[0]} expert weights")
    tensors = (hidden_states, top_k_index, top_k_weights, gate_up, self.down_proj, gate_up_bias, down_bias)
    static = (activation, gate_layout, transposed, experts_blocks_json(blocks))
    return experts_forward_op(*(checks.contiguous(x) for x in tensors), *static)
