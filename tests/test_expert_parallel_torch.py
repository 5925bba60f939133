"""Expert parallelism from torch: transformers' own expert parallelism over two CPU processes (gloo), with our
`experts_forward` as the per-rank experts implementation.

Each rank builds the same tiny random Qwen3-MoE and hands it to transformers' distribution step
(`prepare_distribute_model` + `maybe_distribute_model`, what `from_pretrained(..., distributed_config=...)` runs; on a
CPU host `from_pretrained` itself refuses the CPU device map without `accelerate`, which this environment does not
install). Two EP plans:

- router masking + all-reduce (`ep_router` / `moe_tp_experts`): each rank keeps 4 of the 8 experts, other ranks'
  experts arrive as the sentinel id 4 with weight 0, and the partial outputs are summed across ranks;
- token dispatch (the model's default `ep_dispatch_experts`): tokens travel by all-to-all to their experts' owner,
  which runs its experts top-1 with local ids.
"""

import datetime
import os
import socket

import numpy as np
import tiny_models
import torch

import tpu_kernels

EXPERTS_IMPLEMENTATION = "tpu_ragged_dot"
WORLD_SIZE = 2
NUM_EXPERTS = 8  # tiny_models.qwen3_moe's
TIMEOUT = 180  # seconds: the spawned rank's imports take most of it on a loaded host
PLANS = {
    "all_reduce": {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"},
    "dispatch": None,  # the model's base_model_ep_plan
}


def _register():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, tpu_kernels.experts_forward)


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
        for name, ep_plan in PLANS.items():
            model = tiny_models.qwen3_moe(seed)
            model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
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
