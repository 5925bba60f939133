"""Torch custom ops for flash attention, flash-attn 2's `flash_attn_func` / `flash_attn_varlen_func` over them (the
names and signatures transformers' Hub attention integration looks up and calls), and `attention_forward`, a function
for transformers' AttentionInterface. Gradients (q, k, v, the sinks `s_aux`) come from the JAX api's vjp
(_op_registry).

transformers, with `attn_implementation="kernels-community/tpu-kernels"`, registers its own flash_attention_forward
over this module's flash_attn_varlen_func: it unpads a padded batch into packed sequences (cu_seqlens int32,
max_seqlen a Python int from `.item()`), and for packed position_ids it passes max_seqlen as a 0-d int32 tensor.
Its own cu_seqlens are int32 on every path (its packing data collator's too), but its FlashAttentionKwargs declare
them LongTensor, so callers build int64 ones: as every index tensor of this package they are cast once to int32
(host values checked to fit). Host cu_seqlens are validated by value, device ones by shape and dtype only.
"""

import contextlib

import jax
import torch

from tpu_kernels_jax.flash_attention import api
from tpu_kernels_jax.flash_attention import checks as attention_checks

from . import _torch_checks as checks
from . import paged_attention_ops
from ._op_registry import define_op


# The JAX functions the ops are made from. Annotations drive the torch schema (TorchTPU's jax_op convention);
# window_size crosses as two ints (a schema has no int pairs).
def _flash_attention_jax(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    sinks: jax.Array | None,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
) -> jax.Array:
    with _torch_names():
        return api.flash_attention(
            q,
            k,
            v,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=(window_left, window_right),
            softcap=softcap,
            sinks=sinks,
        )


def _flash_attention_varlen_jax(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    sinks: jax.Array | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
) -> jax.Array:
    with _torch_names():
        return api.flash_attention_varlen(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=(window_left, window_right),
            softcap=softcap,
            sinks=sinks,
        )


def _fake_attention(q, k, v, *rest):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


flash_attention_op = define_op("flash_attention", _flash_attention_jax, _fake_attention, grads=("q", "k", "v", "sinks"))
flash_attention_varlen_op = define_op(
    "flash_attention_varlen", _flash_attention_varlen_jax, _fake_attention, grads=("q", "k", "v", "sinks")
)


# ---------------------------------------------------------------------------------------------------- validation
@contextlib.contextmanager
def _torch_names():
    """The JAX api calls the sinks `sinks`; flash-attn's torch API and transformers call them `s_aux`. Errors name
    the argument the caller passed."""
    try:
        yield
    except (TypeError, ValueError) as error:
        message = str(error)
        if message.startswith("sinks:"):
            raise type(error)("s_aux:" + message[len("sinks:") :]) from None
        raise


def _check_not_implemented(dropout_p, alibi_slopes, return_attn_probs):
    """flash-attn arguments these kernels do not implement: an error, never silently ignored."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p: expected a Python float, got {type(dropout_p).__name__}")
    if dropout_p != 0:
        raise ValueError(
            f"dropout_p: attention dropout is not implemented by tpu-kernels (expected 0.0, got {dropout_p})"
        )
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: ALiBi is not implemented by tpu-kernels (expected None)")
    if return_attn_probs is not False:
        raise ValueError(
            f"return_attn_probs: returning the attention probabilities is not implemented by tpu-kernels "
            f"(expected False, got {return_attn_probs!r})"
        )


def _check_deterministic(deterministic):
    # Accepted for flash-attn's signature: the kernels are deterministic (no atomics), whatever it says.
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__} {deterministic!r}")


def _check_devices(q, k, v, s_aux, *index_tensors):
    checks.check_tensor("q", q)
    for name, t in (("k", k), ("v", v), *index_tensors):
        checks.check_tensor(name, t, device=q.device)
    if s_aux is not None:
        checks.check_tensor("s_aux", s_aux, device=q.device)


def _options(q, k, v, s_aux, *, ndim, softmax_scale, causal, window_size, softcap):
    """The JAX api's checks of q, k, v, s_aux and the options on placeholders of the tensors (real, fake or meta
    alike); returns the options as the op takes them: (softmax_scale, causal, window_left, window_right, softcap).
    Under torch.compile tracing only the conversion runs; the op's JAX function checks again when it first runs."""
    if checks.tracing() or checks.has_symbolic_shape(q, k, v, s_aux):
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        left, right = window_size
        return scale, bool(causal), int(left), int(right), float(softcap)
    ph = {name: checks.placeholder(name, t) for name, t in (("q", q), ("k", k), ("v", v), ("s_aux", s_aux))}
    with _torch_names():
        # the checks the JAX entry points run first, on placeholders
        _, q_heads, _, head_dim, _ = attention_checks.check_qkv(ph["q"], ph["k"], ph["v"], ndim)
        scale, causal, (left, right), softcap = attention_checks.check_options(
            softmax_scale, causal, window_size, softcap, head_dim
        )
        attention_checks.check_sinks(ph["s_aux"], q_heads)
    return scale, causal, left, right, softcap


def _max_seqlen(name, value):
    """A one-element integer tensor as a Python int, the type the kernels size their visit lists by. transformers
    passes a Python int, or for packed position_ids a 0-d int32 tensor (read here: on a `tpu` tensor that is one
    device sync per call, as transformers' own `.item()` on its other paths). Other values pass to the api's check."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() != 1 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(
            f"{name}: expected a Python int or a one-element integer tensor, got a {value.dtype} tensor of shape "
            f"{tuple(value.shape)}"
        )
    return int(value.item())


def _cu_seqlens(name, value, rows):
    """cu_seqlens as int32 (int64 cast once); host values checked as the api checks concrete arrays. Returns
    (tensor, longest sequence or None when the values are not on the host)."""
    value = checks.as_int32(name, value)
    if checks.tracing() or checks.has_symbolic_shape(value):
        return checks.contiguous(value), None
    return checks.contiguous(value), attention_checks.check_cu_seqlens(
        name, checks.values_or_placeholder(name, value), rows
    )


# ----------------------------------------------------------------------------------------------------- public API
def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash-attn 2's flash_attn_func: attention over a batch of equal-length sequences.

    q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] (Hq a multiple of Hkv), float32, bfloat16 or float16 (run
    as float32), D and Dv up to 512. softmax_scale: None for D ** -0.5. causal: bottom-right aligned when Sq != Sk.
    window_size (left, right): -1 unbounded. softcap: > 0 for softcap * tanh(scores / softcap). s_aux: None or [Hq]
    attention-sink logits (gpt-oss). -> out [B, Sq, Hq, Dv] in q's dtype. Differentiable in q, k, v and s_aux.
    Not implemented (an error if set): dropout_p > 0, alibi_slopes, return_attn_probs. deterministic is accepted:
    the kernels are deterministic.
    """
    _check_not_implemented(dropout_p, alibi_slopes, return_attn_probs)
    _check_deterministic(deterministic)
    _check_devices(q, k, v, s_aux)
    options = _options(
        q, k, v, s_aux, ndim=4, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap
    )
    tensors = (checks.contiguous(t) for t in (q, k, v, s_aux))
    return flash_attention_op(*tensors, *options)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | torch.Tensor,
    max_seqlen_k: int | torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash-attn 2's flash_attn_varlen_func: attention over packed sequences of different lengths.

    q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv]; sequence s is query rows cu_seqlens_q[s]:cu_seqlens_q[s + 1] and
    key rows cu_seqlens_k[s]:cu_seqlens_k[s + 1] (int32, or int64 cast once; [N + 1], from 0 to the token count,
    non-decreasing; checked by value on the host). max_seqlen_q / max_seqlen_k: at least every sequence's length, a
    Python int or a one-element integer tensor (read on the host). Other arguments as flash_attn_func. -> out [Tq, Hq,
    Dv] in q's dtype. Differentiable in q, k, v and s_aux.

    With block_table [N, max_blocks] (paged prefill, inference only): k / v are the paged KV caches [num_blocks,
    page_block_size, Hkv, D / Dv], cu_seqlens_k the offsets of the sequences' context lengths (the new tokens
    included, already in the cache); the queries are the last positions of each context. Runs
    ragged_paged_attention (paged_attention_ops.flash_attn_varlen_paged).
    """
    _check_not_implemented(dropout_p, alibi_slopes, return_attn_probs)
    _check_deterministic(deterministic)
    if block_table is not None:
        return paged_attention_ops.flash_attn_varlen_paged(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            block_table=block_table,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            s_aux=s_aux,
        )
    _check_devices(q, k, v, s_aux, ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    options = _options(
        q, k, v, s_aux, ndim=3, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap
    )
    cu_q, longest_q = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    cu_k, longest_k = _cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if cu_k.shape != cu_q.shape:
        raise ValueError(
            f"cu_seqlens_k: expected the shape of cu_seqlens_q {tuple(cu_q.shape)} (one entry per sequence + 1), "
            f"got {tuple(cu_k.shape)}"
        )
    max_q, max_k = _max_seqlen("max_seqlen_q", max_seqlen_q), _max_seqlen("max_seqlen_k", max_seqlen_k)
    if not checks.tracing():  # under tracing they may be SymInts from transformers' `.item()`
        max_q = attention_checks.check_max_seqlen("max_seqlen_q", max_q, longest_q)
        max_k = attention_checks.check_max_seqlen("max_seqlen_k", max_k, longest_k)
    tensors = (checks.contiguous(t) for t in (q, k, v))
    return flash_attention_varlen_op(*tensors, cu_q, cu_k, checks.contiguous(s_aux), max_q, max_k, *options)


# ------------------------------------------------------------------------------------ transformers' AttentionInterface
def _window(sliding_window):
    # transformers' sliding window counts the current key: `sliding_window` keys in all, flash-attn's left size + 1.
    return (-1, -1) if sliding_window is None else (int(sliding_window) - 1, int(sliding_window) - 1)


def _check_flash_mask_registered(module):
    """Without a mask function registered for its name, transformers hands an attention function no mask at all,
    padding included; attention_forward would then attend to padding silently. Refuse that configuration."""
    name = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if name is None:
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"attention_mask: no mask function is registered for attn_implementation {name!r}, so transformers passes "
            f"no padding mask; register flash attention's: AttentionMaskInterface.register({name!r}, "
            "ALL_MASK_ATTENTION_FUNCTIONS['flash_attention_2'])"
        )


def _cumulative(lengths):
    return torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))


def _padded_attention(q, k, v, attention_mask, options):
    """A padded batch (flash attention's 2-D mask, True = a real token) as packed sequences: the valid keys of each
    row, and its valid queries among the last q_len positions (transformers pads on the left for generation)."""
    if attention_mask.dim() != 2 or attention_mask.shape[0] != q.shape[0]:
        raise ValueError(
            f"attention_mask: expected None or a [batch, keys] padding mask (flash attention's mask function: "
            f"ALL_MASK_ATTENTION_FUNCTIONS['flash_attention_2']), got shape {tuple(attention_mask.shape)}"
        )
    batch, q_len = q.shape[:2]
    mask = attention_mask.bool()
    if k.shape[1] > mask.shape[1]:  # a static cache longer than the tokens seen so far
        k, v = k[:, : mask.shape[1]], v[:, : mask.shape[1]]
    elif k.shape[1] < mask.shape[1]:
        raise ValueError(
            f"attention_mask: expected at most {k.shape[1]} key positions (the keys' length), got {mask.shape[1]}"
        )
    q_mask = mask[:, -q_len:]
    rows_q = q_mask.flatten().nonzero().flatten()
    rows_k = mask.flatten().nonzero().flatten()
    lengths_q, lengths_k = q_mask.sum(-1, dtype=torch.int32), mask.sum(-1, dtype=torch.int32)
    out = flash_attn_varlen_func(
        q.reshape(-1, *q.shape[2:])[rows_q],
        k.reshape(-1, *k.shape[2:])[rows_k],
        v.reshape(-1, *v.shape[2:])[rows_k],
        _cumulative(lengths_q),
        _cumulative(lengths_k),
        int(lengths_q.max()),
        int(lengths_k.max()),
        **options,
    )
    full = out.new_zeros((batch * q_len, *out.shape[1:])).index_copy(0, rows_q, out)
    return full.view(batch, q_len, *out.shape[1:])


def _cache_prefix_attention(q, k, v, positions, options):
    """Queries over a cache longer than the tokens seen so far, with no padding mask: a static cache, whose all-ones
    mask transformers drops for an implementation whose name lacks "flash". Row b's keys are the first
    min(Sk, its last position + 1) (a sliding-window cache, once full, holds exactly its last Sk tokens), bottom-right
    aligned with its queries. Run as packed sequences, each row's followed by an empty one (no queries) holding the
    rest of the row, so the bounds stay on the device."""
    batch, q_len, k_len = q.shape[0], q.shape[1], k.shape[1]
    last = positions.reshape(-1, positions.shape[-1])[:, -1].to(torch.int32).expand(batch)
    valid = torch.clamp(last + 1, min=0, max=k_len)
    rows = torch.arange(batch, dtype=torch.int32, device=q.device)
    cu_q = torch.cat([torch.stack([rows * q_len, (rows + 1) * q_len], dim=1).flatten(), (rows[-1:] + 1) * q_len])
    cu_k = torch.cat([torch.stack([rows * k_len, rows * k_len + valid], dim=1).flatten(), (rows[-1:] + 1) * k_len])
    packed = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    out = flash_attn_varlen_func(*packed, cu_q, cu_k, q_len, k_len, **options)
    return out.view(batch, q_len, *out.shape[1:])


def _packed_sequences(q, k, kwargs):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) when the batch is packed sequences, else None:
    given by transformers' flash kwargs (a data collator's cu_seq_lens_*, max_length_*), or read from position_ids
    (one row whose positions restart where a sequence starts), as transformers' flash attention does."""
    given = [kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    if all(x is not None for x in given):
        return tuple(given)
    positions = kwargs.get("position_ids")
    if positions is None or q.shape[0] != 1 or q.shape[1] != k.shape[1] or q.shape[1] < 2:
        return None
    positions = positions.reshape(-1)
    starts = (positions == positions.min()).nonzero().flatten().to(torch.int32)
    if starts.numel() == 1 and int(starts[0]) == 0:
        return None
    ends = torch.tensor([q.shape[1]], dtype=torch.int32, device=starts.device)
    cu = torch.cat([torch.zeros_like(ends), starts, ends]).unique()  # a leading run before the first restart counts
    longest = int(cu.diff().max())
    return cu, cu, longest, longest


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over these kernels, for registering under a name of one's own:

        AttentionInterface.register("tpu_flash", kernel.attention_forward)
        AttentionMaskInterface.register("tpu_flash", ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])

    (the mask function is required: without one transformers passes no padding mask, which is refused here).
    query [B, Hq, S, D], key / value [B, Hkv, Sk, D / Dv] -> ([B, S, Hq, Dv], None). A padded batch (2-D mask)
    runs as packed sequences; so do keys longer than the queries without a mask (a static cache: each row's keys up
    to its last position in position_ids); packed sequences (transformers' cu_seq_lens_* / max_length_* kwargs, or
    position_ids that restart in a batch of one) through flash_attn_varlen_func; otherwise flash_attn_func.
    is_causal defaults to module.is_causal; sliding_window counts the current key, as transformers' masks do; s_aux:
    the sinks. Differentiable in query, key, value and s_aux. (`attn_implementation="kernels-community/tpu-kernels"`
    does not use this function: transformers wraps flash_attn_varlen_func / flash_attn_func itself.)
    """
    _check_flash_mask_registered(module)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    options = {
        "dropout_p": dropout,
        "softmax_scale": scaling,
        "causal": bool(module.is_causal if is_causal is None else is_causal),
        "window_size": _window(sliding_window),
        "softcap": 0.0 if softcap is None else softcap,
        "s_aux": s_aux,
    }
    if attention_mask is not None:
        return _padded_attention(q, k, v, attention_mask, options), None
    if k.shape[1] > q.shape[1] and kwargs.get("position_ids") is not None:
        return _cache_prefix_attention(q, k, v, kwargs["position_ids"], options), None
    packed = _packed_sequences(q, k, kwargs)
    if packed is None:
        return flash_attn_func(q, k, v, **options), None
    rows = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    out = flash_attn_varlen_func(*rows, *packed, **options)
    return out.view(*q.shape[:2], *out.shape[1:]), None
