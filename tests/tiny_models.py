"""Tiny transformers models built from configs with random weights (no download), shared by the model tests.

Norm weights are drawn around 1 instead of the all-ones init, so a kernel that ignored them would be caught.
"""

import torch

VOCAB = 211


def randomize_norm_weights(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if "RMSNorm" in type(module).__name__ and isinstance(getattr(module, "weight", None), torch.Tensor):
                module.weight.copy_(1.0 + 0.3 * torch.randn(module.weight.shape, generator=generator))
    return model


def qwen3(seed, **overrides):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **{
            "vocab_size": VOCAB,
            "hidden_size": 96,
            "intermediate_size": 160,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            **overrides,
        }
    )
    torch.manual_seed(seed)
    return randomize_norm_weights(Qwen3ForCausalLM(config).eval(), seed)


def qwen3_moe(seed, **overrides):
    """Qwen3-MoE's architecture (SiLU experts, renormalized top-k), 8 experts, top-2, every layer MoE."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **{
            "vocab_size": VOCAB,
            "hidden_size": 128,
            "intermediate_size": 192,
            "moe_intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "max_position_embeddings": 64,
            "tie_word_embeddings": False,
            **overrides,
        }
    )
    torch.manual_seed(seed)
    return randomize_norm_weights(Qwen3MoeForCausalLM(config).eval(), seed)


def gemma4(seed, *, moe=False, **overrides):
    """Gemma 4 text architecture: a sliding and a full attention layer; with moe=True the MoE block (GELU-tanh
    experts, 8 experts, top-2) beside the dense MLP, as in Gemma 4 26B-A4B."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

    moe_args = {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 64}
    config = Gemma4TextConfig(
        **{
            "vocab_size": VOCAB,
            "hidden_size": 128,
            "intermediate_size": 160,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 128,
            "global_head_dim": 256,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
            "vocab_size_per_layer_input": VOCAB,
            "hidden_size_per_layer_input": 16,
            "max_position_embeddings": 64,
            **(moe_args if moe else {}),
            **overrides,
        }
    )
    torch.manual_seed(seed)
    return randomize_norm_weights(Gemma4ForCausalLM(config).eval(), seed)


def gpt_oss(seed, **overrides):
    """gpt-oss attention: attention sinks (one logit per query head, drawn at unit scale instead of the 0.02 init so
    they change the softmax) and a sliding window on alternate layers; its MoE kept tiny (4 experts, top-2)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        **{
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
            "max_position_embeddings": 64,
            **overrides,
        }
    )
    torch.manual_seed(seed)
    model = randomize_norm_weights(GptOssForCausalLM(config).eval(), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=generator))
    return model


def granitemoe_gelu(seed, **overrides):
    """GraniteMoe with exact (erf) GELU experts, `hidden_act="gelu"`: what transformers' own MoE model testers
    configure (their default hidden_act), 8 experts, top-2."""
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    config = GraniteMoeConfig(
        **{
            "vocab_size": VOCAB,
            "hidden_size": 128,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "hidden_act": "gelu",
            "max_position_embeddings": 64,
            "tie_word_embeddings": False,
            **overrides,
        }
    )
    torch.manual_seed(seed)
    return randomize_norm_weights(GraniteMoeForCausalLM(config).eval(), seed)


def gpt_oss_moe(seed, **overrides):
    """gpt-oss for its experts (interleaved gate/up with biases, the clamped SwiGLU): the tiny gpt_oss with a clamp
    limit its pre-activations cross (0.4 against values of ~0.2-1 here, where 7.0 against the 0.02 init never would)
    and random expert and router biases (the init leaves them zero, which would hide a dropped bias)."""
    model = gpt_oss(seed, **{"swiglu_limit": 0.4, **overrides})
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for layer in model.model.layers:
            experts, router = layer.mlp.experts, layer.mlp.router
            experts.gate_up_proj.normal_(0.0, 0.1, generator=generator)
            for bias in (experts.gate_up_proj_bias, experts.down_proj_bias, router.bias):
                bias.copy_(0.3 * torch.randn(bias.shape, generator=generator))
    return model
