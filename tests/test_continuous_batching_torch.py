"""transformers' continuous batching (generate_batch) with tpu_kernels.paged_attention_forward registered for the Hub
spelling: on tiny random Qwen3 and Gemma 4 models the greedy tokens are plain generate's with "sdpa", and every
cache write and every attention of every step is one of our ops (transformers' own cache update never runs)."""

import collections

import pytest
import tiny_models
import torch
from hub import REPO_ID
from test_paged_attention_torch import MODELS, PAGE, PROMPT_LENGTHS, _counting, hub_kernels  # noqa: F401

from tpu_kernels.continuous_batching import CB_ATTENTION

# A step takes at most 16 tokens: the 20-token prompt is prefilled in chunks (the later chunk reads its past from the
# cache), prompts and decodes share steps, and every step has the kernels' smallest token bucket (one program).
MAX_BATCH_TOKENS = 16
NEW_TOKENS = 2
# Gemma 4's sliding window of 18 (two pages of 16, the second partial): the 20-token prompt's second chunk wraps its
# ring (the window gathered, flash attention) and its decode reads the wrapped ring as pages rotated by its position.
# Both of its layer types take one head dim (see MODELS).
CB_MODELS = MODELS | {"gemma4": lambda seed: tiny_models.gemma4(seed, global_head_dim=128, sliding_window=18)}


@pytest.mark.parametrize("model_name", CB_MODELS)
def test_generate_batch_writes_and_attends_with_our_ops(rand, model_name, hub_kernels, tmp_path):  # noqa: F811
    """generate_batch with attn_implementation CB_ATTENTION and register_continuous_batching: the greedy tokens of
    plain generate with "sdpa"; per attention call (counted on the attention modules) two reshape_and_cache_flash
    calls (the cache buffer's halves) and one attention op: ragged_paged_attention over the cache's pages, or for a
    Gemma 4 sliding layer whose window wrapped within a prefill chunk flash attention over the window gathered before
    the write; transformers' allocators'
    update (its index_copy_ writes and index_select gathers) is never called."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import cache_allocators

    import kernels

    CB_MODELS[model_name](rand.seed).save_pretrained(tmp_path / model_name)
    models = {
        name: AutoModelForCausalLM.from_pretrained(tmp_path / model_name, attn_implementation=name, dtype=torch.float32)
        for name in ("sdpa", CB_ATTENTION)
    }
    ours = models[CB_ATTENTION]
    kernel = kernels.get_kernel(REPO_ID, version=1)
    assert kernel.register_continuous_batching(ours) == CB_ATTENTION
    # no end-of-sequence token: every request generates NEW_TOKENS tokens in both runs
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    prompts = [rand.rng.integers(1, tiny_models.VOCAB, n).tolist() for n in PROMPT_LENGTHS]
    with torch.no_grad():
        runs = [
            models["sdpa"].generate(torch.tensor([p]), config, output_scores=True, return_dict_in_generate=True)
            for p in prompts
        ]
    expected = [run.sequences[0, len(p) :].tolist() for run, p in zip(runs, prompts)]
    # the chosen tokens' log-probabilities: a wrong key read that leaves the argmax alone still moves them
    expected_logprobs = [
        [float(torch.log_softmax(score[0], -1)[t]) for score, t in zip(run.scores, tokens)]
        for run, tokens in zip(runs, expected)
    ]

    calls = collections.Counter()
    hooks = [
        layer.self_attn.register_forward_hook(lambda *a: calls.update(["attention"])) for layer in ours.model.layers
    ]
    cb_config = ContinuousBatchingConfig(
        page_size=PAGE, num_blocks=16, max_batch_tokens=MAX_BATCH_TOKENS, return_logprobs=True
    )
    with pytest.MonkeyPatch.context() as patch:
        _counting(patch, kernel.kv_cache_ops, "reshape_and_cache_flash_op", calls)
        _counting(patch, kernel.paged_attention_ops, "ragged_paged_attention_op", calls)
        _counting(patch, kernel.flash_attention_ops, "flash_attention_varlen_op", calls)
        _counting(patch, kernel.flash_attention_ops, "flash_attention_op", calls)
        for allocator in (
            cache_allocators.FullAttentionCacheAllocator,
            cache_allocators.SlidingAttentionCacheAllocator,
        ):
            _counting(patch, allocator, "update", calls)
        outputs = ours.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config)
    for hook in hooks:
        hook.remove()
    results = [outputs[key] for key in sorted(outputs, key=lambda k: int(k.split("_")[-1]))]
    assert [r.generated_tokens for r in results] == expected
    logprobs = [x for r in results for x in r.logprobs]
    assert logprobs == pytest.approx([x for row in expected_logprobs for x in row], abs=1e-4)
    attention = calls.pop("attention")
    layers = ours.config.num_hidden_layers
    steps = attention // layers
    assert attention == steps * layers and steps > NEW_TOKENS  # the chunked prefill takes steps of its own
    assert calls.pop("reshape_and_cache_flash_op") == 2 * attention  # the buffer's two halves
    gathered = calls.pop("flash_attention_varlen_op", 0)
    assert calls.pop("ragged_paged_attention_op") + gathered == attention
    # Qwen3 has no sliding layer; Gemma 4's wraps within the 20-token prompt's second chunk only
    assert (gathered > 0) == (model_name == "gemma4") and gathered < steps
    assert not calls  # no allocator update, no dense flash attention


def test_paged_attention_forward_bad_input_names_the_argument(rand):
    """With a paged cache: dropout, a query that is not transformers' packed [1, H, T, D] batch and a block table
    (transformers' CUDA-only decode path) are clear errors naming the argument; so is a non-flash model name."""
    from transformers.generation.continuous_batching import PagedAttentionCache

    from tpu_kernels.continuous_batching import paged_attention_forward, register_continuous_batching

    cache = object.__new__(PagedAttentionCache)  # only its type is read before the checks
    module = torch.nn.Module()
    module.is_causal, module.layer_idx = True, 0
    q, k = (torch.from_numpy(rand.rng.standard_normal((1, h, 4, 16), dtype="float32")) for h in (4, 2))
    with pytest.raises(ValueError, match="dropout: continuous batching is inference only"):
        paged_attention_forward(module, q, k, k, None, cache=cache, dropout=0.1)
    with pytest.raises(ValueError, match=r"query: expected transformers' packed batch \[1, heads"):
        paged_attention_forward(module, q.expand(2, -1, -1, -1), k, k, None, cache=cache)
    with pytest.raises(ValueError, match="block_table: expected None"):
        paged_attention_forward(module, q, k, k, None, cache=cache, block_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="model: generate_batch takes a flash attention name only"):
        register_continuous_batching("sdpa")
