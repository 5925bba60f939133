"""Expert-parallel experts_forward as a torch op over a TorchTPU mesh, and the transformers experts function for it.

Each torch rank drives one device of a JAX mesh (TorchTPU's convention: the mesh's device at flat position r is the
one rank r drives; `torch.tpu.pallas.get_pallas_mesh` builds it). `expert_parallel_op(mesh, axis)` registers (once
per mesh and axis) the op `expert_parallel_experts_forward_<key>` from tpu_kernels_jax.moe.expert_parallel's
shard_map function through TorchTPU's `jax_op(..., mesh=, input_partition_specs=, output_partition_specs=)`. Its
tensors are what one rank holds:

- hidden_states [T, H], top_k_index [T, K] (the router's *global* expert ids), top_k_weights [T, K]: every token,
  the same on every rank (P());
- gate_up_proj, down_proj and the optional biases: this rank's E / n consecutive experts (its shard along `axis`,
  P(axis)), n the axis' size;
- the result [T, H]: every token's full output, summed over the ranks of `axis` (P(), replicated).

jax_op turns the rank's shapes into the global ones through the partition specs (an expert weight's first dimension
times n) and exports the shard_map program for TPU once per shape; on a TPU every rank runs it and the psum inside
is the cross-device all-reduce. On a CPU tensor the op runs the same program over a one-device host mesh in
interpret mode on the rank's part (its own experts, other ranks' ids turned into the sentinel) and sums the ranks'
parts with torch.distributed.all_reduce (gloo), in float32 as the psum does; so the CPU kernel needs one process per
rank of the mesh, or a mesh whose axis has one device. The op is inference only (no autograd) and takes float
weights (no quantized experts).

`expert_parallel_experts(mesh, axis)` is the experts function for transformers' experts interface (the signature
of `experts_forward`, plus the process group transformers' Mega MoE expert plan passes): register it and load the
model with an EP plan that shards the expert weights and leaves the router's ids global and the output unsummed,
`{"model.layers.*.mlp.gate": "megamoe_router", "model.layers.*.mlp.experts": "megamoe_experts"}` (docs/decode.md,
"Expert parallelism from torch").
"""

import functools
import hashlib
import json

import jax
import numpy as np
import torch
from jax.sharding import PartitionSpec as P

from tpu_kernels_jax.common.interpret import interpret_on_cpu
from tpu_kernels_jax.moe import expert_parallel as moe_ep
from tpu_kernels_jax.moe.tuning import ExpertsBlocks

from . import _torch_checks as checks
from ._op_registry import HAS_TORCH_TPU, _to_jax, _to_torch, _torch_tpu_jax_op, schema_of
from ._ops import add_op_namespace_prefix
from .moe_ops import _NO_GATE, _f32, experts_operands, parse_activation

OP_PREFIX = "expert_parallel_experts_forward_"


def _options(activation: str, gate_layout: str, weights_transposed: bool, blocks: str) -> dict:
    """The op's static strings as experts_forward's keyword arguments."""
    return {
        "activation": parse_activation(activation),
        "gate_layout": None if gate_layout == _NO_GATE else gate_layout,
        "weights_transposed": weights_transposed,
        "blocks": ExpertsBlocks.from_dict(json.loads(blocks)) if blocks else None,
    }


def _sharded_function(mesh: jax.sharding.Mesh, axis: str):
    """The op's JAX function over `mesh` (global shapes; annotations give the torch schema)."""

    def expert_parallel_experts_forward(
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
        weights = (_f32(w) for w in (gate_up_proj, down_proj, gate_up_bias, down_bias))
        options = _options(activation, gate_layout, weights_transposed, blocks)
        out = moe_ep.expert_parallel_experts_forward(
            mesh, axis, _f32(hidden_states), top_k_index, top_k_weights, *weights, **options
        )
        return out.astype(hidden_states.dtype)

    return expert_parallel_experts_forward


@functools.cache
def _host_program(axis: str):
    """The op's program over a one-device host mesh, jitted: the CPU kernel's per-rank computation (with one device
    the shard_map's ids are already this rank's, and its psum is the identity)."""
    host_mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), (axis,))
    return jax.jit(_sharded_function(host_mesh, axis), static_argnums=(7, 8, 9, 10))


def _rank_position(mesh: jax.sharding.Mesh, axis: str) -> int:
    """This process' position along `axis` (its rank's device at the mesh's flat position rank)."""
    if mesh.shape[axis] == 1:
        return 0
    others = {name: size for name, size in mesh.shape.items() if name != axis and size > 1}
    if others:
        raise ValueError(
            f"mesh: the CPU kernel sums over the whole process group, so the mesh may split only {axis!r}, got the "
            f"axes {others} too"
        )
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if world != mesh.size:
        raise ValueError(
            f"mesh: the CPU kernel runs one process per device of the mesh ({mesh.size} devices along {axis!r}), "
            f"so torch.distributed must be initialized with {mesh.size} ranks, got "
            f"{'no process group' if world is None else f'{world} ranks'}"
        )
    return int(np.unravel_index(dist.get_rank(), mesh.devices.shape)[list(mesh.axis_names).index(axis)])


def _cpu_kernel(mesh: jax.sharding.Mesh, axis: str):
    """This rank's part of every token's output (the ids of other ranks' experts become the sentinel E / n), by the
    op's own program on the host, summed over the ranks in float32 as the psum is."""

    def kernel(hidden_states, top_k_index, top_k_weights, gate_up_proj, *rest):
        local_experts = gate_up_proj.shape[0]
        local = top_k_index.to(torch.int32) - _rank_position(mesh, axis) * local_experts
        local = torch.where((local >= 0) & (local < local_experts), local, local_experts).to(torch.int32)
        tensors = (hidden_states, local, top_k_weights, gate_up_proj, *rest)
        with interpret_on_cpu():
            part = _to_torch(_host_program(axis)(*map(_to_jax, tensors)))
        if mesh.shape[axis] == 1:
            return part
        part = part.to(torch.float32, copy=True)  # its own storage: the result shares the JAX array's
        torch.distributed.all_reduce(part)
        return part.to(hidden_states.dtype)

    return kernel


def _fake(hidden_states, *args):
    return torch.empty_like(hidden_states)


def partition_specs(axis: str) -> tuple[tuple, tuple]:
    """The op's input partition specs (one per parameter of its JAX function, None for the static strings) and its
    output's: tokens and routing replicated, the expert weights and biases split along `axis`, the result
    replicated."""
    return (P(), P(), P(), P(axis), P(axis), P(axis), P(axis), None, None, None, None), (P(),)


def _mesh_key(mesh: jax.sharding.Mesh, axis: str) -> str:
    """A stable identifier of (mesh, axis) for the op's name: axis names, shape, and the devices' ids, kinds and
    types (TorchTPU's mesh of its compile-only devices and a JAX topology's mesh are different meshes)."""
    devices = [(int(d.id), str(getattr(d, "device_kind", "")), type(d).__qualname__) for d in mesh.devices.flat]
    text = repr((axis, tuple(mesh.axis_names), tuple(mesh.devices.shape), devices))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


_OPS: dict[str, object] = {}


def expert_parallel_op(mesh: jax.sharding.Mesh, axis: str):
    """The expert-parallel experts_forward op over `mesh`'s `axis` (see the module docstring), registered as
    `<namespace>::expert_parallel_experts_forward_<key>` on first use. Arguments: hidden_states, top_k_index (int32),
    top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias (None allowed), then the strings activation,
    gate_layout ("none" without a gate), the bool weights_transposed and the string blocks as experts_forward_op
    takes them. The op's attributes: jax_fn, mesh, axis, input_partition_specs, output_partition_specs."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.shape:
        raise ValueError(f"axis: expected one of the mesh's axes {tuple(mesh.shape)}, got {axis!r}")
    key = _mesh_key(mesh, axis)
    if key in _OPS:
        return _OPS[key]
    jax_fn = _sharded_function(mesh, axis)
    in_specs, out_specs = partition_specs(axis)
    qualified = add_op_namespace_prefix(OP_PREFIX + key)
    if HAS_TORCH_TPU:
        op = _torch_tpu_jax_op(
            qualified, jax_fn, mesh=mesh, input_partition_specs=in_specs, output_partition_specs=out_specs
        )
    else:
        op = torch.library.custom_op(qualified, _cpu_kernel(mesh, axis), mutates_args=(), schema=schema_of(jax_fn))
    op.register_kernel("cpu", _cpu_kernel(mesh, axis))
    # The rank's shapes: the output is replicated, hidden_states' shape (jax_op's own fake would export the program
    # for each shape and refuses symbolic dimensions).
    op.register_fake(_fake)
    op.jax_fn, op.mesh, op.axis = jax_fn, mesh, axis
    op.input_partition_specs, op.output_partition_specs = in_specs, out_specs
    _OPS[key] = op
    return op


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor parameter's local shard (transformers' EP plans shard expert weights as Shard(0) DTensors)."""
    return t.to_local() if hasattr(t, "to_local") else t


def expert_parallel_experts(mesh: jax.sharding.Mesh, axis: str):
    """The experts function for transformers' experts interface running expert_parallel_op(mesh, axis):
    `ALL_EXPERTS_FUNCTIONS.register("tpu_ragged_dot_ep", tpu_kernels.expert_parallel_experts(mesh, "ep"))`.

    It reads and checks the experts module as experts_forward does (moe_ops.experts_operands), its weights holding
    this rank's experts (a DTensor's local shard), and takes the router's global ids. Float weights only (no
    quantized experts, no post-expert norm); no autograd. The fourth argument, the process group transformers' Mega
    MoE expert plan passes, is not used: the op's mesh names the devices (and on CPU the op sums over the default
    process group)."""
    op = expert_parallel_op(mesh, axis)

    def experts_forward(self, hidden_states, top_k_index, top_k_weights, process_group=None, *, blocks=None):
        del process_group
        tensors, static = experts_operands(self, hidden_states, top_k_index, top_k_weights, blocks, weight=_local)
        *inputs, gate_up_scale, down_scale = tensors
        if gate_up_scale is not None or down_scale is not None:
            raise TypeError(
                "self: the expert-parallel op takes float expert weights, got quantized ones (int8 / float8 with "
                "scales, or MXFP4 blocks)"
            )
        return op(*(checks.contiguous(t) for t in inputs), *static)

    return experts_forward
