"""--device: the real models on a TPU v6e-8 host (8 chips, one process each), measured: transformers' defaults, our
experts_forward, and all of ours (experts, attention, RMSNorm and rotary; generation.py), each compiled (what
transformers does on a TPU with a static cache) and op by op. It cannot run without a TPU: it says so and stops.

Layout: expert parallelism over the 8 chips with attention, dense layers and lm_head replicated: transformers'
DistributedConfig(tp_size=8, ep_size=8, tp_plan={}) (the expert-parallel plan alone: other chips' experts are
sentinels, an all-reduce sums the experts' outputs). Launch: TorchTPU's `torch.tpu.distributed.set_tpu_launch_env
(nproc_per_node=8)` before spawning 8 processes (torch.multiprocessing), one chip each. Each batch: a random prompt of
--prefill tokens (same on every rank), greedy generate with a static cache, --new-tokens forced, one warm-up, the
median step over --repeats (generation.measure: the prefill-and-first-token run subtracted). Rank 0 writes the table.
"all ours" runs a Hub build of this checkout (generation.checkout_build: LOCAL_KERNELS, which the spawned processes
inherit, for the attention; its layers for kernelize), as our experts_forward is this checkout's: without it the
attention, RMSNorm and rotary would be the published package's.
"""

from __future__ import annotations

import json
import os
import tempfile

from . import generation

LABEL_PREFIX = "measured"
IMPLS = generation.IMPLS
CHIPS = 8
SEED = 0


def _no_tpu_message() -> str:
    return (
        "--device: expected a TPU host (a v6e-8: 8 chips, torch_tpu installed), got no TPU (no /dev/accel* or "
        "/dev/vfio device). Run `python -m benchmarks.decode --modeled` for the modeled v6e-8 table or --cpu-smoke "
        "for the CPU check."
    )


def _worker(rank: int, options: dict, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import tpu_kernels

    dist.init_process_group(rank=rank, world_size=CHIPS)
    generation.register_experts(tpu_kernels.experts_forward)
    device = torch.device("tpu", rank)
    sync = getattr(getattr(torch, "tpu", None), "synchronize", lambda: None)
    result = {}
    for model_name, hub_id in options["models"]:
        model = AutoModelForCausalLM.from_pretrained(
            hub_id,
            dtype=torch.bfloat16,
            device_map=device,
            distributed_config=DistributedConfig(tp_size=CHIPS, ep_size=CHIPS, tp_plan={}),
        ).eval()
        prompts = []
        for batch in options["batches"]:
            generator = torch.Generator().manual_seed(SEED + batch)
            prompt = torch.randint(0, model.config.vocab_size, (batch, options["prefill"]), generator=generator)
            prompts.append(prompt.to(device))
        series = generation.measure(
            model,
            prompts,
            IMPLS,
            device_type="tpu",
            new_tokens=options["new_tokens"],
            repeats=options["repeats"],
            layers=generation.local_layers(options["build_dir"]),
            warmup=True,
            subtract_prefill=True,
            sync=sync,
        )
        result[model_name] = {"hub_id": hub_id, "series": [dict(s, context=None) for s in series]}
        del model
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def run(args) -> dict:
    from .. import device as bench_device

    if not bench_device.tpu_visible():
        raise SystemExit(_no_tpu_message())
    import torch
    import torch.multiprocessing as mp

    tpu = getattr(torch, "tpu", None)
    if tpu is None or tpu.device_count() < CHIPS:
        found = 0 if tpu is None else tpu.device_count()
        raise SystemExit(f"--device: expected {CHIPS} TPU chips visible to torch_tpu, got {found}")
    tpu.distributed.set_tpu_launch_env(nproc_per_node=CHIPS)
    options = {
        "models": [(m.name, m.hub_id) for m in args.models],
        "batches": list(args.batches),
        "prefill": args.prefill,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
    }
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29511")
    with tempfile.TemporaryDirectory() as tmp, generation.checkout_build() as build_dir:
        options["build_dir"] = str(build_dir)
        out_path = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(options, out_path), nprocs=CHIPS, join=True)
        with open(out_path) as f:
            models = json.load(f)
    kind = "TPU v6e-8"
    return {
        "mode": "device",
        "label": f"{LABEL_PREFIX} {kind}, greedy generate, static cache",
        "impls": list(IMPLS),
        "models": models,
        "versions": generation.versions(),
        "notes": [
            f"prefill {args.prefill}, {args.new_tokens} new tokens forced, median of {args.repeats} after a warm-up; "
            "expert parallelism over 8 chips, attention replicated.",
            generation.OURS_NOTE,
        ],
    }
