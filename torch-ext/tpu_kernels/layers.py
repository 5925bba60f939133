"""Layers for the `kernels` library's `kernelize`: forward-only replacements that read the host module's state."""
import torch
from torch import nn

from .rms_norm_ops import rms_norm


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
