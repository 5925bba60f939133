"""Checks of torch-only facts (tensor type, device, integer casts) and the bridge to the JAX api's own validators.

Shape, dtype and parameter checks live once, in the JAX api; the torch wrappers run them on placeholders of the
torch tensors before calling an op, so real, fake and meta tensors all get the same clear error. Checks that need
values (negative expert ids, position ranges, int64 values that int32 cannot hold) run only on real host tensors:
a device tensor's values would cost a sync, and fake or meta tensors have none. Under torch.compile tracing
(`tracing()`) the wrappers skip the api checks, which are Python over JAX objects that Dynamo cannot trace; the op's
own JAX function validates the same shapes and dtypes when the compiled graph first runs it.
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
    torch.uint8: jnp.uint8,  # MXFP4 expert weights: packed e2m1 codes and e8m0 scales
    torch.bool: jnp.bool_,
    torch.float8_e4m3fn: jnp.float8_e4m3fn,  # fp8 KV caches
}

_INT32 = torch.iinfo(torch.int32)


def tracing() -> bool:
    """True while torch.compile (Dynamo) traces the caller: no host values, no JAX calls."""
    return torch.compiler.is_compiling()


def check_tensor(name: str, value, *, device: torch.device | None = None) -> torch.Tensor:
    """`value` must be a torch.Tensor on a supported device (and on `device`, when given)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.device.type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(f"{name}: expected a tensor on a tpu or cpu device, got device {value.device}")
    if device is not None and value.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of the first input), got {value.device}")
    return value


def placeholder(name: str, value, *, float16_as_float32: bool = False):
    """A jax.ShapeDtypeStruct standing for a torch tensor (None and Python scalars pass through). With
    float16_as_float32, a float16 tensor stands as float32: the ops that take float16 by running it as float32."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dtype not in _TORCH_TO_JAX:
        raise TypeError(f"{name}: dtype {value.dtype} is not supported by tpu-kernels")
    dtype = _TORCH_TO_JAX[value.dtype]
    if float16_as_float32 and value.dtype == torch.float16:
        dtype = jnp.float32
    return jax.ShapeDtypeStruct(tuple(int(d) for d in value.shape), dtype)


def has_symbolic_shape(*tensors) -> bool:
    return any(isinstance(t, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in t.shape) for t in tensors)


def _has_host_values(value) -> bool:
    return type(value) is torch.Tensor and value.device.type == "cpu" and not tracing()


def values_or_placeholder(name: str, value: torch.Tensor):
    """The tensor's values (numpy) when they are on the host and real, so value checks (e.g. negative ids) can run;
    a placeholder for device, fake and meta tensors, whose values are unknown without a device sync."""
    if _has_host_values(value):
        return value.detach().numpy()
    return placeholder(name, value)


def as_int32(name: str, value: torch.Tensor) -> torch.Tensor:
    """Integer indices as the int32 the kernels take, cast once. torch's index tensors (transformers' position_ids,
    router top-k ids) are int64; on a host tensor the values must fit int32, so the cast cannot wrap one into a valid
    index (on a device tensor they are not checked, which would need a sync). Other dtypes pass unchanged, for the
    api's dtype check to name them."""
    if value.dtype not in (torch.int64, torch.int16, torch.int8, torch.uint8):
        return value
    if value.dtype == torch.int64 and _has_host_values(value) and value.numel():
        low, high = int(value.min()), int(value.max())
        if low < _INT32.min or high > _INT32.max:
            raise ValueError(
                f"{name}: expected int64 values that int32 can hold, in [{_INT32.min}, {_INT32.max}], "
                f"got values in [{low}, {high}]"
            )
    return value.to(torch.int32)


def contiguous(value):
    """Ops take dense tensors (DLPack and TorchTPU's kernel call read the buffer as it lies); views are copied once."""
    return value.contiguous() if isinstance(value, torch.Tensor) else value
