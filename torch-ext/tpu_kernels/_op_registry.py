"""Turning an annotated JAX api function into a torch custom op, with its backward, the same way for every kernel.

One recipe: an op is its JAX function (every parameter and the return annotated, TorchTPU's `jax_op` convention), a
fake function (output shapes and dtypes under FakeTensorMode / meta / torch.compile, symbolic sizes included: jax_op's
default fake exports for TPU on every call and refuses them) and one `define_op` line naming the parameters that have
gradients. From those:

- the forward op `<namespace>::<name>`: on a `tpu` tensor TorchTPU's `jax_op` (the function is exported for TPU once
  per shape and static values, the Mosaic kernel spliced into TorchTPU's graph); on a CPU tensor the same function,
  jitted, in Pallas' TPU interpret mode, tensors crossing by DLPack. Without torch-tpu installed (a plain CPU torch)
  the op is a torch.library.custom_op with the schema jax_op would have generated, and only the CPU implementation.
- the backward op `<name>_backward`, derived from `jax.vjp` of the forward function, so the gradients are the JAX
  api's own (its custom_vjp rules and kernels), never a second implementation in torch. Its parameters are one
  cotangent per forward output (`grad_0`, `grad_1`, ...), the forward's parameters, and `wrt`: the comma-separated
  names of the inputs whose gradients are wanted (from autograd's `needs_input_grad`), so unwanted gradients are not
  computed. It returns one tensor per gradient parameter, in the order they were named; a gradient not asked for, or
  of an input that is None, is an empty float32 tensor (a torch op returns tensors, never None). Its fake is derived
  too: a gradient has its input's shape and dtype. It is a jax_op / CPU op like any other, so it runs on TPU as
  TorchTPU's jax_op and is opaque to tracing (torch.compile and AOT autograd see one op, not JAX code).
- autograd for the forward op (`register_autograd`): the tensor inputs are saved, the static values kept, and the
  backward calls the backward op. The vjp recomputes the forward inside the backward op; where a residual is a
  forward output (fused_add_rms_norm's rounded sum) the forward kernel runs again there, elsewhere XLA drops it.

Ops that update tensors in place (the KV cache write) follow the same recipe with `mutates=` (parameter names of
tensors) instead of `grads`: the JAX function returns the new values of those parameters, in that order, and

- the functional op `<name>_functional` is registered as above, its fake derived (each result has its mutated
  input's shape and dtype); on a `tpu` tensor it is TorchTPU's jax_op with those parameters donated
  (`donate_argnums`), so the kernel's input/output aliasing reaches the device buffers and XLA makes no copy;
- the op `<name>` is a torch.library custom op that declares the mutation (`mutates_args`, schema `Tensor(a!)`,
  returning nothing): it calls the functional op and writes each result back into its tensor with `copy_`, which is
  how TorchTPU itself returns a donated buffer to the caller's tensor (jax_op leaves donated tensors invalid and
  declares no mutation, so that Dynamo does not copy them back). On a CPU tensor the copy is a real copy (the
  interpret-mode path); the tensor keeps its storage either way. Its fake does nothing. Mutating ops have no
  autograd (inference only).

Static arguments are `int`, `float`, `bool` or `str`. A structured static (transformers' rope parameters dict) crosses
as one `str` of canonical JSON (`static_json`: keys sorted, no whitespace, so equal dicts give one string and so one
jit / export cache entry and one torch.compile guard); the JAX function decodes it with `json.loads`.
"""

import inspect
import json
import types
import typing

import jax
import jax.numpy as jnp
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


def _signature(jax_fn) -> inspect.Signature:
    return inspect.signature(inspect.unwrap(jax_fn), eval_str=True)


def schema_of(jax_fn) -> str:
    """The torch schema of a JAX function's annotations, e.g. '(Tensor x, float eps) -> Tensor'."""
    signature = _signature(jax_fn)
    params = ", ".join(f"{_schema_type(p.annotation)} {name}" for name, p in signature.parameters.items())
    return f"({params}) -> {_schema_type(signature.return_annotation)}"


def _encode_json(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        return float.__repr__(value)  # the shortest repr that reads back as the same float
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, list):
        return "[" + ",".join(_encode_json(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(_encode_json(str(k)) + ":" + _encode_json(value[k]) for k in sorted(value)) + "}"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def static_json(name: str, value) -> str:
    """A structured static argument as one canonical JSON string: keys sorted, no whitespace, floats by their shortest
    repr (see the module docstring). Written out here rather than by json.dumps, whose C encoder torch.compile cannot
    trace; outside tracing the string is read back and must give the value again, or the value is refused."""
    try:
        text = _encode_json(value)
    except TypeError as error:
        raise TypeError(
            f"{name}: expected dicts, lists, str, int, float, bool or None, got {value!r} ({error})"
        ) from None
    if not torch.compiler.is_compiling():
        try:
            same = json.loads(text) == value
        except ValueError:
            same = False
        if not same:
            raise ValueError(f"{name}: {value!r} does not survive JSON (a non-finite number or a quote in a string?)")
    return text


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
    signature = _signature(jax_fn)
    static = tuple(i for i, p in enumerate(signature.parameters.values()) if not _is_array_annotation(p.annotation))
    jitted = jax.jit(jax_fn, static_argnums=static)

    def impl(*args):
        with interpret_on_cpu():
            return _to_torch(jitted(*(_to_jax(a) for a in args)))

    return impl


def _register(name: str, jax_fn, fake_fn, donate_argnums: tuple[int, ...] = ()):
    qualified = add_op_namespace_prefix(name)
    if HAS_TORCH_TPU:
        op = _torch_tpu_jax_op(qualified, jax_fn, donate_argnums=list(donate_argnums) or None)
    else:
        op = torch.library.custom_op(qualified, _cpu_impl(jax_fn), mutates_args=(), schema=schema_of(jax_fn))
    op.register_kernel("cpu", _cpu_impl(jax_fn))
    op.register_fake(fake_fn)
    op.jax_fn = jax_fn  # what jax_op exports on a TPU (the tests export it for TPU on this host)
    return op


def _output_count(signature: inspect.Signature) -> int:
    returned = signature.return_annotation
    if returned is jax.Array:
        return 1
    if typing.get_origin(returned) is tuple and all(a is jax.Array for a in typing.get_args(returned)):
        return len(typing.get_args(returned))
    raise TypeError(f"a differentiable op returns jax.Array or a tuple of them, got {returned!r}")


def _vjp_function(jax_fn, grads: tuple[str, ...]):
    """The backward op's JAX function: (grad_0, ..., *forward parameters, wrt) -> one gradient per name in grads.

    A plain function carrying its signature in `__signature__`, which is what jax_op and jax.jit read."""
    forward = _signature(jax_fn)
    names = list(forward.parameters)
    outputs = _output_count(forward)
    grad_index = [names.index(g) for g in grads]

    def backward(*args):
        cotangents, inputs, wrt = args[:outputs], list(args[outputs:-1]), set(args[-1].split(","))
        wanted = [i for i in grad_index if names[i] in wrt and inputs[i] is not None]

        def forward_of(*primals):
            full = list(inputs)
            for i, value in zip(wanted, primals):
                full[i] = value
            return jax_fn(*full)

        primal_out, vjp = jax.vjp(forward_of, *(inputs[i] for i in wanted))
        out_leaves = primal_out if outputs > 1 else (primal_out,)
        cts = tuple(c.astype(o.dtype) for c, o in zip(cotangents, out_leaves))
        computed = dict(zip(wanted, vjp(cts if outputs > 1 else cts[0])))
        result = tuple(computed[i] if i in computed else jnp.zeros((0,), jnp.float32) for i in grad_index)
        return result if len(result) > 1 else result[0]

    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(f"grad_{i}", positional, annotation=jax.Array) for i in range(outputs)]
    params += [p.replace(kind=positional, default=inspect.Parameter.empty) for p in forward.parameters.values()]
    params.append(inspect.Parameter("wrt", positional, annotation=str))
    returned = jax.Array if len(grads) == 1 else tuple[(jax.Array,) * len(grads)]
    backward.__signature__ = inspect.Signature(params, return_annotation=returned)
    backward.__name__ = backward.__qualname__ = f"{jax_fn.__name__}_backward"
    return backward


def _vjp_fake(jax_fn, grads: tuple[str, ...]):
    """The backward op's fake: a gradient has its input's shape and dtype; one not asked for is empty float32."""
    forward = _signature(jax_fn)
    names = list(forward.parameters)
    outputs = _output_count(forward)
    grad_index = [names.index(g) for g in grads]

    def fake(*args):
        inputs, wrt = args[outputs:-1], set(args[-1].split(","))
        device = args[0].device
        result = tuple(
            inputs[i].new_empty(inputs[i].shape)
            if names[i] in wrt and inputs[i] is not None
            else torch.empty((0,), dtype=torch.float32, device=device)
            for i in grad_index
        )
        return result if len(result) > 1 else result[0]

    return fake


def _register_autograd(op, backward_op, jax_fn, grads: tuple[str, ...]):
    names = list(_signature(jax_fn).parameters)
    grad_index = [names.index(g) for g in grads]
    tensor_index = [
        i for i, p in enumerate(_signature(jax_fn).parameters.values()) if _is_array_annotation(p.annotation)
    ]

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*(inputs[i] for i in tensor_index))
        ctx.inputs = [None if i in tensor_index else value for i, value in enumerate(inputs)]

    def backward(ctx, *cotangents):
        inputs = list(ctx.inputs)
        for i, tensor in zip(tensor_index, ctx.saved_tensors):
            inputs[i] = tensor
        wanted = [i for i in grad_index if ctx.needs_input_grad[i]]
        result = [None] * len(inputs)
        if not wanted:
            return tuple(result)
        computed = backward_op(*(c.contiguous() for c in cotangents), *inputs, ",".join(names[i] for i in wanted))
        computed = computed if len(grad_index) > 1 else (computed,)
        for i, gradient in zip(grad_index, computed):
            if i in wanted and inputs[i] is not None:
                result[i] = gradient
        return tuple(result)

    op.register_autograd(backward, setup_context=setup_context)


def _mutating_schema(jax_fn, mutates: tuple[str, ...]) -> str:
    """The schema of the mutating op: jax_fn's parameters, each mutated tensor `Tensor(x!)`, returning nothing."""
    signature = _signature(jax_fn)
    params = []
    for name, p in signature.parameters.items():
        kind = _schema_type(p.annotation)
        if name in mutates:
            if kind != "Tensor":
                raise TypeError(f"mutates: {name} must be a (non-optional) tensor parameter, it is {kind}")
            kind = f"Tensor({chr(ord('a') + mutates.index(name))}!)"
        params.append(f"{kind} {name}")
    return f"({', '.join(params)}) -> ()"


def _define_mutating_op(name: str, jax_fn, mutates: tuple[str, ...]):
    names = list(_signature(jax_fn).parameters)
    unknown = [m for m in mutates if m not in names]
    if unknown:
        raise ValueError(f"mutates: {unknown} are not parameters of {jax_fn.__name__}")
    index = [names.index(m) for m in mutates]

    def functional_fake(*args):
        results = tuple(args[i].new_empty(args[i].shape) for i in index)
        return results if len(results) > 1 else results[0]

    functional = _register(f"{name}_functional", jax_fn, functional_fake, donate_argnums=tuple(index))

    def impl(*args):
        results = functional(*args)
        results = results if len(index) > 1 else (results,)
        for i, result in zip(index, results):
            args[i].copy_(result)

    op = torch.library.custom_op(
        add_op_namespace_prefix(name), impl, mutates_args=mutates, schema=_mutating_schema(jax_fn, mutates)
    )
    op.register_fake(lambda *args: None)
    op.functional_op = functional
    op.jax_fn = jax_fn
    op.backward_op = None
    return op


def define_op(name: str, jax_fn, fake_fn, *, grads: tuple[str, ...] = (), mutates: tuple[str, ...] = ()):
    """Register `jax_fn` as the custom op `<namespace>::<name>` with fake `fake_fn`; with `grads` (parameter names of
    jax_fn, tensors), also `<name>_backward` from jax.vjp and the op's autograd. Returns the forward op; the backward
    op is its attribute `backward_op`, and each op's JAX function its attribute `jax_fn`.

    With `mutates` (parameter names of tensors) the op updates those tensors in place and returns nothing; jax_fn
    returns their new values in that order, and fake_fn must be None (both fakes are derived). See the module
    docstring; the functional op is the attribute `functional_op`."""
    if mutates:
        if grads or fake_fn is not None:
            raise ValueError("define_op: a mutating op takes neither grads (inference only) nor a fake function")
        return _define_mutating_op(name, jax_fn, tuple(mutates))
    op = _register(name, jax_fn, fake_fn)
    op.backward_op = None
    if grads:
        backward_op = _register(f"{name}_backward", _vjp_function(jax_fn, grads), _vjp_fake(jax_fn, grads))
        _register_autograd(op, backward_op, jax_fn, grads)
        op.backward_op = backward_op
    return op
