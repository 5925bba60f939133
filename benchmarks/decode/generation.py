"""Greedy generation with each experts implementation, timed, tokens compared: the measurement both the CPU smoke
and the device mode make (torch and transformers imported by the caller's process only).

On a TPU a step's time is (generate of prefill + N new tokens - generate of prefill + 1 token) / (N - 1): the prefill
and the first token cancel, leaving the decode steps, with a static cache so every step has the same shapes. The CPU
smoke, which only has to prove the path runs, divides one generate by N (prefill included) to save the second run.
N new tokens are forced (min_new_tokens = max_new_tokens) so an end-of-sequence token cannot shorten a run.
"""

from __future__ import annotations

import statistics
import time

EXPERTS_IMPLEMENTATION = "tpu_ragged_dot"  # the name the README registers our experts_forward under
IMPL_EXPERTS = {"experts": EXPERTS_IMPLEMENTATION}


def register_experts(experts_forward) -> None:
    """Our experts_forward under transformers' experts interface, as the README shows."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, experts_forward)


def default_experts(model) -> str:
    """The experts implementation transformers picks when none is asked for ("grouped_mm", else "eager")."""
    return model.get_correct_experts_implementation(None)


def _generate(model, prompt, new_tokens, sync):
    import torch

    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            cache_implementation="static",
        )
        sync()
        return out, time.perf_counter() - start


def measure(
    model, prompt, impls, *, new_tokens: int, repeats: int, warmup: bool, subtract_prefill: bool, sync=lambda: None
) -> dict:
    """{"impls": {impl: {"ms", "tokens_per_s", "experts_implementation"}}, "tokens_match"} for one batch: each impl
    generates `new_tokens` greedily (after one warm-up run when `warmup`), the median step of `repeats` runs; the
    tokens of every impl compared with the first's."""
    least = 2 if subtract_prefill else 1  # with the subtraction a step is the difference of two runs
    if new_tokens < least:
        raise ValueError(f"new_tokens: expected at least {least}, got {new_tokens}")
    batch = prompt.shape[0]
    row = {"batch": batch, "impls": {}}
    tokens = {}
    for impl in impls:
        name = IMPL_EXPERTS.get(impl) or default_experts(model)
        model.set_experts_implementation(name)
        if warmup:
            _generate(model, prompt, new_tokens, sync)
        steps = []
        for _ in range(repeats):
            out, full = _generate(model, prompt, new_tokens, sync)
            if subtract_prefill:
                _, first = _generate(model, prompt, 1, sync)
                steps.append(max(full - first, 0.0) / (new_tokens - 1))
            else:
                steps.append(full / new_tokens)
        tokens[impl] = out
        step = statistics.median(steps)
        row["impls"][impl] = {
            "ms": step * 1e3,
            "tokens_per_s": batch / step if step > 0 else float("inf"),
            "experts_implementation": name,
        }
    first = tokens[impls[0]]
    row["tokens_match"] = all(bool((t.shape == first.shape) and (t == first).all()) for t in tokens.values())
    row["new_tokens"] = int(first.shape[1] - prompt.shape[1])
    return row
