"""The paged KV cache write: write_kv_cache (new tokens' K/V to their slots, in place) and rope_and_write_kv_cache
(RoPE of Q and K from positions fused with the write) against XLA's scatter on the cache and, for the fused op, XLA's
scatter after our standalone rotary kernel (apply_rotary_from_positions).

Shapes (benchmarks/shapes.py, KV_CACHE): the attention layers of Qwen3-30B-A3B (32 q / 4 kv heads x 128, rope theta
1e6), Gemma 4's sliding (16 / 8 x 256, theta 1e4) and full layers (16 / 2 x 512, theta 1e6, "proportional" rope with
a quarter of the head rotated); new tokens in bf16; caches [pages, 16, kv heads, head dim] in bf16 or
float8_e4m3fn (k_scale = v_scale = 0.5) with KV_CACHE_SLOTS rows. decode: `tokens` sequences of one new token each,
at distinct random slots and random positions < 32768; prefill: one chunk of 2048 tokens filling 128 shuffled pages
in order (positions 0..2047).

In place, as a server runs it: on a TPU every implementation is measured on caches it is given, donated, each call's
caches the next call's (`IN_PLACE`, suite.InPlace), and the performance model compiles the same functions with the
caches donated (a cache not donated is copied whole before an in-place write, by the kernel's aliasing and by XLA's
scatter alike). The op's own functions allocate their caches themselves (`jax.lax.empty`: XLA's AllocateBuffer, no
fill) and write into them; on the v5e such programs cost a whole-cache copy the donated ones do not (XLA moved the
kernel's result cache to another memory space, copy-start / copy-done of the 16 MiB cache), which made the kernel's
decode writes measure 0.03-1.07x XLA's scatter there.

Roofline: the new rows read (K, V and for RoPE Q, bf16) + the rows written to the cache (cache dtype) + Q written
back + slots / positions (int32), at the table HBM bandwidth.

Implementations (compiled in the same run, modeled on one TensorCore):
- kernel: tpu_kernels_jax.kv_cache.api.write_kv_cache / rope_and_write_kv_cache (default blocks).
- default, write: XLA, `cache.at[slots].set(rows)` (fp8: rows * (1 / scale), clipped to +-448, cast first).
- default, rope + write: the whole unfused path in XLA (transformers' cos/sin from positions, the rotary reference,
  the scatter).
- "our rope + XLA scatter" (baseline, the target's): our rotary kernel (apply_rotary_from_positions on q and k,
  layout bshd) then XLA's scatter: the unfused path with our own standalone RoPE. Modeled only (on a CPU the harness
  times the default without interpret mode, so the default must be plain XLA).

Target, on the modeled v6e figures: the fused write + RoPE >= 2x XLA's scatter plus our standalone rope at every
shape.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tpu_kernels_jax.kv_cache import api
from tpu_kernels_jax.rotary import api as rotary_api
from tpu_kernels_jax.rotary import reference as rotary_reference

from .. import inputs, shapes
from ..suite import BASELINE_PREFIX, Baseline, InPlace, Op, Suite, Targets
from .rotary import ROPE

BF16 = jnp.bfloat16
FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_SCALE = 0.5
FP8_MAX = float(jnp.finfo(FP8).max)
PAGE = shapes.KV_CACHE_PAGE
SLOTS = shapes.KV_CACHE_SLOTS
MAX_POSITION = 32768

MIN_FUSED_SPEEDUP = 2.0
OUR_ROPE = "our rope + XLA scatter"  # the target's baseline (modeled only: it holds a Pallas kernel, and a CPU times
# only the kernel column in interpret mode)
GOAL = f"the fused write + RoPE >= {MIN_FUSED_SPEEDUP}x XLA's scatter plus our standalone rope at every shape"


@dataclasses.dataclass(frozen=True)
class Config:
    model: str
    kv_heads: int
    head_dim: int
    cache_dtype: str

    @property
    def fp8(self) -> bool:
        return jnp.dtype(self.cache_dtype) == FP8

    @property
    def scale(self):
        return FP8_SCALE if self.fp8 else None


def config(s) -> Config:
    return Config(s["model"], s["kv_heads"], s["head_dim"], s.dtype)


def _caches(cfg: Config):
    """The caches, allocated in the program (no fill), where no caches are given (see the module docstring)."""
    shape = (SLOTS // PAGE, PAGE, cfg.kv_heads, cfg.head_dim)
    return jax.lax.empty(shape, jnp.dtype(cfg.cache_dtype)), jax.lax.empty(shape, jnp.dtype(cfg.cache_dtype))


# ------------------------------------------------------------------------------------------------ implementations
# Each implementation is written once over the caches it is given (`..._into`: the caches first, returned first, what
# a TPU measures in place with the caches donated, `IN_PLACE`, and the performance model compiles with them donated),
# and once over caches the program allocates (a CPU run's).
def kernel_write_into(k_cache, v_cache, key, value, slots, *, cfg: Config, blocks=None):
    return api.write_kv_cache(k_cache, v_cache, key, value, slots, k_scale=cfg.scale, v_scale=cfg.scale, blocks=blocks)


def kernel_write(key, value, slots, *, cfg: Config, blocks=None):
    return kernel_write_into(*_caches(cfg), key, value, slots, cfg=cfg, blocks=blocks)


def _stored(rows, cfg: Config):
    if not cfg.fp8:
        return rows
    return jnp.clip(rows.astype(jnp.float32) * (1.0 / cfg.scale), -FP8_MAX, FP8_MAX).astype(FP8)


def _scatter(k_cache, v_cache, key, value, slots, cfg: Config):
    """XLA's scatter of the rows into the flat caches (slot = row), in place."""
    flat = lambda c: c.reshape((SLOTS,) + c.shape[2:])  # noqa: E731
    k = flat(k_cache).at[slots].set(_stored(key, cfg), mode="drop")
    v = flat(v_cache).at[slots].set(_stored(value, cfg), mode="drop")
    return k.reshape(k_cache.shape), v.reshape(v_cache.shape)


def xla_write_into(k_cache, v_cache, key, value, slots, *, cfg: Config):
    return _scatter(k_cache, v_cache, key, value, slots, cfg)


def xla_write(key, value, slots, *, cfg: Config):
    return xla_write_into(*_caches(cfg), key, value, slots, cfg=cfg)


def kernel_rope_write_into(k_cache, v_cache, query, key, value, slots, positions, *, cfg: Config, blocks=None):
    q, k_cache, v_cache = api.rope_and_write_kv_cache(
        query,
        key,
        value,
        k_cache,
        v_cache,
        slots,
        positions,
        k_scale=cfg.scale,
        v_scale=cfg.scale,
        blocks=blocks,
        **ROPE[cfg.model],
    )
    return k_cache, v_cache, q


def kernel_rope_write(query, key, value, slots, positions, *, cfg: Config, blocks=None):
    k_cache, v_cache, q = kernel_rope_write_into(
        *_caches(cfg), query, key, value, slots, positions, cfg=cfg, blocks=blocks
    )
    return q, k_cache, v_cache


def our_rope_then_scatter_into(k_cache, v_cache, query, key, value, slots, positions, *, cfg: Config):
    """Our standalone rotary kernel on q and k (layout bshd, one sequence of T tokens), then XLA's scatter."""
    q, k = rotary_api.apply_rotary_from_positions(
        query[None], key[None], positions[None], layout="bshd", **ROPE[cfg.model]
    )
    k_cache, v_cache = _scatter(k_cache, v_cache, k[0], value, slots, cfg)
    return k_cache, v_cache, q[0]


def our_rope_then_scatter(query, key, value, slots, positions, *, cfg: Config):
    k_cache, v_cache, q = our_rope_then_scatter_into(*_caches(cfg), query, key, value, slots, positions, cfg=cfg)
    return q, k_cache, v_cache


def xla_rope_then_scatter_into(k_cache, v_cache, query, key, value, slots, positions, *, cfg: Config):
    """transformers' path in XLA: cos/sin from positions (rounded to bf16), the rotation, then the scatter."""
    cos, sin = rotary_api.rope_cos_sin(positions[None], head_dim=query.shape[-1], **ROPE[cfg.model])
    cos, sin = cos.astype(query.dtype), sin.astype(query.dtype)
    q, k = rotary_reference.apply_rotary_reference(query[None], key[None], cos, sin, layout="bshd")
    k_cache, v_cache = _scatter(k_cache, v_cache, k[0], value, slots, cfg)
    return k_cache, v_cache, q[0]


def xla_rope_then_scatter(query, key, value, slots, positions, *, cfg: Config):
    k_cache, v_cache, q = xla_rope_then_scatter_into(*_caches(cfg), query, key, value, slots, positions, cfg=cfg)
    return q, k_cache, v_cache


def cache_state(s, seed: int = 0):
    """The caches a TPU measures the writes in place on: random values (never zeros), made on the device."""
    cfg = config(s)
    shape = (SLOTS // PAGE, PAGE, cfg.kv_heads, cfg.head_dim)
    k_key, v_key = inputs.keys(seed + 101, 2)
    dtype = jnp.dtype(cfg.cache_dtype)
    made = (inputs.normal(k, shape, BF16) for k in (k_key, v_key))
    return tuple(_stored(c, cfg) if cfg.fp8 else c.astype(dtype) for c in made)


WRITE_IN_PLACE = InPlace({"kernel": kernel_write_into, "default": xla_write_into}, cache_state, 2)
ROPE_IN_PLACE = InPlace(
    {
        "kernel": kernel_rope_write_into,
        "default": xla_rope_then_scatter_into,
        BASELINE_PREFIX + OUR_ROPE: our_rope_then_scatter_into,
    },
    cache_state,
    2,
)


# ------------------------------------------------------------------------------------------------- shapes, bytes
def _rows(s, heads):
    return jax.ShapeDtypeStruct((s["tokens"], heads, s["head_dim"]), BF16)


def _int(s):
    return jax.ShapeDtypeStruct((s["tokens"],), jnp.int32)


def write_specs(s):
    return (_rows(s, s["kv_heads"]), _rows(s, s["kv_heads"]), _int(s))


def rope_specs(s):
    return (_rows(s, s["q_heads"]), _rows(s, s["kv_heads"]), _rows(s, s["kv_heads"]), _int(s), _int(s))


def _slots_positions(s, seed=0):
    """Concrete slots (decode: distinct random slots; prefill: 128 shuffled pages filled in order) and positions."""
    rng = np.random.default_rng(seed)
    t = s["tokens"]
    if s["phase"] == "decode":
        slots = rng.choice(SLOTS, t, replace=False)
        positions = rng.integers(0, MAX_POSITION, t)
    else:
        pages = rng.permutation(SLOTS // PAGE)[: -(-t // PAGE)]
        slots = (pages[:, None] * PAGE + np.arange(PAGE)[None]).reshape(-1)[:t]
        positions = np.arange(t)
    return jnp.asarray(slots.astype(np.int32)), jnp.asarray(positions.astype(np.int32))


def _normals(specs, seed):
    """Random values of each spec, made on the device (benchmarks/inputs.py)."""
    return tuple(inputs.normal(k, spec.shape, spec.dtype) for k, spec in zip(inputs.keys(seed, len(specs)), specs))


def write_args(s, seed=0):
    """Random new K/V rows (made on the device); the slots from the host."""
    key, value, _ = write_specs(s)
    slots, _ = _slots_positions(s, seed)
    return (*_normals((key, value), seed), slots)


def write_model_args(s):
    key, value, _ = write_specs(s)
    return (key, value, _slots_positions(s)[0])


def rope_args(s, seed=0):
    """Random new Q/K/V rows (made on the device); the slots and positions from the host."""
    query, key, value, _, _ = rope_specs(s)
    return (*_normals((query, key, value), seed), *_slots_positions(s, seed))


def rope_model_args(s):
    return (*rope_specs(s)[:3], *_slots_positions(s))


def write_bytes(s) -> int:
    """K and V read (bf16) and written (cache dtype), slots read."""
    t, rows = s["tokens"], s["kv_heads"] * s["head_dim"]
    return 2 * t * rows * (2 + jnp.dtype(s.dtype).itemsize) + 4 * t


def rope_bytes(s) -> int:
    """write_bytes + Q read and written (bf16) + positions."""
    return write_bytes(s) + 2 * s["tokens"] * s["q_heads"] * s["head_dim"] * 2 + 4 * s["tokens"]


# ------------------------------------------------------------------------------------------------------ targets
def custom_targets(rows: list[dict]) -> list[dict]:
    sel = [r for r in rows if r["op"] == "rope_and_write_kv_cache"]
    if not sel:
        return []

    def speedup(r):
        return r["speedups"].get(OUR_ROPE)

    worst = min(sel, key=lambda r: -1.0 if speedup(r) is None else speedup(r))
    short = [r for r in sel if speedup(r) is None or speedup(r) < MIN_FUSED_SPEEDUP]
    detail = "no modeled time" if speedup(worst) is None else f"{speedup(worst):.2f}x"
    if short:
        detail += f"; {len(short)} of {len(sel)} shapes short"
        kernels = worst["modeled_kernel"].get("kernels") or []
        if kernels:
            k = max(kernels, key=lambda k: k["us"])
            detail += (
                f"; kernel {k['us']:.1f} µs: {k['bound']}-bound, compute {k['compute_us']:.1f} µs vs DMA "
                f"{k['hbm_us']:.1f} µs, grid {k['grid']}"
            )
    return [
        {
            "target": f"rope_and_write_kv_cache: >= {MIN_FUSED_SPEEDUP}x XLA's scatter + our standalone rope at every "
            "shape",
            "met": not short,
            "worst": {"case": worst["case"]},
            "detail": detail,
        }
    ]


# -------------------------------------------------------------------------------------------------------- suite
def _static(s):
    return {"cfg": config(s)}


SUITE = Suite(
    kernel="kv_cache",
    ops=(
        Op(
            name="write_kv_cache",
            kernel=kernel_write,
            default=xla_write,
            specs=write_specs,
            model_args=write_model_args,
            arrays=write_args,
            hbm_bytes=write_bytes,
            default_name="XLA scatter",
            static=_static,
            in_place=WRITE_IN_PLACE,
        ),
        Op(
            name="rope_and_write_kv_cache",
            kernel=kernel_rope_write,
            default=xla_rope_then_scatter,
            specs=rope_specs,
            model_args=rope_model_args,
            arrays=rope_args,
            hbm_bytes=rope_bytes,
            default_name="XLA rope + scatter",
            baselines=(Baseline(OUR_ROPE, our_rope_then_scatter),),
            static=_static,
            in_place=ROPE_IN_PLACE,
        ),
    ),
    shapes=shapes.KV_CACHE,
    quick_shapes=shapes.KV_CACHE_QUICK,
    targets=Targets(goal=GOAL, custom=custom_targets),
    batch_unit="tokens",
)
