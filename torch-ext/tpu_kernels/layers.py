"""Layers for the `kernels` library's `kernelize`: forward-only replacements that read the host module's state."""

import torch
from torch import nn

from .rms_norm_ops import rms_norm
from .rotary_ops import apply_rotary


class RMSNorm(nn.Module):
    """Drop-in forward for transformers' `@use_kernel_forward_from_hub("RMSNorm")` classes (Qwen3, Llama, ...).

    Reads `self.weight` [hidden] and `self.variance_epsilon`. The result has the dtype transformers' own forward
    gives (x's dtype promoted with the weight's).
    """

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return out.to(torch.promote_types(hidden_states.dtype, self.weight.dtype))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _torch_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim):
    """transformers' own formula, for inputs the kernel does not take (float16, other unsqueeze dims)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class RotaryPosEmb(nn.Module):
    """Drop-in forward for transformers' `rotary_pos_emb` hub function, `apply_rotary_pos_emb(q, k, cos, sin,
    unsqueeze_dim=1) -> (q_embed, k_embed)` (Qwen3, Llama, ...): q/k [B, H, S, D] with unsqueeze_dim=1 or
    [B, S, H, D] with unsqueeze_dim=2, cos/sin [B, S, D]. One kernel pass over q and k. The result has the dtype
    transformers' formula gives (q's dtype promoted with cos's); float16 or other unsqueeze dims use that formula.
    Also importable as `apply_rotary_transformers`, the layer name the Hub's CUDA rotary kernels use.
    """

    has_backward = True
    can_torch_compile = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        supported = (torch.float32, torch.bfloat16)
        if unsqueeze_dim not in (1, 2) or q.dtype not in supported or cos.dtype not in supported or cos.dim() != 3:
            return _torch_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
        out_q, out_k = apply_rotary(q, k, cos, sin, layout="bhsd" if unsqueeze_dim == 1 else "bshd")
        return out_q.to(torch.promote_types(q.dtype, cos.dtype)), out_k.to(torch.promote_types(k.dtype, cos.dtype))


apply_rotary_transformers = RotaryPosEmb
