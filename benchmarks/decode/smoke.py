"""--cpu-smoke: the decode script end to end on this CPU with tiny random models of both architectures (Qwen3-MoE and
Gemma 4 MoE, built from configs by tests/tiny_models.py: no download), greedy generate with a static cache and each
implementation of generation.py (transformers' defaults, our experts_forward, all of ours; on the CPU our Pallas
kernels run in TPU interpret mode), two batch sizes, a few new tokens, greedy tokens compared. Its times are labeled
"cpu smoke, not a TPU figure": they prove the path runs, nothing about speed. "all ours" loads the Hub package the
way a user does, from a build of this checkout (generation.checkout_build: LOCAL_KERNELS for the attention, a local
layer repository for kernelize). Op by op only: transformers compiles the decode step on a TPU, not on a CPU.
"""

from __future__ import annotations

import pathlib
import sys

from . import generation

LABEL = "cpu smoke, not a TPU figure"
IMPLS = generation.IMPLS
EXECUTIONS = ("op by op",)
ROOT = pathlib.Path(__file__).resolve().parents[2]
SEED = 0


def _tiny_models():
    """{table name: builder(seed)}: the test suite's tiny builders (tests/ holds them once for every model test)."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.append(str(ROOT / "tests"))
    import tiny_models

    return {
        "qwen3-30b-a3b (tiny random Qwen3-MoE)": lambda seed: tiny_models.qwen3_moe(seed, num_hidden_layers=1),
        "gemma4-26b-a4b (tiny random Gemma 4 MoE)": lambda seed: tiny_models.gemma4(seed, moe=True),
    }, tiny_models.VOCAB


def run(args) -> dict:
    import torch

    import tpu_kernels

    generation.register_experts(tpu_kernels.experts_forward)
    builders, vocab = _tiny_models()
    wanted = {m.name for m in args.models}
    rng = torch.Generator().manual_seed(SEED)
    result = {"mode": "cpu-smoke", "label": LABEL, "impls": list(IMPLS), "models": {}}
    with generation.checkout_build() as build_dir:
        for name, build in builders.items():
            if name.split(" ")[0] not in wanted:
                continue
            model = build(SEED)
            prompts = [torch.randint(0, vocab, (batch, args.prefill), generator=rng) for batch in args.batches]
            series = generation.measure(
                model,
                prompts,
                IMPLS,
                device_type="cpu",
                layers=generation.local_layers(build_dir),
                executions=EXECUTIONS,
                new_tokens=args.new_tokens,
                repeats=1,
                warmup=False,
                subtract_prefill=False,
            )
            result["models"][name] = {"series": [dict(s, context=None) for s in series]}
    result["versions"] = generation.versions()
    result["notes"] = [
        f"{LABEL}: tiny random models on this CPU, our kernels in Pallas' TPU interpret mode; ms/step = one generate "
        f"of {args.new_tokens} new tokens after a {args.prefill}-token prompt (prefill included) / {args.new_tokens}.",
        "greedy tokens equal: every implementation generated the default's tokens.",
        generation.OURS_NOTE,
    ]
    return result
