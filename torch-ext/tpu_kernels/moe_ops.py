"""Torch custom ops for the ragged dot and the MoE experts forward, their autograd, and `experts_forward`, the
function transformers' experts interface calls (`ALL_EXPERTS_FUNCTIONS.register("tpu_ragged_dot", experts_forward)`).
"""

import jax
import jax.numpy as jnp
import torch

from tpu_kernels_jax.moe import api as moe_api
from tpu_kernels_jax.ragged_dot import api as ragged_dot_api

from . import _torch_checks as checks
from ._op_registry import define_op

_NO_GATE = "none"  # gate_layout=None as a torch schema string


def _empty_if_none(grad):
    return jnp.zeros((0,), jnp.float32) if grad is None else grad


# ------------------------------------------------------------------------------------------------ ragged dot
def _ragged_dot_jax(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, rhs_transposed: bool) -> jax.Array:
    return ragged_dot_api.ragged_dot(lhs, rhs, group_sizes, rhs_transposed=rhs_transposed)


def _ragged_dot_backward_jax(
    grad: jax.Array, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, rhs_transposed: bool
) -> tuple[jax.Array, jax.Array]:
    _, vjp = jax.vjp(lambda a, b: _ragged_dot_jax(a, b, group_sizes, rhs_transposed), lhs, rhs)
    return vjp(grad)


def _fake_ragged_dot(lhs, rhs, group_sizes, rhs_transposed):
    n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
    return lhs.new_empty((lhs.shape[0], n), dtype=torch.promote_types(lhs.dtype, rhs.dtype))


def _fake_ragged_dot_backward(grad, lhs, rhs, group_sizes, rhs_transposed):
    return torch.empty_like(lhs), torch.empty_like(rhs)


ragged_dot_op = define_op("ragged_dot", _ragged_dot_jax, _fake_ragged_dot)
ragged_dot_backward_op = define_op("ragged_dot_backward", _ragged_dot_backward_jax, _fake_ragged_dot_backward)


def _setup_ragged_dot(ctx, inputs, output):
    lhs, rhs, group_sizes, rhs_transposed = inputs
    ctx.save_for_backward(lhs, rhs, group_sizes)
    ctx.rhs_transposed = rhs_transposed


def _backward_ragged_dot(ctx, grad):
    lhs, rhs, group_sizes = ctx.saved_tensors
    d_lhs, d_rhs = ragged_dot_backward_op(grad.contiguous(), lhs, rhs, group_sizes, ctx.rhs_transposed)
    return d_lhs, d_rhs, None, None


ragged_dot_op.register_autograd(_backward_ragged_dot, setup_context=_setup_ragged_dot)


def ragged_dot(
    lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *, rhs_transposed: bool = False
) -> torch.Tensor:
    """Grouped matmul with `jax.lax.ragged_dot` semantics: lhs [M, K] rows sorted by group, rhs [G, K, N] (or
    [G, N, K] with rhs_transposed), group_sizes [G] (int32 or int64); rows past sum(group_sizes) are zero.
    Differentiable in lhs and rhs."""
    checks.check_tensor("lhs", lhs)
    checks.check_tensor("rhs", rhs, device=lhs.device)
    checks.check_tensor("group_sizes", group_sizes, device=lhs.device)
    if group_sizes.dtype == torch.int64:
        group_sizes = group_sizes.to(torch.int32)
    if not checks.has_symbolic_shape(lhs, rhs, group_sizes):
        ragged_dot_api.check_inputs(
            checks.placeholder("lhs", lhs),
            checks.placeholder("rhs", rhs),
            checks.values_or_placeholder("group_sizes", group_sizes),
            preferred_element_type=None,
            rhs_transposed=rhs_transposed,
            group_offset=0,
            num_local_groups=None,
            bias=None,
            activation=None,
            gated=None,
        )
    return ragged_dot_op(lhs.contiguous(), rhs.contiguous(), group_sizes.contiguous(), bool(rhs_transposed))


# ------------------------------------------------------------------------------------------------ experts forward
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
) -> jax.Array:
    return moe_api.experts_forward(
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up_proj,
        down_proj,
        gate_up_bias,
        down_bias,
        activation=activation,
        gate_layout=None if gate_layout == _NO_GATE else gate_layout,
        weights_transposed=weights_transposed,
    )


def _experts_forward_backward_jax(
    grad: jax.Array,
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
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    def forward(x, weights, gate_up, down, b1, b2):
        return _experts_forward_jax(
            x, top_k_index, weights, gate_up, down, b1, b2, activation, gate_layout, weights_transposed
        )

    _, vjp = jax.vjp(forward, hidden_states, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias)
    return tuple(_empty_if_none(g) for g in vjp(grad))


def _fake_experts_forward(hidden_states, *args):
    return torch.empty_like(hidden_states)


def _fake_experts_backward(
    grad,
    hidden_states,
    top_k_index,
    top_k_weights,
    gate_up_proj,
    down_proj,
    gate_up_bias,
    down_bias,
    activation,
    gate_layout,
    weights_transposed,
):
    def like(t):
        return grad.new_empty((0,), dtype=torch.float32) if t is None else torch.empty_like(t)

    return (
        torch.empty_like(hidden_states),
        torch.empty_like(top_k_weights),
        torch.empty_like(gate_up_proj),
        torch.empty_like(down_proj),
        like(gate_up_bias),
        like(down_bias),
    )


experts_forward_op = define_op("experts_forward", _experts_forward_jax, _fake_experts_forward)
experts_forward_backward_op = define_op(
    "experts_forward_backward", _experts_forward_backward_jax, _fake_experts_backward
)


def _setup_experts(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7])
    ctx.static = inputs[7:]


def _backward_experts(ctx, grad):
    saved = ctx.saved_tensors
    grads = experts_forward_backward_op(grad.contiguous(), *saved, *ctx.static)
    d_x, d_weights, d_gate_up, d_down, d_b1, d_b2 = grads
    gate_up_bias, down_bias = saved[5], saved[6]
    return (
        d_x,
        None,
        d_weights,
        d_gate_up,
        d_down,
        None if gate_up_bias is None else d_b1,
        None if down_bias is None else d_b2,
        None,
        None,
        None,
    )


experts_forward_op.register_autograd(_backward_experts, setup_context=_setup_experts)

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
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts interface: register with
    `ALL_EXPERTS_FUNCTIONS.register("tpu_ragged_dot", kernel.experts_forward)` and load the model with
    `experts_implementation="tpu_ragged_dot"`.

    Reads self.gate_up_proj / self.up_proj, self.down_proj, their biases (self.has_bias), self.is_transposed,
    self.is_concatenated, self.has_gate, self.act_fn. Expert ids >= self.num_experts are expert-parallel sentinels
    and contribute nothing. Returns [T, H] in hidden_states.dtype.
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
    if top_k_index.dtype in (torch.int64, torch.int16, torch.int8, torch.uint8):
        top_k_index = top_k_index.to(torch.int32)
    if not checks.has_symbolic_shape(hidden_states, top_k_index, top_k_weights):
        moe_api.check_inputs(
            checks.placeholder("hidden_states", hidden_states),
            checks.values_or_placeholder("top_k_index", top_k_index),
            checks.placeholder("top_k_weights", top_k_weights),
            checks.placeholder("gate_up_proj", gate_up),
            checks.placeholder("down_proj", self.down_proj),
            checks.placeholder("gate_up_bias", gate_up_bias),
            checks.placeholder("down_bias", down_bias),
            activation=activation,
            gate_layout=None if gate_layout == _NO_GATE else gate_layout,
            weights_transposed=transposed,
        )
    if gate_up.shape[0] != self.num_experts:
        raise ValueError(f"self.num_experts: {self.num_experts} does not match the {gate_up.shape[0]} expert weights")
    return experts_forward_op(
        hidden_states.contiguous(),
        top_k_index.contiguous(),
        top_k_weights.contiguous(),
        gate_up,
        self.down_proj,
        gate_up_bias,
        down_bias,
        activation,
        gate_layout,
        transposed,
    )
