"""Tiny transformers models on TorchTPU's `tpu` device with the Hub build's kernels, against the same models on the
CPU, for the TPU test machine once scripts/torch_tpu_parts.sh has installed torch, torch-tpu and (by default)
transformers and kernels there:

    export PYTHONPATH=$PWD/build/torch-site-libtpu:$PYTHONPATH:$PWD/build/torch-site
    python3 scripts/torch_tpu_models_check.py [--build build] [--device tpu] [--seed N] [--only NAME ...]

The kernels come from the Hub build as users load it: `kernels.get_local_kernel(build)` (the variant for the device's
backend), `experts_forward` registered in transformers' experts interface (`ALL_EXPERTS_FUNCTIONS`),
`attention_forward` in its attention interface, and the Hub name `attn_implementation="kernels-community/tpu-kernels"`
resolved by transformers' own kernel loading (LOCAL_KERNELS pointing at the checkout). Each check builds one tiny
model (random weights, tests/tiny_models.py: the models the CPU suite checks), saves it and loads it twice with the
same implementations, once per device, then compares:

- the logits of a random batch (f32 weights; the chip's matmuls and the interpret mode's CPU arithmetic round
  differently, so they agree to `LOGIT_TOLERANCE` of the largest logit, not bitwise), and transformers' default
  implementation's logits on the CPU, as a reference both must match;
- greedy generation: the same tokens, or, at the first step where they part, a near-tie on the CPU (its logits of
  the two chosen tokens closer than the tolerance), reported as such;
- that our ops ran on the device (their calls counted by op name).

One more check runs transformers' continuous batching (`generate_batch`) on the device with the build's paged
attention registered (`register_continuous_batching`: our KV cache writes and ragged paged attention, a prompt
prefilled in chunks beside decodes) and compares its greedy tokens with plain `generate` on the CPU.

Prints one line a check and `models on <device>: N checks, F failures`; exit status 0 when none failed.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import random
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models: the CPU suite's model definitions
sys.path.insert(0, str(ROOT / "scripts"))  # torch_tpu_ops_check: the op recorder and the check runner

from torch_tpu_ops_check import recording_package_ops, run_checks  # noqa: E402

REPO_ID = "kernels-community/tpu-kernels"
EXPERTS = "tpu_ragged_dot"  # the name README registers experts_forward under
ATTENTION = "tpu_kernels_attention"  # attention_forward under a name without "flash" (README's direct registration)
LOGIT_TOLERANCE = 2e-2  # of the largest |logit|: f32 models, the chip's matmul passes against the CPU's f32
NEW_TOKENS = 4


def _register(kernel):
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS, kernel.experts_forward)
    AttentionInterface.register(ATTENTION, kernel.attention_forward)
    AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])


def _load(path, device, **implementations):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **implementations)
    return model.to(device).eval()


def _tokens(rng, batch, length, vocab, pad):
    import torch

    tokens = torch.tensor([[rng.randrange(vocab) for _ in range(length)] for _ in range(batch)])
    if pad is not None:  # generate() reads a pad token in the prompt as padding
        tokens[tokens == pad] = (pad + 1) % vocab
    return tokens


def _greedy(model, prompt, device):
    import torch

    with torch.no_grad():
        out = model.generate(
            prompt.to(device),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            attention_mask=torch.ones_like(prompt).to(device),
        )
    return out.cpu()


def _compare_generation(cpu_model, cpu_tokens, device_tokens, prompt_length) -> str:
    """'equal', or where the two part, a near-tie on the CPU (else raises)."""
    import torch

    if torch.equal(cpu_tokens, device_tokens):
        return f"greedy tokens equal ({cpu_tokens.shape[0]} x {NEW_TOKENS})"
    for row in range(cpu_tokens.shape[0]):
        diff = (cpu_tokens[row] != device_tokens[row]).nonzero()
        if not len(diff):
            continue
        at = int(diff[0])
        with torch.no_grad():
            logits = cpu_model(cpu_tokens[row : row + 1, :at]).logits[0, -1].float()
        margin = abs(float(logits[cpu_tokens[row, at]] - logits[device_tokens[row, at]]))
        if margin > LOGIT_TOLERANCE * float(logits.abs().max()):
            raise AssertionError(
                f"row {row}, token {at - prompt_length}: cpu chose {int(cpu_tokens[row, at])}, the device "
                f"{int(device_tokens[row, at])}, CPU logits {margin:.3g} apart (not a tie)"
            )
        return f"greedy tokens part at row {row}, new token {at - prompt_length}: a near-tie (CPU margin {margin:.2g})"
    raise AssertionError("unreachable: tokens differ but no row differs")


def _check(name, make_model, implementations, expected_ops, args, rng, work: pathlib.Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    seed = rng.randrange(2**31)
    path = work / name
    make_model(seed).save_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # transformers' default
    default_on_device = _load(path, args.device)
    cpu_model = _load(path, "cpu", **implementations)
    device_model = _load(path, args.device, **implementations)
    vocab, pad = reference.config.get_text_config().vocab_size, reference.generation_config.pad_token_id
    tokens = _tokens(rng, 2, 11, vocab, pad)
    with torch.no_grad():
        expected = reference(tokens).logits.float()
        default_device = default_on_device(tokens.to(args.device)).logits.float().cpu()
        on_cpu = cpu_model(tokens).logits.float()
        recorder = recording_package_ops()
        with recorder:
            on_device = device_model(tokens.to(args.device)).logits.float().cpu()
    ran_ops = collections.Counter(op for op, _ in recorder.calls)
    if not torch.isfinite(on_device).all():
        raise AssertionError("logits on the device are not all finite")
    missing = [op for op in expected_ops if ran_ops[op] == 0]
    if missing:
        raise AssertionError(f"our ops {missing} did not run on the device (ran: {dict(ran_ops)})")
    scale = float(expected.abs().max())
    device_error = float((on_device - on_cpu).abs().max())
    reference_error = float((on_cpu - expected).abs().max())
    default_device_error = float((default_device - expected).abs().max())
    ours_vs_default_device = float((on_device - default_device).abs().max())
    print(
        f"  {name}: |ours on {args.device} - default on {args.device}| {ours_vs_default_device:.3g}, "
        f"|default on {args.device} - default on cpu| {default_device_error:.3g}",
        flush=True,
    )
    if device_error > LOGIT_TOLERANCE * scale or reference_error > LOGIT_TOLERANCE * scale:
        raise AssertionError(
            f"logits: |device - cpu| {device_error:.3g}, |cpu - transformers' default| {reference_error:.3g}, "
            f"tolerance {LOGIT_TOLERANCE * scale:.3g}"
        )
    prompt = tokens[:, :6]
    generation = _compare_generation(
        cpu_model, _greedy(cpu_model, prompt, "cpu"), _greedy(device_model, prompt, args.device), 6
    )
    ran = ", ".join(f"{op} x{n}" for op, n in sorted(ran_ops.items()))
    return (
        f"ok   {name}: logits max |{args.device} - cpu| {device_error:.2g} (largest {scale:.2g}), "
        f"|cpu - default| {reference_error:.2g}; {generation}; ours on {args.device}: {ran}"
    )


def _continuous_batching_check(name, args, rng, work: pathlib.Path, kernel) -> str:
    """transformers' continuous batching (generate_batch) on the device with the build's paged attention registered
    (register_continuous_batching: our cache writes and ragged paged attention, a 20-token prompt prefilled in
    chunks beside decodes), against plain generate of the same model on the CPU ("sdpa"): the same greedy tokens."""
    import tiny_models
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    path = work / name
    tiny_models.qwen3(rng.randrange(2**31)).save_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    attention = kernel.continuous_batching.CB_ATTENTION
    ours = _load(path, args.device, attn_implementation=attention)
    if kernel.register_continuous_batching(ours) != attention:
        raise AssertionError("register_continuous_batching did not return the paged attention name")
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    prompts = [[rng.randrange(1, tiny_models.VOCAB) for _ in range(n)] for n in (7, 20, 3)]
    with torch.no_grad():
        expected = [reference.generate(torch.tensor([p]), config)[0, len(p) :].tolist() for p in prompts]
    cb_config = ContinuousBatchingConfig(page_size=16, num_blocks=16, max_batch_tokens=16)
    # generate_batch runs the model on a thread of its own, which a dispatch mode does not see: the ops are counted
    # where the build's modules call them
    calls = collections.Counter()
    wrapped = [
        (kernel.kv_cache_ops, "reshape_and_cache_flash_op"),
        (kernel.paged_attention_ops, "ragged_paged_attention_op"),
    ]
    originals = [getattr(module, attr) for module, attr in wrapped]

    def counting(op, name):
        def call(*a, **kw):
            calls[name] += 1
            return op(*a, **kw)

        return call

    try:
        for (module, attr), op in zip(wrapped, originals):
            setattr(module, attr, counting(op, attr.removesuffix("_op")))
        with torch.no_grad():
            outputs = ours.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config)
    finally:
        for (module, attr), op in zip(wrapped, originals):
            setattr(module, attr, op)
    generated = [outputs[key].generated_tokens for key in sorted(outputs, key=lambda k: int(k.split("_")[-1]))]
    if generated != expected:
        raise AssertionError(f"generate_batch on {args.device} gave {generated}, generate on the CPU {expected}")
    missing = [op for op in ("reshape_and_cache_flash", "ragged_paged_attention") if calls[op] == 0]
    if missing:
        raise AssertionError(f"our ops {missing} did not run on the device (ran: {dict(calls)})")
    ran = ", ".join(f"{op} x{n}" for op, n in sorted(calls.items()))
    return (
        f"ok   {name}: greedy tokens of 3 prompts (7, 20, 3 tokens) equal CPU generate's; ours on {args.device}: {ran}"
    )


def _model_check(make_model, implementations, expected_ops):
    return lambda name, args, rng, work, kernel: _check(
        name, make_model, implementations, expected_ops, args, rng, work
    )


def _checks():
    """{name: check(name, args, rng, work folder, kernel) -> its report line}."""
    import tiny_models

    return {
        # Qwen3-MoE: experts_forward through transformers' experts interface (SiLU, renormalized top-k)
        "qwen3_moe_experts": _model_check(
            tiny_models.qwen3_moe, {"experts_implementation": EXPERTS}, ("experts_forward",)
        ),
        # gpt-oss: its experts (interleaved gate/up, biases, clamped SwiGLU) and attention_forward (sinks, a window)
        "gpt_oss_experts_and_attention": _model_check(
            tiny_models.gpt_oss_moe,
            {"experts_implementation": EXPERTS, "attn_implementation": ATTENTION},
            ("experts_forward", "flash_attention"),
        ),
        # Gemma 4 26B-A4B's architecture: the Hub name (transformers loads the build itself), a sliding and a full
        # layer of head dims 128 and 256, and its MoE block
        "gemma4_moe_hub_attention": _model_check(
            lambda seed: tiny_models.gemma4(seed, moe=True),
            {"experts_implementation": EXPERTS, "attn_implementation": REPO_ID},
            ("experts_forward", "flash_attention"),
        ),
        # continuous batching: our paged KV cache writes and ragged paged attention under generate_batch
        "qwen3_continuous_batching": _continuous_batching_check,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", type=pathlib.Path, default=ROOT / "build", help="the Hub build (holds torch-tpu/)")
    p.add_argument("--device", default="tpu", help="the device checked against the CPU (default tpu)")
    p.add_argument("--seed", type=int, default=None, help="the run's seed (default: a fresh one, printed)")
    p.add_argument(
        "--precision",
        default="highest",
        choices=["highest", "high", "medium"],
        help="torch.set_float32_matmul_precision (TorchTPU runs f32 matmuls in bf16 unless told)",
    )
    p.add_argument("--only", action="append", help="run these checks only (repeatable)")
    args = p.parse_args(argv)
    # transformers resolves the Hub name through kernels' LOCAL_KERNELS: the repo root holding build/
    os.environ.setdefault("LOCAL_KERNELS", f"{REPO_ID}={args.build.resolve().parent}")
    import torch
    import transformers

    import kernels
    from kernels import backends

    print(
        f"kernels' backend: {backends._backend()}, torch.backends.tpu: {hasattr(torch.backends, 'tpu')}; "
        f"float32 matmul precision {args.precision}",
        flush=True,
    )
    torch.set_float32_matmul_precision(args.precision)
    kernel = kernels.get_local_kernel(args.build)
    _register(kernel)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, kernels {kernels.__version__}; "
        f"build {kernel.__file__}, device {args.device}, seed {seed}",
        flush=True,
    )
    checks = _checks()
    unknown = set(args.only or ()) - set(checks)
    if unknown:
        p.error(f"--only: unknown checks {sorted(unknown)}; known: {sorted(checks)}")
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="tpu-kernels-models-") as work:

        def run(name):
            return [checks[name](name, args, rng, pathlib.Path(work), kernel)]

        return run_checks(args.only or list(checks), run, f"models on {args.device}")


if __name__ == "__main__":
    sys.exit(main())
