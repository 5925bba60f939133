"""Turning an annotated JAX api function into a torch custom op, the same way for every kernel.

- On a `tpu` tensor: TorchTPU's `jax_op` exports the JAX function for TPU (Mosaic kernel) and runs it in its graph.
- On a CPU tensor: the same JAX function runs in Pallas' TPU interpret mode; tensors cross by DLPack, no copies.
- Shapes under FakeTensorMode / meta / torch.compile come from a fake function written per op (jax_op's default fake
  exports for TPU on every call and refuses symbolic sizes).
Without torch-tpu installed (a plain CPU torch) the op is a torch.library.custom_op with the schema jax_op would
have generated, and only the CPU implementation.
"""

import inspect
import types
import typing

import jax
import torch

from tpu_kernels_jax.common.interpret import interpret_on_cpu

from ._ops import add_op_namespace_prefix

try:
    from torch.tpu.pallas import jax_op as _torch_tpu_jax_op  # TorchTPU's bridge (present with torch-tpu)
except (ImportError, AttributeError):
    _torch_tpu_jax_op = None

HAS_TORCH_TPU = _torch_tpu_jax_op is not None

_SCALAR_SCHEMA = {float: "float", int: "SymInt", bool: "bool", str: "str"}


def _schema_type(annotation) -> str:
    if annotation is jax.Array:
        return "Tensor"
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _schema_type(args[0]) + "?"
    if origin is tuple:
        return "(" + ", ".join(_schema_type(a) for a in typing.get_args(annotation)) + ")"
    if annotation in _SCALAR_SCHEMA:
        return _SCALAR_SCHEMA[annotation]
    raise TypeError(f"no torch schema type for annotation {annotation!r}")


def schema_of(jax_fn) -> str:
    """The torch schema of a JAX function's annotations, e.g. '(Tensor x, float eps) -> Tensor'."""
    signature = inspect.signature(inspect.unwrap(jax_fn), eval_str=True)
    params = ", ".join(f"{_schema_type(p.annotation)} {name}" for name, p in signature.parameters.items())
    return f"({params}) -> {_schema_type(signature.return_annotation)}"


def _to_jax(value):
    if isinstance(value, torch.Tensor):
        return jax.dlpack.from_dlpack(value.detach().contiguous())
    return value


def _to_torch(value):
    if isinstance(value, (tuple, list)):
        return type(value)(_to_torch(v) for v in value)
    if value is None:
        return None
    return torch.from_dlpack(value)


def _is_array_annotation(annotation) -> bool:
    return _schema_type(annotation).startswith("Tensor")


def _cpu_impl(jax_fn):
    """The CPU kernel: jit (once per shape and static values) and run the JAX function in TPU interpret mode."""
    signature = inspect.signature(inspect.unwrap(jax_fn), eval_str=True)
    static = tuple(i for i, p in enumerate(signature.parameters.values()) if not _is_array_annotation(p.annotation))
    jitted = jax.jit(jax_fn, static_argnums=static)

    def impl(*args):
        with interpret_on_cpu():
            return _to_torch(jitted(*(_to_jax(a) for a in args)))

    return impl


def define_op(name: str, jax_fn, fake_fn):
    """Register `jax_fn` (every parameter and the return annotated) as the custom op `<namespace>::<name>`."""
    qualified = add_op_namespace_prefix(name)
    if HAS_TORCH_TPU:
        op = _torch_tpu_jax_op(qualified, jax_fn)
    else:
        op = torch.library.custom_op(qualified, _cpu_impl(jax_fn), mutates_args=(), schema=schema_of(jax_fn))
    op.register_kernel("cpu", _cpu_impl(jax_fn))
    op.register_fake(fake_fn)
    return op
