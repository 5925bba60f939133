"""Expert parallelism from torch: transformers' own expert parallelism over two CPU processes (gloo), with our
`experts_forward` as the per-rank experts implementation.

Each rank builds the same tiny random Qwen3-MoE and hands it to transformers' distribution step
(`prepare_distribute_model` + `maybe_distribute_model`, what `from_pretrained(..., distributed_config=...)` runs; on a
CPU host `from_pretrained` itself refuses the CPU device map without `accelerate`, which this environment does not
install). Two EP plans:

- router masking + all-reduce (`ep_router` / `moe_tp_experts`): each rank keeps 4 of the 8 experts, other ranks'
  experts arrive as the sentinel id 4 with weight 0, and the partial outputs are summed across ranks;
- token dispatch (the model's default `ep_dispatch_experts`): tokens travel by all-to-all to their experts' owner,
  which runs its experts top-1 with local ids;
- our expert-parallel op (tpu_kernels.expert_parallel_experts over a 2-device mesh of TorchTPU's compile-only mock
  devices), under the plan that leaves the router's ids global and the experts' output unsummed (`megamoe_router` /
  `megamoe_experts`): each rank's op call runs its experts on every token and sums the parts over gloo.

The expert-parallel op's registration, fake shapes and TorchTPU's export of it over an 8-device v6e mesh (what jax_op
does on the first call on `tpu` tensors) run without a TPU and without other processes.
"""

import datetime
import os
import re
import socket

import numpy as np
import pytest
import tiny_models
import torch

import tpu_kernels

EXPERTS_IMPLEMENTATION = "tpu_ragged_dot"
EP_OP_IMPLEMENTATION = "tpu_ragged_dot_ep"  # the expert-parallel op
WORLD_SIZE = 2
NUM_EXPERTS = 8  # tiny_models.qwen3_moe's
TIMEOUT = 180  # seconds: the spawned rank's imports take most of it on a loaded host
EP_AXIS = "ep"
# plan name: (ep_plan, experts implementation)
PLANS = {
    "all_reduce": (
        {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"},
        EXPERTS_IMPLEMENTATION,
    ),
    "dispatch": (None, EXPERTS_IMPLEMENTATION),  # the model's base_model_ep_plan
    "op": (
        {"model.layers.*.mlp.gate": "megamoe_router", "model.layers.*.mlp.experts": "megamoe_experts"},
        EP_OP_IMPLEMENTATION,
    ),
}


def mock_mesh(devices: int, device_kind: str = "TPU v6 lite"):
    """A one-axis mesh of TorchTPU's compile-only devices, as `torch.tpu.pallas.get_pallas_mesh` builds it on a TPU
    host (device i is the one rank i drives)."""
    import jax
    from torch_tpu._internal.pallas._mock_device import _PallasDevice

    return jax.sharding.Mesh(
        np.array([_PallasDevice(id=i, process_index=i, device_kind=device_kind) for i in range(devices)]), (EP_AXIS,)
    )


def _register():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, tpu_kernels.experts_forward)
    ALL_EXPERTS_FUNCTIONS.register(
        EP_OP_IMPLEMENTATION, tpu_kernels.expert_parallel_experts(mock_mesh(WORLD_SIZE), EP_AXIS)
    )


def _ep_rank(rank, port, seed, tokens):
    """One EP rank's logits for every plan. The process group is made here with a short timeout (transformers would
    make it with a 2-hour one), so a rank that dies fails the other instead of hanging it."""
    from transformers.distributed import DistributedConfig

    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=TIMEOUT),
    )
    try:
        logits = {}
        for name, (ep_plan, implementation) in PLANS.items():
            model = tiny_models.qwen3_moe(seed)
            model.set_experts_implementation(implementation)
            full = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
            config = DistributedConfig(tp_size=WORLD_SIZE, ep_size=WORLD_SIZE, tp_plan={}, ep_plan=ep_plan)
            config, _, mesh = type(model).prepare_distribute_model(config)
            model = type(model).maybe_distribute_model(model, config, mesh)
            experts = model.model.layers[0].mlp.experts
            local = NUM_EXPERTS // WORLD_SIZE
            # each rank holds its own contiguous half of the experts and sees the local count
            assert experts.num_experts == local, (rank, name, experts.num_experts)
            assert torch.equal(experts.gate_up_proj.to_local(), full[rank * local : (rank + 1) * local]), (rank, name)
            with torch.no_grad():
                logits[name] = model(torch.from_numpy(tokens)).logits.numpy().copy()
        return logits
    finally:
        torch.distributed.destroy_process_group()


def _spawned_rank(rank, port, seed, tokens, queue):
    """A rank in a process of its own: its logits, or its error, to `queue`."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
    try:
        _register()
        queue.put(_ep_rank(rank, port, seed, tokens))
    except BaseException as error:  # the parent reports it instead of waiting for a result that never comes
        queue.put(f"rank {rank}: {type(error).__name__}: {error}")
        raise


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_transformers_expert_parallel_on_two_cpu_processes_matches_one_process(rand, monkeypatch):
    """Both EP plans over 2 gloo ranks with our experts_forward: the logits equal the one-process model's with
    transformers' default experts and with ours (f32, 1e-4), on every rank; so do the greedy tokens."""
    seed = int(rand.rng.integers(2**31))
    tokens = rand.rng.integers(0, tiny_models.VOCAB, (2, 5)).astype(np.int64)
    # Rank 0 is this process (its imports are done); rank 1 is one spawned process, started first so that its
    # imports overlap the one-process references.
    context = torch.multiprocessing.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    process = context.Process(target=_spawned_rank, args=(1, port, seed, tokens, queue))
    process.start()
    try:
        _register()
        model = tiny_models.qwen3_moe(seed)
        references = {}
        for implementation in ("eager", EXPERTS_IMPLEMENTATION):
            model.set_experts_implementation(implementation)
            with torch.no_grad():
                references[implementation] = model(torch.from_numpy(tokens)).logits.numpy()
        for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(WORLD_SIZE)).items():
            monkeypatch.setenv(name, value)
        results = [_ep_rank(0, port, seed, tokens), queue.get(timeout=TIMEOUT)]
    finally:
        process.join(timeout=TIMEOUT)
        if process.is_alive():
            process.kill()
    for rank, logits in enumerate(results):
        assert not isinstance(logits, str), logits
        assert set(logits) == set(PLANS)
        for plan, got in logits.items():
            for implementation, want in references.items():
                np.testing.assert_allclose(
                    got, want, atol=1e-4, rtol=0, err_msg=f"rank {rank}, {plan} vs {implementation}"
                )
                assert np.array_equal(got.argmax(-1), want.argmax(-1)), (rank, plan, implementation)


# ----------------------------------------------------------------------------------- the expert-parallel torch op
EP_DEVICES = 8  # a v6e 2x4 slice's chips


def _ep_op_args(rand, tokens=12, experts=16, hidden=128, intermediate=64, top_k=2, dtype=torch.bfloat16):
    """One rank's arguments: every token and its global expert ids, the rank's experts / EP_DEVICES experts."""
    local = experts // EP_DEVICES
    tensors = (
        torch.from_numpy(rand.rng.standard_normal((tokens, hidden), dtype="float32")).to(dtype),
        torch.from_numpy(rand.rng.integers(0, experts, (tokens, top_k)).astype(np.int32)),
        torch.from_numpy(rand.rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)).to(dtype),
        torch.from_numpy(rand.rng.standard_normal((local, 2 * intermediate, hidden), dtype="float32")).to(dtype),
        torch.from_numpy(rand.rng.standard_normal((local, hidden, intermediate), dtype="float32")).to(dtype),
    )
    return (*tensors, None, None, "silu", "concatenated", False, "")


def test_expert_parallel_op_registration_fake_shapes_and_torch_tpu_export(rand, monkeypatch):
    """The op over an 8-device v6e mesh: registered once per (mesh, axis) under the package's namespace with the
    expected schema; FakeTensorMode and meta give the rank's [T, H]; and TorchTPU's own path for a `tpu` call (its
    JaxCallable: rank shapes to global placeholders through the partition specs, then the TPU export) gives the
    global shapes (16 experts), the expert weights sharded on the axis, Mosaic kernels and the all-reduce."""
    import jax
    import ladder  # the spawned rank of the test above imports this module: ladder only here
    from jax.sharding import NamedSharding
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tpu_kernels import _op_registry, expert_parallel_ops

    mesh = mock_mesh(EP_DEVICES)
    op = tpu_kernels.expert_parallel_op(mesh, EP_AXIS)
    assert tpu_kernels.expert_parallel_op(mock_mesh(EP_DEVICES), EP_AXIS) is op  # an equal mesh: the same op
    assert tpu_kernels.expert_parallel_op(mock_mesh(EP_DEVICES, "TPU7x"), EP_AXIS) is not op
    qualified = str(op._opoverload._schema).split("(")[0]
    name = qualified.split("::")[1]
    assert qualified == tpu_kernels.add_op_namespace_prefix(name) and name.startswith(
        "expert_parallel_experts_forward_"
    )
    schema = str(getattr(tpu_kernels.ops, name).default._schema)  # registered under the package's namespace
    assert schema == (
        f"{qualified}(Tensor hidden_states, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up_proj, "
        "Tensor down_proj, Tensor? gate_up_bias, Tensor? down_bias, str activation, str gate_layout, "
        "bool weights_transposed, str blocks) -> Tensor"
    ), schema
    with pytest.raises(ValueError, match=r"axis: expected one of the mesh's axes \('ep',\), got 'experts'"):
        tpu_kernels.expert_parallel_op(mesh, "experts")
    # The torch-cpu package's registration (no TorchTPU: a plain custom op with the CPU kernel), the same schema.
    monkeypatch.setattr(expert_parallel_ops, "HAS_TORCH_TPU", False)
    cpu_op = tpu_kernels.expert_parallel_op(mock_mesh(EP_DEVICES, "TPU v5 lite"), EP_AXIS)
    cpu_schema = str(cpu_op._opoverload._schema)
    assert cpu_schema.split("(", 1)[1] == schema.split("(", 1)[1], cpu_schema
    assert not hasattr(cpu_op, "_init_fn") or not hasattr(cpu_op._init_fn, "exported")
    monkeypatch.undo()

    args = _ep_op_args(rand)
    tokens, hidden = args[0].shape
    with FakeTensorMode() as mode:
        out = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        assert (tuple(out.shape), out.dtype) == ((tokens, hidden), torch.bfloat16)
    out = op(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
    assert (tuple(out.shape), out.dtype, out.device.type) == ((tokens, hidden), torch.bfloat16, "meta")
    # torch.export with a symbolic token count: the op's fake takes symbolic shapes (jax_op's own fake refuses them).
    tokens_dim = torch.export.Dim("tokens", min=2, max=4096)

    class Experts(torch.nn.Module):
        def forward(self, *tensors):
            return op(*tensors, *args[5:])

    exported_program = torch.export.export(Experts(), args[:5], dynamic_shapes=(({0: tokens_dim},) * 3 + (None, None),))
    (node,) = [n for n in exported_program.graph.nodes if n.op == "call_function"]
    assert node.target is op._opoverload
    symbolic_tokens, out_hidden = node.meta["val"].shape
    assert isinstance(symbolic_tokens, torch.SymInt) and out_hidden == hidden
    # The CPU kernel needs one process per device: a clear error without them.
    with pytest.raises(ValueError, match="must be initialized with 8 ranks, got no process group"):
        op(*args)
    # ... and a mesh split over another axis too: the CPU kernel sums over the whole process group
    grid = jax.sharding.Mesh(mesh.devices.reshape(2, EP_DEVICES // 2), ("dp", EP_AXIS))
    with pytest.raises(ValueError, match=r"mesh: .* may split only 'ep', got the axes \{'dp': 2\} too"):
        tpu_kernels.expert_parallel_op(grid, EP_AXIS)(*args)

    if not _op_registry.HAS_TORCH_TPU:
        pytest.skip("TorchTPU is not installed: no jax_op")
    callable_ = op._init_fn  # TorchTPU's JaxCallable, what the op runs on `tpu` tensors
    placeholders, kw = callable_._get_jax_placeholders(*callable_._normalize_invocation_args(args, {}))
    exported = callable_.exported(*placeholders, **kw)
    global_shapes = [tuple(a.shape) for a in exported.in_avals]
    assert global_shapes == [(12, 128), (12, 2), (12, 2), (16, 128, 128), (16, 128, 64)], global_shapes
    assert [tuple(a.shape) for a in exported.out_avals] == [(tokens, hidden)]
    assert exported.nr_devices == EP_DEVICES
    text = exported.mlir_module()
    for argument in ("gate_up_proj", "down_proj"):
        assert re.search(rf'sharding<@mesh, \[{{"{EP_AXIS}"}}, {{}}, {{}}\]>}} loc\("{argument}"\)', text), argument
    assert re.search(r'sharding<@mesh, \[\{\}, \{\}\]>} loc\("hidden_states"\)', text)
    assert "tpu_custom_call" in text and "all_reduce" in text
    # What TorchTPU hands the runtime, compiled deviceless for a real 8-chip v6e slice with the op's partition specs:
    # each chip's arguments hold its 2 experts, not all 16.
    slice_mesh = ladder.tpu_mesh("v6e:2x4", (EP_AXIS,))
    specs = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(slice_mesh, spec))
        for a, spec in zip(exported.in_avals, op.input_partition_specs)
    ]
    lowered = jax.jit(exported.call).lower(*specs, None, None)  # the absent biases
    argument_bytes = lowered.compile().memory_analysis().argument_size_in_bytes
    local_weights = sum(a.numel() * a.element_size() for a in args[3:5])
    assert local_weights <= argument_bytes < 2 * local_weights, (argument_bytes, local_weights)
