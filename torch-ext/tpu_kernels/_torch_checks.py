"""Checks of torch-only facts (tensor type, device) and the bridge to the JAX api's own validators.

Shape, dtype and parameter checks live once, in the JAX api; the torch wrappers run them on placeholders of the
torch tensors before calling an op, so real, fake and meta tensors all get the same clear error.
"""

import jax
import jax.numpy as jnp
import torch

SUPPORTED_DEVICE_TYPES = ("tpu", "cpu", "meta")

_TORCH_TO_JAX = {
    torch.float32: jnp.float32,
    torch.bfloat16: jnp.bfloat16,
    torch.float16: jnp.float16,
    torch.float64: jnp.float64,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.int8: jnp.int8,
    torch.bool: jnp.bool_,
}


def check_tensor(name: str, value, *, device: torch.device | None = None) -> torch.Tensor:
    """`value` must be a torch.Tensor on a supported device (and on `device`, when given)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.device.type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(f"{name}: expected a tensor on a tpu or cpu device, got device {value.device}")
    if device is not None and value.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of the first input), got {value.device}")
    return value


def placeholder(name: str, value):
    """A jax.ShapeDtypeStruct standing for a torch tensor (None and Python scalars pass through)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dtype not in _TORCH_TO_JAX:
        raise TypeError(f"{name}: dtype {value.dtype} is not supported by tpu-kernels")
    return jax.ShapeDtypeStruct(tuple(int(d) for d in value.shape), _TORCH_TO_JAX[value.dtype])


def has_symbolic_shape(*tensors) -> bool:
    return any(isinstance(t, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in t.shape) for t in tensors)


def values_or_placeholder(name: str, value: torch.Tensor):
    """The tensor's values (numpy) when they are on the host and real, so value checks (e.g. negative ids) can run;
    a placeholder for device, fake and meta tensors, whose values are unknown without a device sync."""
    if type(value) is torch.Tensor and value.device.type == "cpu":
        return value.detach().numpy()
    return placeholder(name, value)
