"""--device: the real models on a TPU v6e-8 host (8 chips, one process each), measured: transformers' defaults, our
experts_forward, and all of ours (experts, attention, RMSNorm and rotary; generation.py), each compiled (what
transformers does on a TPU with a static cache) and op by op. It cannot run without a TPU: it says so and stops.

Layout: expert parallelism over the 8 chips with attention and lm_head replicated: transformers'
DistributedConfig(tp_size=8, ep_size=8, tp_plan={}) (each model's own expert-parallel plan alone: Qwen3-MoE's sends
each token to its experts' chip by all-to-all; Gemma 4's makes other chips' experts sentinels and sums the experts'
outputs by all-reduce, and splits its dense MLP too). Launch: TorchTPU's `torch.tpu.distributed.set_tpu_launch_env
(nproc_per_node=8)` before spawning 8 processes (torch.multiprocessing), one chip each. Each batch: a random prompt of
--prefill tokens (same on every rank), greedy generate with a static cache, --new-tokens forced, one warm-up, the
median step over --repeats (generation.measure: the prefill-and-first-token run subtracted). Every rank writes its
rows; the launcher (run_ranks) checks that the ranks' greedy tokens agree and tables rank 0's. The CPU smoke runs the
same worker on 2 CPU processes (gloo) with tiny models.
"all ours" runs a Hub build of this checkout (generation.checkout_build: LOCAL_KERNELS, which the spawned processes
inherit, for the attention; its layers for kernelize), as our experts_forward is this checkout's: without it the
attention, RMSNorm and rotary would be the published package's.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from unittest import mock

from . import generation

LABEL_PREFIX = "measured"
IMPLS = generation.IMPLS
CHIPS = 8
SEED = 0
TIMEOUT_S = 1800  # a collective waiting longer than this: a rank died (a first compile takes minutes)


def _no_tpu_message() -> str:
    return (
        "--device: expected a TPU host (a v6e-8: 8 chips, torch_tpu installed), got no TPU (no /dev/accel* or "
        "/dev/vfio device). Run `python -m benchmarks.decode --modeled` for the modeled v6e-8 table or --cpu-smoke "
        "for the CPU check."
    )


def _load(path: str, options: dict):
    """The model at `path` (a Hub id or a directory) split over the ranks as transformers' expert parallelism does:
    DistributedConfig(tp_size=N, ep_size=N, tp_plan={}), the experts sharded by the model's own EP plan, attention
    replicated; transformers binds each rank's device (a device map with tensor parallelism is refused)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    world = options["world_size"]
    config = DistributedConfig(tp_size=world, ep_size=world, tp_plan={})
    load = lambda: AutoModelForCausalLM.from_pretrained(  # noqa: E731
        path, dtype=getattr(torch, options["dtype"]), distributed_config=config
    )
    if options["device_type"] != "cpu":
        return load().eval()
    # transformers binds CPU ranks to the CPU device, then refuses any device map without `accelerate`
    # (check_and_set_device_map), which only its offloading and multi-device dispatch use: on CPU the device map
    # that check would make, {"": cpu}, is made without it
    import transformers.modeling_utils as modeling_utils

    with mock.patch.object(modeling_utils, "check_and_set_device_map", lambda device_map: {"": device_map}):
        return load().eval()


def tokens_digest(series: list[dict]) -> list:
    """[(execution, batch, digest)] of every row: what the ranks must agree on."""
    return [(s["execution"], r["batch"], r["tokens_digest"]) for s in series for r in s["rows"]]


def worker(rank: int, options: dict, out_dir: str) -> None:
    """One rank of an expert-parallel run, the same on a TPU host (one chip a process) and on CPU processes (the
    smoke): join the process group, load each model split over the ranks (_load), generation.measure every batch.
    Each rank writes rank{r}.json; every rank draws the same prompts, so greedy tokens must agree across ranks."""
    import torch
    import torch.distributed as dist

    import tpu_kernels

    world = options["world_size"]
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    # a timeout so that a rank that dies fails the others instead of leaving them waiting in a collective
    dist.init_process_group(
        options["backend"], rank=rank, world_size=world, timeout=datetime.timedelta(seconds=options["timeout_s"])
    )
    try:
        generation.register_experts(tpu_kernels.experts_forward)
        device_type = options["device_type"]
        sync = getattr(getattr(torch, device_type, None), "synchronize", lambda: None)
        result = {}
        for model_name, path in options["models"]:
            model = _load(path, options)
            device = next(model.parameters()).device
            prompts = []
            for batch in options["batches"]:
                generator = torch.Generator().manual_seed(options["seed"] + batch)
                prompt = torch.randint(0, model.config.vocab_size, (batch, options["prefill"]), generator=generator)
                prompts.append(prompt.to(device))
            series = generation.measure(
                model,
                prompts,
                IMPLS,
                device_type=device_type,
                new_tokens=options["new_tokens"],
                repeats=options["repeats"],
                layers=generation.local_layers(options["build_dir"]),
                executions=options["executions"],
                warmup=options["warmup"],
                subtract_prefill=options["subtract_prefill"],
                sync=sync,
            )
            # the experts module's count is the rank's own share once transformers has split them
            local = next(m.num_experts for m in model.modules() if hasattr(m, "gate_up_proj"))
            result[model_name] = {
                "path": path,
                "ranks": world,
                "experts_per_rank": local,
                "series": [dict(s, context=None) for s in series],
            }
            del model
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(options: dict, *, rank0_here: bool = False) -> dict:
    """Run options["world_size"] ranks of `worker` inside a checkout build (so that "ours" runs this checkout: the
    ranks inherit LOCAL_KERNELS) and return rank 0's models; raises if the ranks' greedy tokens differ. The ranks are
    processes of torch.multiprocessing's spawn; with `rank0_here` rank 0 is this process (whose imports are done:
    ~20 s of CPU a process on a 2-core host) and the others, started first, import meanwhile."""
    import torch.multiprocessing as mp

    world = options["world_size"]
    with tempfile.TemporaryDirectory() as out_dir, generation.checkout_build() as build_dir:
        options = dict(options, build_dir=str(build_dir))
        if not rank0_here:
            mp.spawn(worker, args=(options, out_dir), nprocs=world, join=True)
        else:
            context = mp.get_context("spawn")
            others = [context.Process(target=worker, args=(r, options, out_dir)) for r in range(1, world)]
            for process in others:
                process.start()
            try:
                with mock.patch.dict(os.environ):  # the worker's RANK, LOCAL_RANK and WORLD_SIZE, for its run only
                    worker(0, options, out_dir)
            finally:
                for process in others:
                    process.join(timeout=options["timeout_s"])
                    if process.is_alive():
                        process.kill()
            failed = {r: p.exitcode for r, p in enumerate(others, 1) if p.exitcode != 0}
            if failed:
                raise RuntimeError(f"ranks {sorted(failed)} failed (exit codes {failed}): see their errors above")
        ranks = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    for name, model in ranks[0].items():
        for rank, other in enumerate(ranks[1:], 1):
            if tokens_digest(other[name]["series"]) != tokens_digest(model["series"]):
                raise RuntimeError(f"{name}: rank {rank}'s greedy tokens differ from rank 0's")
    return ranks[0]


def run(args) -> dict:
    from .. import device as bench_device

    if not bench_device.tpu_visible():
        raise SystemExit(_no_tpu_message())
    import torch

    tpu = getattr(torch, "tpu", None)
    if tpu is None or tpu.device_count() < CHIPS:
        found = 0 if tpu is None else tpu.device_count()
        raise SystemExit(f"--device: expected {CHIPS} TPU chips visible to torch_tpu, got {found}")
    tpu.distributed.set_tpu_launch_env(nproc_per_node=CHIPS)
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29511")
    models = run_ranks(
        {
            "device_type": "tpu",
            "world_size": CHIPS,
            "backend": None,  # TorchTPU's own for the tpu device
            "timeout_s": TIMEOUT_S,
            "dtype": "bfloat16",
            "models": [(m.name, m.hub_id) for m in args.models],
            "batches": list(args.batches),
            "prefill": args.prefill,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "executions": list(generation.EXECUTIONS),
            "warmup": True,
            "subtract_prefill": True,
            "seed": SEED,
        }
    )
    kind = "TPU v6e-8"
    return {
        "mode": "device",
        "label": f"{LABEL_PREFIX} {kind}, greedy generate, static cache",
        "impls": list(IMPLS),
        "models": models,
        "versions": generation.versions(),
        "notes": [
            f"prefill {args.prefill}, {args.new_tokens} new tokens forced, median of {args.repeats} after a warm-up; "
            "expert parallelism over 8 chips, attention replicated; greedy tokens equal on every rank.",
            generation.OURS_NOTE,
        ],
    }
