"""Shared by the ragged dot and MoE suites: random top-k routing, byte/flop counts, baselines (XLA's ragged dot,
tokamax's, JAX's megablox gmm), targets.

Routing: each token picks `top_k` distinct experts uniformly at random (numpy, fixed seed) — not balanced by
construction, so group sizes vary (and at small batches most experts get no rows) as in real decode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tpu_kernels_jax.ragged_dot import reference as ragged_dot_reference

SEED = 0
BF16 = jnp.bfloat16
# lax.ragged_dot_general dimension numbers for rhs [G, N, K] (transformers' [E, out, in]), contracting K.
TRANS_RHS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)
TOKAMAX_MIN_DIM = 128  # tokamax's Mosaic TPU ragged dot needs every non-group dimension >= 128
MEGABLOX_TILING = (128, 128, 128)  # megablox.gmm's default (tm, tk, tn)


# ----------------------------------------------------------------------------------------------------- routing


def tokens_of(shape) -> int:
    """Tokens of a shape: the decode batch, or prefill rows / top_k."""
    return shape.batch if shape.batch_name == "tokens" else max(1, shape.batch // shape["top_k"])


def rows_of(shape) -> int:
    return tokens_of(shape) * shape["top_k"]


@functools.cache
def routing(tokens: int, experts: int, top_k: int, seed: int = SEED):
    """(top_k_index int32 [T, k], top_k_weights float32 [T, k] renormalised): uniform random distinct experts."""
    rng = np.random.default_rng(seed)
    index = np.empty((tokens, top_k), np.int32)
    for start in range(0, tokens, 4096):  # argsort of uniform keys = a uniform random permutation per row
        stop = min(tokens, start + 4096)
        index[start:stop] = np.argsort(rng.random((stop - start, experts)), axis=1)[:, :top_k]
    weights = rng.random((tokens, top_k)).astype(np.float32) + 0.1
    weights /= weights.sum(axis=1, keepdims=True)
    index.setflags(write=False)
    weights.setflags(write=False)
    return index, weights


def routing_of(shape):
    return routing(tokens_of(shape), shape["experts"], shape["top_k"])


@functools.cache
def _group_sizes(tokens: int, experts: int, top_k: int) -> np.ndarray:
    index, _ = routing(tokens, experts, top_k)
    sizes = np.bincount(index.reshape(-1), minlength=experts).astype(np.int32)
    sizes.setflags(write=False)
    return sizes


def group_sizes_of(shape) -> np.ndarray:
    return _group_sizes(tokens_of(shape), shape["experts"], shape["top_k"])


def experts_touched(shape) -> int:
    return int((group_sizes_of(shape) > 0).sum())


# ------------------------------------------------------------------------------------------- baselines (pieces)


def xla_ragged_dot(lhs, rhs, group_sizes, *, out_dtype):
    """XLA's ragged dot on rhs [G, N, K] (f32 accumulation)."""
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, TRANS_RHS, preferred_element_type=out_dtype)


def tokamax_ragged_dot(lhs, rhs, group_sizes, *, out_dtype):
    """tokamax's Pallas Mosaic TPU ragged dot on rhs [G, N, K] (imported lazily: benchmarks-only dependency)."""
    from absl import flags  # tokamax reads absl flags; never let absl parse the benchmark's own command line

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    import tokamax

    return tokamax.ragged_dot_general(
        lhs, rhs, group_sizes, TRANS_RHS, preferred_element_type=out_dtype, implementation="mosaic"
    )


def megablox_ragged_dot(lhs, rhs, group_sizes, *, out_dtype):
    """JAX's Pallas grouped matmul (jax.experimental.pallas.ops.tpu.megablox.gmm: MaxText's MoE kernel) on rhs
    [G, N, K] (`transpose_rhs`), at its default tiling (MEGABLOX_TILING), the row tile capped at M (its rows must be a
    multiple of the row tile; a tile of all M rows is the whole dimension)."""
    from jax.experimental.pallas.ops.tpu import megablox

    m = lhs.shape[0]
    tm, tk, tn = MEGABLOX_TILING
    return megablox.gmm(
        lhs, rhs, group_sizes, preferred_element_type=out_dtype, tiling=(min(tm, m), tk, tn), transpose_rhs=True
    )


def megablox_unsupported(shape) -> str | None:
    """Why megablox's gmm does not apply to a shape (None when it does)."""
    m, tm = rows_of(shape), MEGABLOX_TILING[0]
    if m > tm and m % tm:
        return f"megablox.gmm needs M (tokens x top_k = {m}) a multiple of its row tile {tm}"
    return None


def gated_epilogue(h, activation, out_dtype, gate_layout="concatenated"):
    """act(gate) * up (or a ClampedSwiGLU) on the f32 [M, 2I] gate/up product, gate and up concatenated or
    interleaved, in XLA."""
    if gate_layout == "interleaved":
        gate, up = h[:, 0::2], h[:, 1::2]
    else:
        gate, up = h[:, : h.shape[1] // 2], h[:, h.shape[1] // 2 :]
    return ragged_dot_reference.gating_reference(gate, up, activation).astype(out_dtype)


def tokamax_unsupported(shape) -> str | None:
    """Why tokamax's ragged dot does not apply to a shape (None when it does)."""
    if rows_of(shape) < TOKAMAX_MIN_DIM:
        return (
            f"tokamax's Mosaic TPU ragged dot needs every non-group dimension >= {TOKAMAX_MIN_DIM} "
            f"(M = tokens x top_k < {TOKAMAX_MIN_DIM})"
        )
    return None


def tokamax_available() -> str | None:
    try:
        import tokamax  # noqa: F401
    except ImportError as e:
        return f"tokamax not installed ({e}); it is in the `bench` extra of pyproject.toml"
    return None


# --------------------------------------------------------------------------------------------------- targets

DECODE_MAX_BATCH = 64
DECODE_MIN_EFFICIENCY = 0.85
PREFILL_MIN_MXU = 0.70
GOAL = (
    f"decode (B <= {DECODE_MAX_BATCH}) >= {DECODE_MIN_EFFICIENCY:.0%} of the HBM roofline, prefill >= "
    f"{PREFILL_MIN_MXU:.0%} of MXU peak, at least as fast as XLA's ragged_dot and tokamax"
)


def _case(row):
    return row["case"]


def custom_targets(rows: list[dict], *, baselines=("tokamax",)) -> list[dict]:
    """The MoE targets: decode (B <= 64) >= 85 % of the roofline (HBM: the expert weights touched); prefill >= 70 %
    of MXU peak; at least as fast as XLA's ragged dot (the default; checked by Targets.beats_default) and tokamax."""
    out = []
    decode = [r for r in rows if r["shape"].get("phase") == "decode" and r["batch"] <= DECODE_MAX_BATCH]
    if decode:
        worst = min(decode, key=lambda r: r["efficiency"] if r["efficiency"] is not None else -1.0)
        eff = worst["efficiency"]
        ok = eff is not None and eff >= DECODE_MIN_EFFICIENCY
        need = None if eff is None else worst["roofline"]["us"] / DECODE_MIN_EFFICIENCY
        detail = (
            "no modeled time"
            if eff is None
            else f"efficiency {eff:.1%}"
            + (
                ""
                if ok
                else f", {DECODE_MIN_EFFICIENCY - eff:.1%} points short: modeled "
                f"{worst['modeled_kernel']['us']:,.1f} µs vs <= {need:,.1f} µs needed"
            )
        )
        n_short = sum(1 for r in decode if (r["efficiency"] or 0) < DECODE_MIN_EFFICIENCY)
        if n_short:
            detail += f"; {n_short} of {len(decode)} decode shapes short"
        out.append(
            {
                "target": f"decode (B <= {DECODE_MAX_BATCH}) >= {DECODE_MIN_EFFICIENCY:.0%} of the HBM roofline "
                "(expert weights touched + activations)",
                "met": ok,
                "worst": {"case": _case(worst)},
                "detail": detail,
            }
        )
    prefill = [r for r in rows if r["shape"].get("phase") == "prefill"]
    if prefill:
        worst = min(prefill, key=lambda r: r["mxu_fraction"] if r["mxu_fraction"] is not None else -1.0)
        frac = worst["mxu_fraction"]
        ok = frac is not None and frac >= PREFILL_MIN_MXU
        cap = None  # an HBM-bound shape: the MXU is at most (flops / peak) / (HBM bytes / bandwidth) busy
        if frac is not None and worst["roofline"]["bound"] == "hbm":
            cap = frac * worst["modeled_kernel"]["us"] / worst["roofline"]["us"]
        detail = "no modeled time" if frac is None else f"MXU {frac:.1%} of peak"
        if frac is not None and not ok:
            detail += f", {PREFILL_MIN_MXU - frac:.1%} points short"
            if cap is not None:
                detail += (
                    f" (HBM-bound shape: even at the HBM roofline the MXU would be at most {cap:.1%} busy; "
                    f"its efficiency vs the roofline is {worst['efficiency']:.1%})"
                )
        compute_bound = [r for r in prefill if r["roofline"]["bound"] == "compute"]
        if compute_bound:
            w2 = min(compute_bound, key=lambda r: r["mxu_fraction"] or -1.0)
            detail += f"; compute-bound prefill shapes: worst MXU {w2['mxu_fraction'] or 0:.1%} ({_case(w2)})"
        out.append(
            {
                "target": f"prefill >= {PREFILL_MIN_MXU:.0%} of MXU peak",
                "met": ok,
                "worst": {"case": _case(worst)},
                "detail": detail,
            }
        )
    for name in baselines:
        comparable = [r for r in rows if name in r.get("speedups", {})]
        if not comparable:
            continue
        worst = min(comparable, key=lambda r: r["speedups"][name])
        s = worst["speedups"][name]
        slower = sum(1 for r in comparable if r["speedups"][name] < 1.0)
        detail = f"speedup {s:.2f}x" + (f"; slower at {slower} of {len(comparable)} shapes" if slower else "")
        out.append(
            {
                "target": f"at least as fast as {name} wherever it applies",
                "met": s >= 1.0,
                "worst": {"case": _case(worst)},
                "detail": detail,
            }
        )
    return out
