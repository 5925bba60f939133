"""Torch custom ops for the ragged dot and the MoE experts forward, their autograd, and `experts_forward`, the
function transformers' experts interface calls (`ALL_EXPERTS_FUNCTIONS.register("tpu_ragged_dot", experts_forward)`).
"""

import dataclasses
import json
import math
import sys

import jax
import jax.numpy as jnp
import torch

from tpu_kernels_jax.common import mxfp4
from tpu_kernels_jax.common.activation import ClampedSwiGLU
from tpu_kernels_jax.moe import api as moe_api
from tpu_kernels_jax.moe.tuning import ExpertsBlocks
from tpu_kernels_jax.ragged_dot import api as ragged_dot_api

from . import _torch_checks as checks
from ._op_registry import define_op, static_json

_NO_GATE = "none"  # gate_layout=None as a torch schema string
_CLAMPED_SWIGLU = "clamped_swiglu:"  # a ClampedSwiGLU as the op's activation string: this prefix + its fields' JSON


def activation_string(activation: str | ClampedSwiGLU) -> str:
    """The op's static activation string: the name, or a ClampedSwiGLU's fields as JSON (floats round-trip)."""
    if isinstance(activation, ClampedSwiGLU):
        return _CLAMPED_SWIGLU + json.dumps(dataclasses.asdict(activation), sort_keys=True)
    return activation


def parse_activation(activation: str) -> str | ClampedSwiGLU:
    """The inverse of activation_string."""
    if activation.startswith(_CLAMPED_SWIGLU):
        return ClampedSwiGLU(**json.loads(activation[len(_CLAMPED_SWIGLU) :]))
    return activation


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
    gate_up_scale: jax.Array | None,
    down_scale: jax.Array | None,
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
        activation=parse_activation(activation),
        gate_layout=None if gate_layout == _NO_GATE else gate_layout,
        weights_transposed=weights_transposed,
        gate_up_scale=gate_up_scale,
        down_scale=down_scale,
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
_GELU = {"GELUActivation"}  # transformers' "gelu" and "gelu_python": the exact (erf) GELU
_GELU_TANH = {"GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation"}
_RELU2 = {"ReLUSquaredActivation"}


def activation_name(act_fn) -> str:
    """Map a transformers / torch activation module (or torch.nn.functional.silu itself) to the kernel's activation,
    or raise."""
    if act_fn is torch.nn.functional.silu:
        return "silu"
    name = type(act_fn).__name__
    if name in _SILU:
        return "silu"
    if name in _GELU_TANH or (isinstance(act_fn, torch.nn.GELU) and act_fn.approximate == "tanh"):
        return "gelu_tanh"
    if (
        act_fn is torch.nn.functional.gelu
        or name in _GELU
        or (isinstance(act_fn, torch.nn.GELU) and act_fn.approximate == "none")
    ):
        return "gelu"  # GELUActivation's python form computes the same erf GELU
    if name in _RELU2:
        return "relu2"
    got = (
        getattr(act_fn, "__qualname__", name) if callable(act_fn) and not isinstance(act_fn, torch.nn.Module) else name
    )
    raise ValueError(
        f"self.act_fn: experts_forward supports SiLU, GELU (exact or tanh-approximated) and ReLU-squared activations, "
        f"got {got}; "
        "use another experts implementation for this model"
    )


@dataclasses.dataclass(frozen=True)
class _ClampedGate:
    """Where a transformers experts class keeps its clamped SwiGLU's parameters: the attribute holding the limit,
    the one holding alpha (None: alpha = 1), up_offset, and whether the gate's activation is self.act_fn (which must
    then be SiLU) rather than the sigmoid written out."""

    limit: str
    alpha: str | None
    up_offset: float
    act_fn: bool = False


# The custom `_apply_gate`s of the pinned transformers that compute a ClampedSwiGLU, by (defining module, class).
# A class is recognized only when its `_apply_gate` *is* that class's function object (inherited or the class
# itself), so a replacement or an edited copy is refused; tests/test_moe_torch.py runs each one against the kernel's
# gating on values that hit both clamps.
_MODELS = "transformers.models."
CLAMPED_SWIGLU_GATES = {
    (_MODELS + "gpt_oss.modeling_gpt_oss", "GptOssExperts"): _ClampedGate("limit", "alpha", 1.0),
    (_MODELS + "openai_privacy_filter.modeling_openai_privacy_filter", "OpenAIPrivacyFilterExperts"): _ClampedGate(
        "limit", "alpha", 1.0
    ),
    (_MODELS + "minimax_m3_vl.modeling_minimax_m3_vl", "MiniMaxM3VLExperts"): _ClampedGate(
        "swiglu_limit", "swiglu_alpha", 1.0
    ),
    (_MODELS + "deepseek_v4.modeling_deepseek_v4", "DeepseekV4Experts"): _ClampedGate("limit", None, 0.0, act_fn=True),
    (_MODELS + "hy_v4.modeling_hy_v4", "HYV4Experts"): _ClampedGate("swiglu_limit", None, 0.0),
    (_MODELS + "glm5_next.modeling_glm5_next", "Glm5NextTextExperts"): _ClampedGate("swiglu_limit", None, 0.0),
}

# Custom `_apply_gate`s that compute the default act(gate) * up as the kernels do (Beam's: act(gate) * up in f32,
# rounded once to the activations' dtype).
DEFAULT_GATES = {(_MODELS + "beam.modeling_beam", "BeamExperts")}

# transformers' FP8 experts (what its fine-grained FP8 quantizer puts in place of any experts module): its
# `_apply_gate` is chosen by its config: gpt-oss's clamped SwiGLU when swiglu_alpha is set, else SiLU of the gate
# clamped at `limit` times the clamped up when a limit is set, else the default.
FP8_EXPERTS = ("transformers.integrations.finegrained_fp8", "FP8Experts")
_BY_CONFIG = "by config"


# Both evaluated once when torch.compile traces the caller (their arguments are Python constants there), their
# results taken as constants: Dynamo cannot trace the module lookup, nor the dataclass and JSON.
@torch.compiler.assume_constant_result
def _recognized_gate(apply_gate) -> tuple | None:
    """What `apply_gate` is (by identity with the function its transformers class defines): () for the default
    act(gate) * up, _ClampedGate's fields for a clamped gate, or None."""
    owner = apply_gate.__qualname__.rpartition(".")[0]
    key = (apply_gate.__module__, owner)
    spec = CLAMPED_SWIGLU_GATES.get(key)
    cls = getattr(sys.modules.get(apply_gate.__module__), owner, None)
    known = spec is not None or key in DEFAULT_GATES or key == FP8_EXPERTS
    if not known or cls is None or vars(cls).get("_apply_gate") is not apply_gate:
        return None
    if key == FP8_EXPERTS:
        return (_BY_CONFIG,)
    return () if spec is None else dataclasses.astuple(spec)


@torch.compiler.assume_constant_result
def _clamped_swiglu_string(limit: float, alpha: float, up_offset: float) -> str:
    return activation_string(ClampedSwiGLU(limit=limit, alpha=alpha, up_offset=up_offset))


def _gate_parameter(self, attribute: str) -> float:
    """A gating parameter of the experts module, else of its config (transformers' name there: swiglu_*)."""
    value = getattr(self, attribute, None)
    if value is None:
        config_name = "swiglu_" + attribute.removeprefix("swiglu_")
        value = getattr(getattr(self, "config", None), config_name, None)
        if value is None:
            raise ValueError(
                f"self.{attribute}: {type(self).__name__}'s clamped SwiGLU needs it (or config.{config_name}), got "
                "neither"
            )
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"self.{attribute}: expected a finite number, got {value!r}")
    return float(value)


def gating(self: torch.nn.Module, has_gate: bool) -> str:
    """The kernel's activation for this experts module as the op's string (activation_string): act_fn's name for the
    default act(gate) * up, a ClampedSwiGLU for a recognized clamped gate (parameters read from the module), or a
    ValueError naming what is missing."""
    apply_gate = getattr(type(self), "_apply_gate", None)
    if not has_gate or apply_gate is None or apply_gate.__name__ == "_default_apply_gate":
        return activation_name(self.act_fn)
    found = _recognized_gate(apply_gate)
    if found == (_BY_CONFIG,):  # FP8 experts: what its _apply_gate computes follows its attributes
        if getattr(self, "swiglu_alpha", None) is not None:
            found = dataclasses.astuple(_ClampedGate("swiglu_limit", "swiglu_alpha", 1.0))
        elif getattr(self, "limit", None) is not None:
            found = dataclasses.astuple(_ClampedGate("limit", None, 0.0, act_fn=True))
        else:
            found = ()
    if found == ():
        return activation_name(self.act_fn)
    if found is None:
        raise ValueError(
            f"self._apply_gate: {type(self).__name__} has a custom gating function ({apply_gate.__qualname__}), "
            "which experts_forward does not implement (it fuses act(gate) * up and the clamped SwiGLU of "
            f"{', '.join(cls for _, cls in CLAMPED_SWIGLU_GATES)}); use another experts implementation"
        )
    spec = _ClampedGate(*found)
    if spec.act_fn and activation_name(self.act_fn) != "silu":
        raise ValueError(
            f"self.act_fn: {type(self).__name__}'s clamped gate is fused with a SiLU act_fn, got "
            f"{type(self.act_fn).__name__}"
        )
    limit = _gate_parameter(self, spec.limit)
    if limit <= 0:
        raise ValueError(f"self.{spec.limit}: expected a clamp limit > 0, got {limit}")
    alpha = 1.0 if spec.alpha is None else _gate_parameter(self, spec.alpha)
    return _clamped_swiglu_string(limit, alpha, spec.up_offset)


QUANTIZED_WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def expert_scale(self: torch.nn.Module, proj: str, weight: torch.Tensor, transposed: bool) -> torch.Tensor | None:
    """The kernels' per-output-channel scale [E, N] f32 of a quantized expert weight (None for a float one), read
    the way transformers' FP8 experts store it: `self.<proj>_scale_inv`, [E, S, 1] float32 multiplying the weight
    (w = q * scale_inv, N output channels in S blocks of N / S rows: S = N per channel, S = 1 per expert, S = 2 one
    for each of gate and up). Scales in blocks along the input dimension (its last size > 1) are refused."""
    if weight.dtype not in QUANTIZED_WEIGHT_DTYPES:
        return None
    name = f"self.{proj}_scale_inv"
    scale = getattr(self, f"{proj}_scale_inv", None)
    experts, n = weight.shape[0], weight.shape[2] if transposed else weight.shape[1]
    expected = f"[{experts}, {n} (or a divisor of it), 1] float32 (transformers' per-output-channel convention)"
    if scale is None:
        raise ValueError(f"{name}: {proj} is {weight.dtype} (quantized), so its scale {expected} is required, got none")
    checks.check_tensor(name, scale, device=weight.device)
    if scale.dtype != torch.float32:
        raise TypeError(f"{name}: expected {expected}, got dtype {scale.dtype}")
    if scale.dim() != 3 or scale.shape[0] != experts or scale.shape[2] != 1 or n % scale.shape[1]:
        raise ValueError(
            f"{name}: expected {expected}, got shape {tuple(scale.shape)} (block scales along the input dimension "
            "are not supported)"
        )
    scale = scale.detach()[:, :, 0]
    return scale if scale.shape[1] == n else scale.repeat_interleave(n // scale.shape[1], dim=1)


def mxfp4_weights(self: torch.nn.Module, proj: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An MXFP4 expert weight as gpt-oss checkpoints and transformers' MXFP4 conversion name it: `self.<proj>_blocks`
    uint8 [E, out, in / 32, 16] (two e2m1 codes a byte, the low nibble first) and `self.<proj>_scales` uint8
    [E, out, in / 32] (e8m0), as (blocks [E, out, in / 2], scales), detached (constants); or, once
    prepare_mxfp4_experts has laid them out (self.mxfp4_prepared), blocks [E, in / 2, out] and scales
    [E, mxfp4.scale_rows(in), out] as they are. None without `<proj>_blocks`."""
    blocks = getattr(self, f"{proj}_blocks", None)
    if blocks is None:
        return None
    scales = getattr(self, f"{proj}_scales", None)
    if scales is None:
        raise ValueError(
            f"self.{proj}_scales: self.{proj}_blocks holds MXFP4 blocks, so their e8m0 scales uint8 "
            f"{list(blocks.shape[:-1])} are required, got none"
        )
    checks.check_tensor(f"self.{proj}_blocks", blocks)
    checks.check_tensor(f"self.{proj}_scales", scales, device=blocks.device)
    blocks = blocks.detach()
    if blocks.dim() == 4:
        blocks = blocks.reshape(*blocks.shape[:2], blocks.shape[2] * blocks.shape[3])
    return blocks, scales.detach()


def prepare_mxfp4_experts(self: torch.nn.Module) -> torch.nn.Module:
    """Lay out an MXFP4 experts module's weights once, at load, as the kernels read them (JAX's mxfp4.prepare):
    each `<proj>_blocks` [E, out, in / 32, 16] becomes [E, in / 2, out] (its bits re-encoded by mxfp4.encode) and
    `<proj>_scales` [E, out, in / 32] becomes [E, mxfp4.scale_rows(in), out] (zero rows past in / 32), and
    self.mxfp4_prepared is set. A call then
    reads them with no copy; in the checkpoint's layout every call converts them (an XLA relayout of the scales and
    the blocks). Returns the module; a second call changes nothing."""
    if getattr(self, "mxfp4_prepared", False):
        return self
    names = ("gate_up_proj" if getattr(self, "has_gate", True) else "up_proj", "down_proj")
    pairs = [mxfp4_weights(self, proj) for proj in names]
    for proj, pair in zip(names, pairs):
        if pair is None:
            raise ValueError(
                f"self.{proj}_blocks: prepare_mxfp4_experts needs both projections' MXFP4 blocks, got none"
            )
    for proj, (blocks, scales) in zip(names, pairs):
        k = 2 * blocks.shape[2]
        blocks, scales = mxfp4.encode(blocks, scales, where=torch.where, stack=lambda xs: torch.stack(xs, dim=-1))
        prepared = torch.zeros(
            (scales.shape[0], mxfp4.scale_rows(k), scales.shape[1]), dtype=scales.dtype, device=scales.device
        )
        prepared[:, : scales.shape[2]] = scales.transpose(1, 2)
        for part, tensor in (("blocks", blocks.transpose(1, 2).contiguous()), ("scales", prepared)):
            delattr(self, f"{proj}_{part}")
            self.register_buffer(f"{proj}_{part}", tensor)
    self.mxfp4_prepared = True
    return self


def experts_operands(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    blocks: ExpertsBlocks | None = None,
    *,
    weight=lambda t: t,
) -> tuple[tuple, tuple]:
    """What experts_forward_op takes from an experts module and the router's outputs, checked (experts_forward's
    docstring says what is read): (tensors, static strings). `weight` maps each dense weight and bias the module
    holds, e.g. a DTensor to its local shard."""
    if getattr(self, "has_post_expert_norm", False):
        raise ValueError(
            "self.has_post_expert_norm: experts with a post-expert norm are not supported by experts_forward"
        )
    has_gate = getattr(self, "has_gate", True)
    activation = gating(self, has_gate)  # the op's string
    gate_layout = (
        ("concatenated" if getattr(self, "is_concatenated", True) else "interleaved") if has_gate else _NO_GATE
    )
    up_name = "gate_up_proj" if has_gate else "up_proj"
    has_bias = getattr(self, "has_bias", False)
    gate_up_bias = weight(self.gate_up_proj_bias if has_gate else self.up_proj_bias) if has_bias else None
    down_bias = weight(self.down_proj_bias) if has_bias else None
    mx_up, mx_down = mxfp4_weights(self, up_name), mxfp4_weights(self, "down_proj")
    if mx_up is not None or mx_down is not None:  # MXFP4 (gpt-oss checkpoints): [E, out, in], or prepared [E, in, out]
        if mx_up is None or mx_down is None:
            missing = up_name if mx_up is None else "down_proj"
            raise ValueError(f"self.{missing}_blocks: MXFP4 experts need both projections' blocks, got none for it")
        (gate_up, gate_up_scale), (down, down_scale) = mx_up, mx_down
        transposed = bool(getattr(self, "mxfp4_prepared", False))
    else:
        gate_up = weight(self.gate_up_proj if has_gate else self.up_proj)
        transposed = bool(getattr(self, "is_transposed", False))
        down = weight(self.down_proj)
        gate_up_scale = expert_scale(self, up_name, gate_up, transposed)
        down_scale = expert_scale(self, "down_proj", down, transposed)
    # Quantized weights are constants of the kernels' gradient: detached, autograd asks nothing of them.
    gate_up = gate_up.detach() if gate_up_scale is not None else gate_up
    down = down.detach() if down_scale is not None else down

    checks.check_tensor("hidden_states", hidden_states)
    device = hidden_states.device
    for name, t in [
        ("top_k_index", top_k_index),
        ("top_k_weights", top_k_weights),
        ("gate_up_proj", gate_up),
        ("down_proj", down),
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
            ph("down_proj", down),
            ph("gate_up_bias", gate_up_bias),
            ph("down_bias", down_bias),
            activation=parse_activation(activation),
            gate_layout=None if gate_layout == _NO_GATE else gate_layout,
            weights_transposed=transposed,
            gate_up_scale=ph("gate_up_scale", gate_up_scale),
            down_scale=ph("down_scale", down_scale),
            blocks=blocks,
        )
    if gate_up.shape[0] != self.num_experts:
        raise ValueError(f"self.num_experts: {self.num_experts} does not match the {gate_up.shape[0]} expert weights")
    experts = (gate_up, down, gate_up_bias, down_bias, gate_up_scale, down_scale)
    tensors = (hidden_states, top_k_index, top_k_weights, *experts)
    static = (activation, gate_layout, transposed, experts_blocks_json(blocks))
    return tensors, static


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
    self.is_concatenated, self.has_gate, self.act_fn, and for a custom `_apply_gate` that is one of
    CLAMPED_SWIGLU_GATES (gpt-oss's clamped SwiGLU and its kin) the clamp limit and alpha (from the module, else its
    config's swiglu_limit / swiglu_alpha); any other custom gate is a ValueError. hidden_states and the expert
    weights in float32, bfloat16 or float16 (run as float32), or quantized: int8 / float8_e4m3fn with per-output-
    channel float32 scales `self.<proj>_scale_inv` [E, N, 1] as transformers' FP8 experts store them (expert_scale;
    constants: no gradient reaches them), or MXFP4 (gpt-oss checkpoints, inference only): `self.<proj>_blocks` uint8
    [E, out, in / 32, 16] with `self.<proj>_scales` uint8 [E, out, in / 32] under the checkpoint's names, read in
    place of the dense weights (mxfp4_weights; docs/moe.md says how to set a module up; prepare_mxfp4_experts lays
    them out once so that a call copies none of them); top_k_index int32 or int64
    (the router's, cast once; on a host tensor the ids must fit int32 and be >= 0). Expert ids >= self.num_experts
    are expert-parallel sentinels and contribute nothing. Returns [T, H] in hidden_states.dtype. Differentiable in
    the hidden states, the routing weights and the expert weights and biases (not through MXFP4 weights).

    `blocks` (keyword-only; transformers' three-argument call leaves it None, the tuning table's choice): an
    ExpertsBlocks (tpu_kernels_jax.moe.tuning, also `kernel.jax.ExpertsBlocks`) forcing the path and the tiles of
    its kernels, forward and backward. Blocks that do not fit these inputs raise the JAX api's errors, which name
    the field (e.g. "blocks.chunk: ...").
    """
    tensors, static = experts_operands(self, hidden_states, top_k_index, top_k_weights, blocks)
    return experts_forward_op(*(checks.contiguous(x) for x in tensors), *static)
