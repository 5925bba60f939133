"""--cpu-smoke: the decode script end to end on this CPU with tiny random models of both architectures (Qwen3-MoE and
Gemma 4 MoE, built from configs by tests/tiny_models.py: no download), through device mode's own path: the models are
saved once (save_pretrained) and device_mode.worker runs on RANKS CPU processes (torch.multiprocessing, gloo), each
loading them with from_pretrained and transformers' expert parallelism (DistributedConfig(tp_size=2, ep_size=2,
tp_plan={}): 4 of the 8 experts a rank, each model's own EP plan), then greedy generate with a static cache
and each implementation of generation.py (transformers' defaults, our experts_forward, all of ours; on the CPU our
Pallas kernels run in TPU interpret mode), two batch sizes, a few new tokens. Greedy tokens are compared between the
implementations and between the ranks. Its times are labeled "cpu smoke, not a TPU figure": they prove the path
runs, nothing about speed. "all ours" loads the Hub package the way a user does, from a build of this checkout
(generation.checkout_build: LOCAL_KERNELS for the attention, a local layer repository for kernelize). Op by op only:
transformers compiles the decode step on a TPU, not on a CPU.
"""

from __future__ import annotations

import os
import pathlib
import socket
import sys
import tempfile
from unittest import mock

from . import device_mode, generation

LABEL = "cpu smoke, not a TPU figure"
IMPLS = generation.IMPLS
EXECUTIONS = ("op by op",)
ROOT = pathlib.Path(__file__).resolve().parents[2]
SEED = 0
RANKS = 2  # CPU processes; the tiny models' 8 experts split 4 a rank
TIMEOUT_S = 300  # a rank waiting longer in a collective: the other died


def _tiny_models():
    """{table name: builder(seed)}: the test suite's tiny builders (tests/ holds them once for every model test)."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.append(str(ROOT / "tests"))
    import tiny_models

    return {
        "qwen3-30b-a3b (tiny random Qwen3-MoE)": lambda seed: tiny_models.qwen3_moe(seed, num_hidden_layers=1),
        "gemma4-26b-a4b (tiny random Gemma 4 MoE)": lambda seed: tiny_models.gemma4(seed, moe=True),
    }


def run(args) -> dict:
    import torch

    builders = _tiny_models()
    wanted = {m.name for m in args.models}
    with tempfile.TemporaryDirectory() as checkpoints:
        models = []
        for name, build in builders.items():
            if name.split(" ")[0] in wanted:
                path = os.path.join(checkpoints, name.split(" ")[0])
                build(SEED).to(torch.float32).save_pretrained(path)  # then loaded by every rank as from the Hub
                models.append((name, path))
        port = _free_port()
        with mock.patch.dict(os.environ, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}):
            result_models = device_mode.run_ranks(
                {
                    "device_type": "cpu",
                    "world_size": RANKS,
                    "backend": "gloo",
                    "timeout_s": TIMEOUT_S,
                    "dtype": "float32",
                    "models": models,
                    "batches": list(args.batches),
                    "prefill": args.prefill,
                    "new_tokens": args.new_tokens,
                    "repeats": 1,
                    "executions": list(EXECUTIONS),
                    "warmup": False,
                    "subtract_prefill": False,
                    "seed": SEED,
                },
                rank0_here=True,
            )
    for model in result_models.values():
        model.pop("path")  # a temporary directory
    return {
        "mode": "cpu-smoke",
        "label": LABEL,
        "impls": list(IMPLS),
        "models": result_models,
        "versions": generation.versions(),
        "notes": [
            f"{LABEL}: tiny random models on {RANKS} CPU processes (gloo), experts split over them by transformers' "
            "expert parallelism as in device mode, our kernels in Pallas' TPU interpret mode; ms/step = rank 0's "
            f"one generate of {args.new_tokens} new tokens after a {args.prefill}-token prompt (prefill included) / "
            f"{args.new_tokens}.",
            "greedy tokens equal: every implementation generated the default's tokens, on every rank.",
            generation.OURS_NOTE,
        ],
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
