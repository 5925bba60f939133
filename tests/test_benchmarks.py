"""The benchmark harness end to end on one tiny shape: pytest-benchmark timing, the performance model for kernel and
default, roofline, targets, table, JSON and PNG, and the labels (a CPU interpret timing is never a TPU figure;
modeled figures say "modeled <gen>")."""

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
