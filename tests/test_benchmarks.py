"""The benchmark harness end to end on one tiny shape: pytest-benchmark timing, the performance model for kernel and
default, roofline, targets, table, JSON and PNG, and the labels (a CPU interpret timing is never a TPU figure;
modeled figures say "modeled <gen>")."""

import functools
import json
import types

import numpy as np
import pytest

from benchmarks import device, harness, report, shapes, suite

TINY = shapes.Shape("tokens", 8, (("hidden", 256),), "bfloat16")


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    config = harness.Config(gen="v6e", out=out)
    result = harness.run_kernel("rms_norm", config, dev=device.detect(), shapes=[TINY])
    return result, out, report.write_json(result, out), report.write_chart(result, out)


def test_runs_end_to_end_and_writes_json_and_png(tiny_result):
    result, out, json_path, png_path = tiny_result
    assert json_path == out / "rms_norm.json" and png_path == out / "rms_norm.png"
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(json_path.read_text())
    assert data["kernel"] == "rms_norm" and data["generation"] == "v6e"
    assert [r["op"] for r in data["rows"]] == ["rms_norm", "fused_add_rms_norm"]
    for row in data["rows"]:
        assert row["shape"] == {"tokens": 8, "hidden": 256, "dtype": "bfloat16"}
        assert row["modeled_kernel"]["us"] > 0 and row["modeled_default"]["us"] > 0
        assert row["modeled_kernel"]["kernels"], "the kernel path holds no Pallas kernel"
        assert "kernels" not in row["modeled_default"], "the default path must be plain XLA"
        assert row["roofline"]["us"] == pytest.approx(row["hbm_bytes"] / data["chip"]["hbm_bytes_per_s"] * 1e6)
        assert row["efficiency"] == pytest.approx(row["roofline"]["us"] / row["modeled_kernel"]["us"])
        assert row["speedup"] == pytest.approx(row["modeled_default"]["us"] / row["modeled_kernel"]["us"])
        assert row["measured"]["kernel"]["us"] > 0 and row["measured"]["default"]["us"] > 0  # pytest-benchmark ran
    assert (out / "rms_norm.pytest-benchmark.json").exists()
    # Targets are named by what they ask, in the JSON and the table: the goal line, then each target.
    from benchmarks.ops import rms_norm

    assert data["goal"] == rms_norm.SUITE.targets.goal and "4096 tokens" in data["goal"]
    assert all(set(t) >= {"target", "met", "worst"} for t in data["targets"]) and len(data["targets"]) == 2
    table = report.format_table(result)
    assert f"goal (modeled v6e): {data['goal']}" in table
    assert "issue" not in json_path.read_text().lower() + table.lower()


def test_labels(tiny_result):
    result, *_ = tiny_result
    assert result["modeled_label"] == "modeled v6e" and result["roofline_label"] == "roofline v6e"
    for row in result["rows"]:
        assert row["modeled_kernel"]["label"] == row["modeled_default"]["label"] == "modeled v6e"
        assert row["roofline"]["label"] == "roofline v6e"
    table = report.format_table(result)
    assert "modeled v6e µs kernel" in table and "modeled v6e µs default" in table
    assert "TFLOP/s" not in table  # a memory-bound kernel's table: no flops columns (flops_columns off)
    if result["device"]["platform"] != "tpu":  # this machine: CPU interpret timings, never shown as TPU figures
        assert result["measured_label"] == device.CPU_INTERPRET
        for row in result["rows"]:
            assert row["measured"]["kernel"]["label"] == "cpu interpret"
            assert row["measured"]["default"]["label"] == "cpu XLA"
        assert "| cpu interpret µs |" in table.replace("  ", " ") or "cpu interpret µs" in table
        assert "TPU" not in report.columns(result)[1]
        assert "not a TPU figure" in table


def test_device_labels(monkeypatch):
    import jax

    fake = lambda platform, kind: [types.SimpleNamespace(platform=platform, device_kind=kind)]  # noqa: E731
    monkeypatch.setattr(jax, "devices", lambda *a: fake("tpu", "TPU v6 lite"))
    tpu = device.detect()
    assert tpu.kernel_label == "measured TPU v6 lite" and tpu.is_tpu and tpu.times(1 << 40, full=False)
    monkeypatch.setattr(jax, "devices", lambda *a: fake("cpu", "cpu"))
    cpu = device.detect()
    assert cpu.kernel_label == "cpu interpret" and not cpu.is_tpu
    assert "TPU" not in cpu.kernel_label + cpu.default_label
    assert cpu.times(64 * 4096 * 2 * 2, full=False) and not cpu.times(32768 * 4096 * 2 * 2, full=True)


def test_cpu_rows_outside_the_timed_sizes_show_a_dash():
    cpu = device.Device("cpu", "cpu", device.CPU_INTERPRET, device.CPU_XLA)
    big = [c for c in suite.get("rms_norm").cases() if not cpu.times(c.op.hbm_bytes(c.shape), full=False)]
    assert big and all(c.shape.batch >= 512 for c in big)
    row = {
        "op": "rms_norm",
        "case": "x",
        "shape": {"tokens": 32768, "hidden": 4096, "dtype": "bfloat16"},
        "batch": 32768,
        "measured": None,
        "roofline": {"us": 1.0},
        "efficiency": 0.5,
        "speedup": 2.0,
        "modeled_kernel": {"label": "modeled v6e", "us": 2.0, "gbps": 1.0},
        "modeled_default": {"us": 4.0},
    }
    result = {
        "kernel": "rms_norm",
        "generation": "v6e",
        "measured_label": "cpu interpret",
        "rows": [row],
        "targets": [],
        "device": cpu.as_dict(),
        "notes": [],
        "modeled_label": "modeled v6e",
    }
    ((_, (cells,)),) = report.table_rows(result)
    assert cells[1] == report.DASH


def test_shapes_are_declared_once():
    import test_rms_norm

    assert tuple(test_rms_norm.BENCH_TOKENS) == shapes.RMS_NORM_TOKENS == (1, 8, 64, 512, 4096, 32768)
    assert tuple(test_rms_norm.BENCH_HIDDENS) == shapes.RMS_NORM_HIDDENS == (2048, 4096)
    assert {(s["tokens"], s["hidden"]) for s in suite.get("rms_norm").shapes} == {
        (t, h) for t in shapes.RMS_NORM_TOKENS for h in shapes.RMS_NORM_HIDDENS
    }
    assert all(s.batch * s["top_k"] for s in shapes.RAGGED_DOT)


TINY_MOE = shapes.Shape(
    "tokens",
    8,
    (
        ("phase", "decode"),
        ("model", "tiny"),
        ("experts", 8),
        ("top_k", 2),
        ("hidden", 256),
        ("intermediate", 128),
        ("activation", "silu"),
    ),
    "bfloat16",
)


@pytest.fixture(scope="module")
def tiny_moe_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_moe")
    result = harness.run_kernel("moe", harness.Config(gen="v6e", out=out), dev=device.detect(), shapes=[TINY_MOE])
    return result, out, report.write_json(result, out), report.write_chart(result, out)


def test_moe_end_to_end_on_a_tiny_shape(tiny_moe_result):
    """experts_forward vs the XLA ragged_dot composition (default), tokamax (n/a: too few rows) and the dense masked
    MoE, on 8 tokens routed top-2 over 8 experts: modeled, roofline over the experts touched, targets, table."""
    result, out, json_path, png_path = tiny_moe_result
    assert png_path.exists() and json.loads(json_path.read_text())["kernel"] == "moe"
    (row,) = result["rows"]
    assert row["op"] == "experts_forward" and row["default_name"] == "XLA ragged_dot"
    assert row["modeled_kernel"]["us"] > 0 and row["modeled_kernel"]["kernels"], "no Pallas kernel modeled"
    assert row["modeled_default"]["us"] > 0
    dense, tokamax = row["modeled_baselines"]["dense masked"], row["modeled_baselines"]["tokamax"]
    assert dense["us"] > 0 and "kernels" not in dense, "the dense masked MoE is plain XLA"
    assert "na" in tokamax and ">= 128" in tokamax["na"]
    assert row["speedups"]["dense masked"] == pytest.approx(dense["us"] / row["modeled_kernel"]["us"])
    from benchmarks.ops import _moe

    touched = _moe.experts_touched(TINY_MOE)
    assert 2 <= touched <= 8
    assert row["hbm_bytes"] == touched * 3 * 128 * 256 * 2 + 2 * 8 * 256 * 2 + 8 * 2 * 8
    assert row["mxu_flops"] == 2 * 16 * 256 * 3 * 128
    assert row["measured"]["kernel"]["label"] == device.CPU_INTERPRET or device.detect().is_tpu
    targets = {t["target"]: t for t in result["targets"]}
    assert any(t.startswith("decode (B <= 64)") for t in targets)
    assert any("XLA" in t or "default" in t for t in targets)
    assert result["goal"] == _moe.GOAL
    table = report.format_table(result)
    assert "modeled v6e µs XLA ragged_dot" in table and "modeled v6e µs dense masked" in table
    assert "| n/a |" in table.replace("  ", " ") or " n/a " in table
    assert "MET" in table


def test_moe_routing_is_random_not_balanced():
    from benchmarks.ops import _moe

    index, weights = _moe.routing(64, 128, 8)
    assert index.shape == (64, 8) and all(len(set(r)) == 8 for r in index.tolist())  # distinct experts per token
    assert np.allclose(weights.sum(axis=1), 1.0)
    sizes = np.bincount(index.reshape(-1), minlength=128)
    assert sizes.sum() == 512 and sizes.max() > sizes.min() + 2  # not balanced by construction
    assert (_moe.routing(64, 128, 8)[0] == index).all()  # fixed seed


def test_moe_shapes():
    assert {s["model"] for s in shapes.MOE} == {"qwen3-30b-a3b", "gemma4-26b-a4b"}
    assert sorted({s.batch for s in shapes.MOE if s["phase"] == "decode"}) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert sorted({s.batch for s in shapes.MOE if s["phase"] == "prefill"}) == [4096, 32768]
    prefill = [s for s in shapes.RAGGED_DOT if s["phase"] == "prefill"]
    assert sorted({s.batch for s in prefill}) == [4096, 32768, 131072] and all(s.batch_name == "rows" for s in prefill)
    assert set(shapes.RAGGED_DOT_QUICK) <= set(shapes.RAGGED_DOT) and set(shapes.MOE_QUICK) <= set(shapes.MOE)


def test_moe_quantized_rows():
    """int8 / fp8 expert weights at the decode batches of the target (B <= 64): specs in the Shape's dtype with f32
    scales, a roofline of one-byte weights plus their scales, the table's small-batch path."""
    from benchmarks.ops import moe

    quantized = [s for s in shapes.MOE if s.dtype != "bfloat16"]
    assert {s.dtype for s in quantized} == {"int8", "float8_e4m3fn"}
    assert all(s["phase"] == "decode" and s.batch <= 64 for s in quantized) and {s.batch for s in quantized} >= {1, 64}
    op = moe.SUITE.ops[0]
    for s in quantized:
        bf16 = next(b for b in shapes.MOE if b.dtype == "bfloat16" and b.series == s.series and b.batch == s.batch)
        specs = op.specs(s)
        assert [str(x.dtype) for x in specs[3:]] == [s.dtype, s.dtype, "float32", "float32"]
        touched = moe._moe.experts_touched(s) * 4 * (2 * s["intermediate"] + s["hidden"])  # the scales' bytes
        assert (
            op.hbm_bytes(s) - touched
            == op.hbm_bytes(bf16) - moe._moe.experts_touched(s) * 3 * s["intermediate"] * s["hidden"]
        )
        assert op.impls(s)["baseline:tokamax"] is not None


# One tiny rotary shape: decode, 8 sequences of one token, Qwen3's rope parameters at few heads.
TINY_ROTARY = shapes.Shape(
    "tokens",
    8,
    (
        ("model", "qwen3-30b-a3b"),
        ("phase", "decode"),
        ("q_heads", 4),
        ("kv_heads", 2),
        ("head_dim", 128),
        ("rotary_dim", 128),
    ),
    "bfloat16",
)


def test_rotary_suite_end_to_end(tmp_path):
    from benchmarks.ops import rotary

    result = harness.run_kernel(
        "rotary", harness.Config(gen="v6e", out=tmp_path), dev=device.detect(), shapes=[TINY_ROTARY]
    )
    assert [r["op"] for r in result["rows"]] == ["apply_rotary", "rms_norm_rope", "rms_norm_rope_from_positions"]
    for row in result["rows"]:
        assert row["modeled_kernel"]["us"] > 0 and row["modeled_default"]["us"] > 0
        assert row["modeled_kernel"]["kernels"], "the kernel path holds no Pallas kernel"
        assert "kernels" not in row["modeled_default"], "the default path must be plain XLA"
        assert row["speedup"] == pytest.approx(row["modeled_default"]["us"] / row["modeled_kernel"]["us"])
        assert row["measured"]["kernel"]["us"] > 0 and row["measured"]["default"]["us"] > 0
    # q and k in and out, plus the per-token tables (cos and sin) or positions, plus the norm weights
    qk = 2 * 8 * (4 + 2) * 128 * 2
    assert [r["hbm_bytes"] for r in result["rows"]] == [
        qk + 2 * 8 * 128 * 2,
        qk + 2 * 8 * 128 * 2 + 2 * 128 * 2,
        qk + 8 * 4 + 2 * 128 * 2,
    ]
    # No shape of >= 64 tokens here: only the fused-vs-unfused target applies (the efficiency one is not checked).
    (target,) = result["targets"]
    assert result["goal"] == rotary.GOAL and "1.5x the unfused XLA path" in target["target"]
    fused = [r for r in result["rows"] if r["op"] in rotary.FUSED_OPS]
    assert target["met"] == (min(r["speedup"] for r in fused) >= 1.5)
    table = report.format_table(result)
    assert "rotary / rms_norm_rope" in table and ("MET (" in table or "NOT MET" in table)


def test_rotary_quick_shapes_are_a_subset():
    from benchmarks.ops import rotary

    quick = rotary.SUITE.quick_shapes
    assert set(quick) < set(shapes.ROTARY) == set(rotary.SUITE.shapes)
    assert {s.batch for s in quick if s["phase"] == "decode"} == {1, 64, 256}
    assert {s.batch for s in quick if s["phase"] == "prefill"} == {2048}
    assert {s["model"] for s in quick} == {"qwen3-30b-a3b", "gemma4-sliding"} and len(quick) == 7


def test_dense_masked_baseline_equals_the_reference():
    """The MoE suite's dense masked baseline (vectorised over experts) computes kernels/moe/reference.py's function."""
    import jax.numpy as jnp

    from benchmarks.ops import moe
    from tpu_kernels_jax.moe import reference as moe_reference

    args = moe._arrays(TINY_MOE, 0)
    got = moe.dense_masked_experts(*args, activation="silu")
    want = moe_reference.experts_forward_reference(*args, activation="silu")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    assert jnp.abs(want.astype(jnp.float32)).max() > 0


SWEEP_SHAPE = shapes.Shape("tokens", 256, (("hidden", 256),), "bfloat16")


def test_sweep_reports_the_tables_choice_and_the_best_candidate(tmp_path):
    """--sweep on one small RMSNorm shape: every candidate tiling modeled, the table's choice (first) beside the
    fastest, which is never slower; the choice, passed as blocks=, models as the benchmark's kernel column (no
    blocks=) does; JSON written and every figure labeled modeled."""
    from benchmarks import sweep

    result = sweep.run_sweep("rms_norm", ["v6e"], shapes=[SWEEP_SHAPE])
    assert result["modeled_labels"] == ["modeled v6e"] and not result["missing"]
    rows = {r["op"]: r for r in result["rows"]}
    assert set(rows) == {"rms_norm", "fused_add_rms_norm"}
    for row in rows.values():
        assert row["label"] == "modeled v6e" and len(row["candidates"]) >= 2, row
        assert row["candidates"][0]["table_choice"] and row["choice"]["label"] == row["candidates"][0]["label"]
        assert all("us" in c for c in row["candidates"]), row["candidates"]
        assert row["best"]["us"] == min(c["us"] for c in row["candidates"]) <= row["choice"]["us"]
        assert row["gain"] == pytest.approx(row["choice"]["us"] / row["best"]["us"]) and row["gain"] >= 1.0
    table = sweep.format_sweep(result)
    assert "sweep rms_norm / rms_norm — modeled v6e" in table and "table's choice" in table
    for row in rows.values():
        assert row["choice"]["label"] in table and f"{row['gain']:.3f}x" in table
    path = sweep.write_sweep_json(result, tmp_path)
    assert json.loads(path.read_text())["rows"][0]["candidates"]
    bench = harness.run_kernel(
        "rms_norm", harness.Config(gen="v6e", out=tmp_path, measure=False), dev=device.detect(), shapes=[SWEEP_SHAPE]
    )
    for bench_row in bench["rows"]:
        assert rows[bench_row["op"]]["choice"]["us"] == pytest.approx(bench_row["modeled_kernel"]["us"], rel=1e-9)


# ------------------------------------------------------------------------------------- paged attention, KV cache
def test_paged_attention_shapes():
    full, quick = shapes.PAGED_ATTENTION, shapes.PAGED_ATTENTION_QUICK
    decode = [s for s in full if s["phase"] == "decode"]
    assert sorted({s.batch for s in decode}) == [1, 8, 32, 64, 128, 256]
    assert {s["context"] for s in full} == {1024, 4096, 32768} and {s["page"] for s in full} == {16, 32, 64, 128, 256}
    assert {s.dtype for s in full} == {"bfloat16", "float8_e4m3fn"}
    assert {s["model"] for s in full} == {"qwen3-30b-a3b", "gemma4-sliding", "gemma4-full"}
    # every page size at context 4096 (fp8 at 16, 64, 256), every context at pages of 64
    assert {s["page"] for s in decode if s["context"] == 4096 and s.dtype == "bfloat16"} == {16, 32, 64, 128, 256}
    assert {(s["context"], s["page"]) for s in decode if s["context"] != 4096} == {(1024, 64), (32768, 64)}
    assert len(full) == 3 * (6 * 5 + 6 * 3 + 6 * 2 + 3 + 1) == len(set(full)) and set(quick) < set(full)
    mixed = [s for s in full if s["phase"] == "mixed"]
    assert all(s.batch_name == "tokens" and s.batch == 60 + 4 * 512 for s in mixed)
    assert {s.batch for s in shapes.KV_CACHE} == {1, 8, 64, 256, 2048} and set(shapes.KV_CACHE_QUICK) < set(
        shapes.KV_CACHE
    )


def _paged_config(**kw):
    from benchmarks.ops import paged_attention

    base = dict(
        q_lens=(1, 1, 7, 1, 16),
        contexts=(40, 17, 64, 33, 30),
        page_size=16,
        pages_per_seq=4,
        num_pages=24,
        q_heads=4,
        kv_heads=2,
        head_dim=128,
        scale=None,
        window=-1,
        cache_dtype="bfloat16",
    )
    return paged_attention.Config(**dict(base, **kw))


@pytest.mark.parametrize(
    "options",
    [{}, {"window": 20, "cache_dtype": "float8_e4m3fn", "scale": 1.0}],
    ids=["causal", "window_fp8"],
)
def test_paged_xla_path_equals_the_reference(rand, options):
    """The paged attention suite's XLA path (gather, then attention; windowed gathers from a start page) computes the
    kernel's reference on a ragged batch of shuffled pages; JAX's reference reads the interleaved layout the same.
    The window and the fp8 cache are independent steps of the path (which pages are gathered; how they are
    dequantized), checked together in one case; the causal bf16 case checks the path with neither."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa_kernel

    from benchmarks.ops import paged_attention

    cfg = _paged_config(**options)
    n = len(cfg.q_lens)
    dtype = jnp.dtype(cfg.cache_dtype)
    k = rand.normal((cfg.num_pages, cfg.page_size, cfg.kv_heads, cfg.head_dim)).astype(dtype)
    v = rand.normal((cfg.num_pages, cfg.page_size, cfg.kv_heads, cfg.head_dim)).astype(dtype)
    q = rand.normal((cfg.tokens, cfg.q_heads, cfg.head_dim), jnp.bfloat16)
    pages = jnp.asarray(rand.rng.permutation(cfg.num_pages)[: n * cfg.pages_per_seq].reshape(n, -1), jnp.int32)
    kv_lens = jnp.asarray(cfg.contexts, jnp.int32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(cfg.q_lens)]), jnp.int32)
    num_seqs = jnp.asarray([n], jnp.int32)
    caches = {"flash": (k, v)}
    # jitted as the suite compiles it: one XLA:CPU program instead of every op of it compiled on its own
    xla_attention = jax.jit(functools.partial(paged_attention.xla_attention, cfg=cfg))
    got = xla_attention(q, caches, kv_lens, pages, cu, num_seqs)
    want = paged_attention.reference_attention(q, k, v, kv_lens, pages, cu, cfg=cfg)
    assert got.shape == want.shape and bool(jnp.isfinite(got.astype(jnp.float32)).all())
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=3e-2)
    if not options:
        return
    # JAX's reference (eager, op by op: its loop over sequences needs concrete lengths) once, with the window and the
    # fp8 scales it takes too: the interleaved layout it reads is the same whatever the options.
    jax_ref = rpa_kernel.ref_ragged_paged_attention(
        q,
        paged_attention.to_interleaved(k, v),
        kv_lens,
        pages,
        cu,
        num_seqs,
        sm_scale=cfg.softmax_scale,
        sliding_window=cfg.window if cfg.window > 0 else None,
        k_scale=cfg.kv_scale,
        v_scale=cfg.kv_scale,
    )
    np.testing.assert_allclose(np.asarray(jax_ref, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=3e-2)


def test_paged_roofline_bytes_and_pool():
    """Roofline bytes: each sequence's context (or its window's keys) of K and V, plus q and out; the page pool is
    capped (sequences then share pages) and the tables name pages inside it."""
    from benchmarks.ops import paged_attention

    qwen = next(s for s in shapes.PAGED_ATTENTION_QUICK if s["model"] == "qwen3-30b-a3b" and s.batch == 8)
    assert paged_attention.hbm_bytes(qwen) == 8 * 4096 * 2 * 4 * 128 * 2 + 2 * 8 * 32 * 128 * 2
    sliding = next(s for s in shapes.PAGED_ATTENTION if s["model"] == "gemma4-sliding" and s["phase"] == "mixed")
    cfg = paged_attention.config(sliding)
    assert paged_attention.keys_read(cfg) == 60 * 1024 + 4 * min(sliding["context"], 512 + 1023)
    big = max(shapes.PAGED_ATTENTION, key=lambda s: s.batch * s["context"] * s["kv_heads"] * s["head_dim"])
    cfg = paged_attention.config(big)
    assert cfg.num_pages * cfg.page_size * 2 * cfg.kv_heads * cfg.head_dim * 2 <= paged_attention.CACHE_POOL_BYTES
    _, pages, cu, num_seqs = paged_attention._metadata(cfg)
    assert int(pages.max()) < cfg.num_pages and int(cu[-1]) == cfg.tokens and int(num_seqs[0]) == len(cfg.q_lens)


def test_kv_cache_xla_paths_write_the_named_slots(rand):
    """The KV cache suite's baselines: XLA's scatter stores exactly the rows the kernel's reference stores (fp8:
    quantised alike), and the rope + scatter paths (our rotary kernel, XLA's rotation) agree on q and the written K."""
    import jax.numpy as jnp

    from benchmarks.ops import kv_cache
    from tpu_kernels_jax.kv_cache import reference

    s = next(s for s in shapes.KV_CACHE if s["model"] == "qwen3-30b-a3b" and s.batch == 8 and s.dtype != "bfloat16")
    cfg = kv_cache.config(s)
    query = rand.normal((8, s["q_heads"], s["head_dim"]), jnp.bfloat16)
    key, value = (rand.normal((8, s["kv_heads"], s["head_dim"]), jnp.bfloat16) for _ in range(2))
    slots, positions = kv_cache._slots_positions(s, seed=rand.seed)
    k_cache, v_cache = kv_cache.xla_write(key, value, slots, cfg=cfg)
    flat = lambda c: np.asarray(c.reshape((-1,) + c.shape[2:])[slots].astype(jnp.float32))  # noqa: E731
    for cache, rows in ((k_cache, key), (v_cache, value)):
        want = reference.quantize_reference(rows, cache.dtype, kv_cache.FP8_SCALE).astype(jnp.float32)
        np.testing.assert_array_equal(flat(cache), np.asarray(want))
    q1, k1, _ = kv_cache.our_rope_then_scatter(query, key, value, slots, positions, cfg=cfg)
    q2, k2, _ = kv_cache.xla_rope_then_scatter(query, key, value, slots, positions, cfg=cfg)
    assert not np.allclose(np.asarray(q1, np.float32), np.asarray(query, np.float32), atol=1e-2)  # rotated
    np.testing.assert_allclose(np.asarray(q1, np.float32), np.asarray(q2, np.float32), atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(flat(k1), flat(k2), atol=0.6, rtol=0.13)  # one fp8 step apart at most


def test_kv_cache_in_place_writes_keep_the_rest_of_the_given_caches(rand):
    """What a TPU measures in place (kv_cache.IN_PLACE: the caches given, donated call to call): XLA's write into
    random caches changes the named slots alone and agrees with the allocating path there; the kernel's does the
    same (interpret mode) and the rope paths return their q last. The state is random, never zeros."""
    import jax
    import jax.numpy as jnp
    import ladder

    from benchmarks.ops import kv_cache

    s = next(s for s in shapes.KV_CACHE if s["model"] == "qwen3-30b-a3b" and s.batch == 8 and s.dtype == "bfloat16")
    cfg = kv_cache.config(s)
    state = kv_cache.cache_state(s, seed=rand.seed)
    assert all(
        bool(jnp.all(jnp.isfinite(c.astype(jnp.float32)))) and float(jnp.std(c.astype(jnp.float32))) > 0.5
        for c in state
    )
    key, value, slots = kv_cache.write_args(s, seed=rand.seed)
    before = [np.asarray(c.astype(jnp.float32)) for c in state]
    written = {}
    for impl, fn in kv_cache.WRITE_IN_PLACE.functions.items():
        run = jax.jit(functools.partial(fn, cfg=cfg))
        written[impl] = (
            ladder.run_kernel(run, *state, key, value, slots) if impl == "kernel" else run(*state, key, value, slots)
        )
    flat = lambda c: np.asarray(c.astype(jnp.float32)).reshape((-1,) + c.shape[2:])  # noqa: E731
    untouched = np.ones(kv_cache.SLOTS, bool)
    untouched[np.asarray(slots)] = False
    for impl, caches in written.items():
        for cache, old, rows in zip(caches, before, (key, value)):
            np.testing.assert_array_equal(flat(cache)[untouched], old.reshape(flat(cache).shape)[untouched], impl)
            np.testing.assert_array_equal(flat(cache)[np.asarray(slots)], np.asarray(rows.astype(jnp.float32)), impl)
    query, key, value, slots, positions = kv_cache.rope_args(s, seed=rand.seed)
    k_cache, v_cache, q = kv_cache.xla_rope_then_scatter_into(*state, query, key, value, slots, positions, cfg=cfg)
    q_alloc, _, _ = kv_cache.xla_rope_then_scatter(query, key, value, slots, positions, cfg=cfg)
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(q_alloc, np.float32))
    assert set(kv_cache.ROPE_IN_PLACE.functions) == {"kernel", "default", "baseline:" + kv_cache.OUR_ROPE}


def test_flash_attention_table_and_chart_count_tflops(monkeypatch, tmp_path):
    """The flash attention suite's table adds TFLOP/s and % of MXU peak (the kept scores' flops, as the roofline
    counts them, over the modeled kernel time) and its chart plots TFLOP/s against the sequence length, the bf16 MXU
    peak as a line: the harness end to end on stand-in modeled times (random fractions of peak; nothing compiled)."""
    import matplotlib.figure

    from benchmarks import perf_model
    from benchmarks.ops import flash_attention

    chip = perf_model.get_chip("v6e")
    # Gemma 4 sliding (window 1024, causal): neither JAX's flash attention nor tokamax applies, splash does
    sliding = [
        s
        for s in flash_attention.SUITE.shapes
        if s["model"] == "gemma4-sliding" and s["layout"] == "dense" and s.batch in (1024, 4096)
    ]
    # the flops count the kept scores only: a causal window of 1024 keys over 32 sequences of 1024, brute force
    cfg = flash_attention.config(sliding[0])
    rows, cols = np.indices((1024, 1024))
    assert cfg.window == (1023, 0) and len(cfg.lengths) == 32
    assert flash_attention.kept_scores(cfg) == 32 * int(((cols <= rows) & (cols >= rows - 1023)).sum())
    rng = np.random.default_rng()
    cases = flash_attention.SUITE.cases(tuple(sliding))
    fraction = {c.id: float(rng.uniform(0.2, 0.8)) for c in cases}

    def model(us):
        return types.SimpleNamespace(label="modeled v6e", modeled_us=us, warnings=(), notes=(), xla_ops=(), kernels=())

    models = {}
    for c in cases:
        kernel_us = c.op.mxu_flops(c.shape) / chip.bf16_flops_per_s / fraction[c.id] * 1e6
        for impl, times in (("kernel", 1.0), ("default", 5.0), ("baseline:splash", 2.0)):
            models[(c.id, impl)] = model(kernel_us * times)
    monkeypatch.setattr(harness.modeled, "run", lambda cases, gen, **_: models)
    result = harness.run_kernel(
        "flash_attention", harness.Config(gen="v6e", out=tmp_path, measure=False), dev=device.detect(), shapes=sliding
    )
    assert result["flops_columns"]
    table = report.format_table(result)
    peak = chip.bf16_flops_per_s / 1e12
    for op, cells_list in report.table_rows(result):
        head = report.columns(result, [r for r in result["rows"] if r["op"] == op])
        tflops, mxu = head.index("TFLOP/s modeled v6e"), head.index("% MXU peak modeled v6e")
        assert head[tflops - 1] == "efficiency" and head[mxu + 1] == "modeled v6e µs XLA attention"
        for row, cells in zip([r for r in result["rows"] if r["op"] == op], cells_list):
            assert float(cells[tflops].replace(",", "")) == pytest.approx(fraction[row["case"]] * peak, abs=0.06)
            assert cells[mxu] == f"{fraction[row['case']]:.1%}"
    assert f"bf16 MXU peak ({peak:.0f} TFLOP/s)" in table

    drawn = []
    save = matplotlib.figure.Figure.savefig

    def record(fig, *args, **kwargs):
        drawn.extend(fig.axes)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    png = report.write_chart(result, tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [ax.get_xlabel() for ax in drawn] == ["seq", "seq"] and "TFLOP/s (modeled v6e" in drawn[0].get_ylabel()
    for ax, op in zip(drawn, ("forward", "backward")):
        lines = {line.get_label(): line for line in ax.get_lines()}
        kernel = next(line for label, line in lines.items() if label.startswith("kernel"))
        expected = [fraction[f"{op} {s.id}"] * peak for s in sliding]
        np.testing.assert_allclose(kernel.get_ydata(), expected, rtol=1e-9)
        assert lines["bf16 MXU peak, v6e"].get_ydata()[0] == pytest.approx(peak)


def test_tokamax_configs_past_its_data_head_dims_are_scaled_from_entries_that_fit_v6e():
    """tokamax's attention baseline takes the config its TPU7x autotuning chose for the nearest entry. Head dim 512 is
    past its data (256): the config is scaled from an entry no longer than TOKAMAX_SCALED_MAX_SEQ. The longer entries'
    4096-wide tiles, even halved, ran out of v6e's scoped VMEM (36.7 of 32 MiB, the unmasked forward at seq 8192), so
    every longer benchmark sequence takes the seq-4096 config, whose compile the seq-4096 table proves. Within the
    data's head dims the nearest entry stands, long tiles included."""
    from benchmarks.ops import flash_attention as fa

    names = ("pallas_mosaic_tpu_flash_attention", "pallas_mosaic_tpu_flash_attention_vjp")
    longest = max(s.batch for s in fa.SUITE.shapes)
    assert fa.TOKAMAX_SCALED_MAX_SEQ == 4096 and longest > 4096
    for name in names:
        for causal in (True, False):
            at_4096 = fa._tokamax_best(name, 4096, 512, causal)
            for seq in (8192, longest):
                assert fa._tokamax_best(name, seq, 512, causal) == at_4096, (name, seq, causal)
    unmasked = fa._tokamax_best(names[0], 8192, 512, False)
    assert (unmasked["block_q"], unmasked["block_kv"]) == (1024, 2048)
    assert fa._tokamax_best(names[0], 8192, 256, False)["block_q"] == 4096  # in the data: its own tiles


@pytest.fixture
def stand_in_flash_forwards(monkeypatch):
    """(the flash attention benchmark module, a small shape) with every implementation's forward a stand-in whose one
    residual is tanh of q (nothing of the kernels compiled), over two sequences instead of the suite's 32768 tokens;
    the residual specs cached under them are dropped after the test."""
    import jax.numpy as jnp

    from benchmarks.ops import flash_attention as fa

    def plain(q, k, v, *cu, cfg):
        return jnp.tanh(q) * 2.0

    shape = min((s for s in fa.SUITE.shapes if s["model"] == "qwen3-30b-a3b"), key=lambda s: s.batch)
    monkeypatch.setattr(fa, "FORWARDS", dict.fromkeys(fa.FORWARDS, plain))
    monkeypatch.setattr(fa, "TOKENS", 2 * shape.batch)
    fa._residual_specs.cache_clear()
    yield fa, shape
    fa._residual_specs.cache_clear()


def test_flash_backward_inputs_name_the_implementations_whose_forward_fails(stand_in_flash_forwards):
    """The backward's inputs hold every implementation's residuals from its own forward; one forward that does not
    compile at the shape (splash and tokamax at head dim 512 ran out of the v5e's scoped VMEM) fails that
    implementation alone, with the reason, and leaves placeholders of its residuals' shapes for the other programs."""
    import jax.numpy as jnp

    fa, shape = stand_in_flash_forwards

    def refuses(q, k, v, *cu, cfg):
        raise RuntimeError("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: 17.2M of 16.0M")

    specs = fa.residual_specs(shape)
    assert set(specs) == {"kernel", "default", "jax_flash", "splash", "tokamax"}
    fa.FORWARDS["splash"] = refuses
    built = fa._arrays("backward", shape, seed=int(np.random.default_rng().integers(1 << 16)))
    assert isinstance(built, suite.PartialInputs)
    assert list(built.failed) == ["baseline:splash"]
    assert built.failed["baseline:splash"].startswith("its forward (for the residuals): RuntimeError: RESOURCE_EXH")
    *qkv, do, residuals = built.args
    for impl, given in residuals.items():  # every program's residuals in their specs' shapes
        assert [x.shape for x in given] == [x.shape for x in specs[impl]], impl
        nan = [bool(jnp.isnan(x).all()) for x in given]
        assert all(nan) if impl == "splash" else not any(nan), impl  # placeholders for splash alone
    assert float(jnp.abs(residuals["kernel"][0]).max()) > 0  # the others computed from q, k, v


def test_flash_backward_inputs_build_as_one_program_ahead_of_the_case(stand_in_flash_forwards):
    """A measured run compiles a case's input builder and programs ahead from the inputs' shapes (jax.eval_shape of
    the builder): the backward's builder traces as one program, its residuals in the specs' shapes and, run, each
    forward's own on the builder's q, k, v; one forward that fails makes the traced builder fail (the run then builds
    the inputs eagerly, where that implementation alone shows why)."""
    import jax

    fa, shape = stand_in_flash_forwards

    def refuses(q, k, v, *cu, cfg):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of HBM")

    seed = int(np.random.default_rng().integers(1 << 16))
    specs = fa.residual_specs(shape)
    traced = jax.eval_shape(lambda: fa._arrays("backward", shape, seed))
    built = jax.jit(lambda: fa._arrays("backward", shape, seed))()
    fa.FORWARDS["tokamax"] = refuses
    with pytest.raises(RuntimeError, match="out of HBM"):
        jax.eval_shape(lambda: fa._arrays("backward", shape, seed))
    assert {impl: [x.shape for x in given] for impl, given in traced[-1].items()} == {
        impl: [x.shape for x in given] for impl, given in specs.items()
    }
    q = np.float32(built[0])
    assert q.std() > 0.5  # random draws, not zeros
    for impl, given in built[-1].items():  # each forward's residual (tanh's output) from the builder's own q
        np.testing.assert_allclose(np.float32(given[0]), np.tanh(q), atol=2**-8, err_msg=impl)


def test_flash_backward_tilings_run_on_residuals_of_their_own_forward():
    """A backward tiling's inputs come from the forward at that tiling (Op.tiling_inputs): the residuals' layout follows
    the forward's kv heads a step (the output as it lies or merged, the lse by head group), so a tiling at another
    count is timed on what its own forward leaves, not on the table's (which its backward would lay out again; before
    the backward regrouped the lse, the sweep's Gemma 4 sliding tilings at 4 kv heads a step failed Mosaic's
    block-shape check on them on the v5e). Here such a tiling's inputs differ from the table's and lower for the v5e."""
    import jax

    from benchmarks import perf_model, sweep
    from benchmarks.ops import flash_attention as fa
    from tpu_kernels_jax.flash_attention.tuning import FlashAttentionBlocks

    op = next(o for o in fa.SUITE.ops if o.name == "backward")
    shape = next(s for s in fa.SUITE.quick_shapes if s["model"] == "gemma4-sliding")
    with jax.default_device(perf_model.trace_device("v5e")):
        assert op.candidates(shape, "v5e")[0].kv_heads_per_step == 8
        tiling = suite.Case(sweep.variant(op, 0, FlashAttentionBlocks(kv_heads_per_step=1)), shape)
        specs = tiling.op.model_args(shape)
        assert list(specs[-1]) == ["kernel"]  # the kernel's residuals alone
        table = fa.residual_specs(shape, ("kernel",))["kernel"]
        assert [x.shape for x in specs[-1]["kernel"]] != [x.shape for x in table]
        lowered = jax.jit(tiling.op.function("kernel", shape)).lower(*specs)
    assert "tpu_custom_call" in lowered.as_text()


def test_flash_benchmark_implementations_agree_with_sinks_and_a_window(monkeypatch):
    """Every implementation the flash attention suite times at gpt-oss's layers (a window, sinks: the kernel, XLA's
    attention and splash; JAX's flash attention and tokamax have no sinks) computes the same attention, so the
    measured columns compare like with like: small sizes in interpret mode, against the f32 reference."""
    import contextlib

    import jax
    import jax.numpy as jnp

    from benchmarks.ops import flash_attention as fa
    from tpu_kernels_jax.common.interpret import interpret_on_cpu
    from tpu_kernels_jax.flash_attention.reference import attention_reference

    cfg = fa.Config("dense", True, (31, 0), None, (128, 128), sinks=True)
    keys = jax.random.split(jax.random.key(int(np.random.default_rng().integers(1 << 30))), 3)
    q, k, v = (jax.random.normal(key, (2, 128, h, 64), jnp.bfloat16) for key, h in zip(keys, (8, 2, 2)))
    expected = attention_reference(q, k, v, causal=True, window_size=(31, 0), sinks=fa.sinks(8))
    without = attention_reference(q, k, v, causal=True, window_size=(31, 0))
    assert float(jnp.abs(expected.astype(jnp.float32) - without.astype(jnp.float32)).max()) > 0.1  # sinks show
    shape = next(s for s in fa.SUITE.shapes if s["model"] == "gpt-oss-sliding")
    assert fa.config(shape).sinks and fa._unsupported("splash", shape) is None
    assert fa._unsupported("jax_flash", shape) and fa._unsupported("tokamax", shape)
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    # splash through jax's generic Pallas interpreter (its kernels trip the TPU interpreter's grid semantics)
    make = splash.make_splash_mqa_single_device
    monkeypatch.setattr(splash, "make_splash_mqa_single_device", functools.partial(make, interpret=True))
    for impl in ("kernel", "default", "splash"):
        with interpret_on_cpu() if impl == "kernel" else contextlib.nullcontext():
            out = jax.jit(functools.partial(fa.FORWARDS[impl], cfg=cfg))(q, k, v)
        np.testing.assert_allclose(
            np.asarray(out, np.float32), np.asarray(expected, np.float32), atol=3e-2, rtol=3e-2, err_msg=impl
        )
