"""python -m benchmarks.decode: the CPU smoke end to end through the module's main (tiny random models, greedy tokens
of our experts_forward against transformers' default), the device mode's refusal without a TPU, and the modeled
composition's pieces that need no compile (the ring model, the busiest chip's routing, the HBM ceiling, the paged
attention's visit builder charged once a step), the deviceless compile that rule stands on (two layers, one builder),
and the performance model's whole-slice compile the composition is checked with (a sharded program for v6e:2x4)."""

import dataclasses
import importlib
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

decode_main = importlib.import_module("benchmarks.decode.__main__")
from benchmarks import perf_model  # noqa: E402
from benchmarks.decode import compose, models, programs, ring, smoke  # noqa: E402


def test_cpu_smoke_end_to_end(tmp_path):
    assert decode_main.main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "decode-cpu-smoke.json").read_text())
    markdown = (tmp_path / "decode-cpu-smoke.md").read_text()
    assert (tmp_path / "decode-cpu-smoke.png").stat().st_size > 0
    assert result["label"] == "cpu smoke, not a TPU figure" and "cpu smoke, not a TPU figure" in markdown
    assert len(result["models"]) == 2  # both architectures
    for name, model in result["models"].items():
        # on 2 CPU processes, each holding half of the tiny models' 8 experts (transformers' expert parallelism)
        assert (model["ranks"], model["experts_per_rank"]) == (smoke.RANKS, 8 // smoke.RANKS), name
        (series,) = model["series"]
        assert series["execution"] == "op by op", name
        rows = series["rows"]
        assert [r["batch"] for r in rows] == list(decode_main.SMOKE_BATCHES), name
        for row in rows:
            # every implementation generated the default's greedy tokens, under a static cache, on every rank
            # (device_mode.run_ranks raises otherwise)
            assert row["tokens_match"] is True, (name, row)
            assert row["new_tokens"] == decode_main.SMOKE_NEW_TOKENS
            impls = row["impls"]
            assert impls["default"]["experts_implementation"] != "tpu_ragged_dot"
            assert (
                impls["experts"]["experts_implementation"]
                == impls["ours"]["experts_implementation"]
                == "tpu_ragged_dot"
            )
            assert impls["default"]["attn_implementation"] == impls["experts"]["attn_implementation"] == "sdpa"
            assert impls["ours"]["attn_implementation"] == "kernels-community/tpu-kernels:flash_attn_varlen_func"
            assert impls["ours"]["kernelized"] == (["Qwen3MoeRMSNorm"] if name.startswith("qwen3") else []), name
            for impl in ("default", "experts", "ours"):
                assert np.isfinite(impls[impl]["ms"]) and impls[impl]["ms"] > 0
    assert markdown.count("| yes |") == 2 * len(decode_main.SMOKE_BATCHES)
    assert result["versions"]["transformers"] and result["versions"]["kernels"]


def _chip_smoke(base, kinds, *, context, steps, warmup, reference=False, **dims):
    """chip_step.measure on a tiny version of `base` (hidden 256, vocab 512, 8 experts, `dims` on top), batch 2,
    every layer of `kinds` once, its kernels in interpret mode."""
    from benchmarks.decode import chip_step
    from tpu_kernels_jax.common.interpret import interpret_on_cpu

    tiny = dataclasses.replace(base, hidden=256, vocab=512, experts=8, kinds=kinds, **dims)
    with interpret_on_cpu():
        return chip_step.measure(
            tiny, batch=2, context=context, steps=steps, warmup=warmup, layers=len(kinds), reference=reference
        )


def test_chip_step_smoke_gives_every_implementation_the_same_tokens(tmp_path):
    """The one-chip JAX decode step (benchmarks/decode/chip_step.py) at tiny dimensions of Gemma 4's layout (a sliding
    layer whose window the cache wraps around, a full layer with K = V, the dense MLP beside the experts), the kernels
    in interpret mode: the three implementations decode the same greedy tokens, and the table says so; the f32
    referee (XLA's path in f32) decodes them too. No TPU here: nothing is timed."""
    from benchmarks.decode import chip_step

    kinds = [k.name for k in chip_step.layer_kinds(models.GEMMA4, 7)]
    assert kinds == ["gemma4-sliding"] * 5 + ["gemma4-full", "gemma4-sliding"]  # five sliding, one full, again
    kinds = (
        models.LayerKind("gemma4-sliding", 1, 4, 2, 128, 256, False),
        models.LayerKind("gemma4-full", 1, 4, 1, 128, -1, True),
    )
    dims = dict(expert_intermediate=128, dense_intermediate=128)
    result = _chip_smoke(models.GEMMA4, kinds, context=300, steps=1, warmup=1, reference=True, **dims)
    assert result["timing"].startswith("not timed") and result["layers"] == 2
    assert set(result["impls"]) == set(chip_step.IMPLS) and "f32 referee" in result["host_s"]
    for impl in ("ours", "experts"):  # 300 + 2 positions: the sliding layer's 256-slot cache has wrapped
        check = result["tokens"][impl]
        assert (check["tokens"], check["equal"], check["swapped"], check["ok"]) == (4, 4, 0, True), check
        assert 0 <= check["top_logit_drift_max"] < 0.05, check
        assert check["equal_to_f32"] == check["xla_equal_to_f32"] == 4, check
    table = "\n".join(chip_step.markdown([result]))
    assert "all ours: 4/4 equal" in table and "| gemma4-26b-a4b | 2 | 300 | 2 of 2 |" in table


def test_chip_step_smoke_gpt_oss():
    """gpt-oss's step at tiny dimensions (a sliding layer of window 128 with sinks, biased projections, no per-head
    norm; MXFP4 experts laid out as at load, top-2 of 8, interleaved gate/up, the clamped SwiGLU): our MXFP4
    experts_forward in XLA's step decodes XLA's tokens; all ours decodes from the same weights (its bf16 rounding
    differs from XLA's through every op, so a near tie in a tiny random model may swap XLA's top two tokens, and
    nothing else)."""

    kinds = (models.LayerKind("gpt-oss-sliding", 1, 4, 2, 64, 128, False),)
    result = _chip_smoke(models.GPT_OSS, kinds, context=200, steps=1, warmup=0, top_k=2, expert_intermediate=256)
    experts, ours = result["tokens"]["experts"], result["tokens"]["ours"]
    assert experts["equal"] == experts["tokens"] == 2 and experts["ok"], experts
    assert ours["equal"] + ours["swapped"] == ours["tokens"] == 2, ours


def test_chip_step_token_check_tells_rounding_from_a_wrong_kernel():
    """compare_tokens on made-up picks: equal tokens pass; a few differing ones (XLA's top two swapped, or another
    token, as a router's flip gives) pass and are counted apart; a wrong kernel fails: unrelated tokens everywhere, or
    in one sequence only."""
    from benchmarks.decode import chip_step

    rng = np.random.default_rng()
    steps, batch = 8, 8
    ref = np.stack([rng.permutation(1000)[:2] for _ in range(steps * batch)]).reshape(steps, batch, 2)
    top = rng.uniform(50, 100, (steps, batch))
    ref_logits = np.stack([top, top - rng.uniform(0.01, 1, (steps, batch))], axis=-1)
    ours, ours_logits = ref.copy(), ref_logits * (1 + 1e-3)

    def check(picks):
        return chip_step.compare_tokens({"default": ref, "ours": picks}, {"default": ref_logits, "ours": ours_logits})

    same = check(ours)["ours"]
    assert (same["equal"], same["swapped"], same["worst_sequence_equal"], same["ok"]) == (64, 0, 8, True)
    assert abs(same["top_logit_drift_max"] - 1e-3) < 1e-6
    near = ours.copy()
    near[2, 5] = ref[2, 5, ::-1]  # XLA's top two swapped
    near[6, 1, 0] = 1000  # a token XLA ranked neither first nor second
    rounding = check(near)["ours"]
    gap = (ref_logits[2, 5, 0] - ref_logits[2, 5, 1]) / ref_logits[2, 5, 0]
    assert (rounding["equal"], rounding["swapped"], rounding["worst_sequence_equal"]) == (62, 1, 7)
    assert rounding["ok"] and rounding["widest_swapped_gap"] == pytest.approx(gap)
    assert "62/64 equal (worst sequence 7/8), 1 top-two swaps" in chip_step.token_summary(rounding)
    assert chip_step.token_summary(rounding).endswith("1 other")
    one_sequence = ours.copy()
    one_sequence[:, 4, 0] = 1000 + np.arange(steps)  # every token of sequence 4 wrong: 87.5 % equal overall
    wrong = check(one_sequence)["ours"]
    assert (wrong["equal"], wrong["worst_sequence_equal"], wrong["ok"]) == (56, 0, False)
    assert chip_step.token_summary(wrong).endswith("(FAILS)")
    unrelated = ours.copy()
    unrelated[..., 0] = rng.integers(1000, 2000, (steps, batch))
    assert check(unrelated)["ours"]["ok"] is False

    # with the f32 referee: where XLA's path itself misses the exact token (its rounding, a sequence's near ties), a
    # path that disagrees with XLA's there but is at least as near the referee passes; a wrong kernel still fails
    exact = ref.copy()
    exact[:, 4, 0] = 1000 + np.arange(steps)  # sequence 4's exact tokens: XLA's path got none of them
    refereed = {"default": ref_logits, "ours": ours_logits, chip_step.REFERENCE: ref_logits}
    near_exact = chip_step.compare_tokens({"default": ref, "ours": one_sequence, chip_step.REFERENCE: exact}, refereed)
    assert near_exact["ours"] | {"ok": None} == wrong | {"ok": None, "equal_to_f32": 64, "xla_equal_to_f32": 56}
    assert near_exact["ours"]["ok"] and "f32 referee's: 64 equal (XLA's path 56)" in chip_step.token_summary(
        near_exact["ours"]
    )
    away = chip_step.compare_tokens({"default": ref, "ours": unrelated, chip_step.REFERENCE: exact}, refereed)
    assert away["ours"]["ok"] is False and away["ours"]["equal_to_f32"] < away["ours"]["xla_equal_to_f32"]


def test_chip_step_keeps_going_past_a_step_that_fails(monkeypatch, tmp_path):
    """A step that does not fit or compile is reported with its reason and the others still run; the JSON is
    written after every step, so a run stopped midway keeps what it measured."""
    import json

    from benchmarks.decode import chip_step

    def measure(model, *, batch, context, steps, layers, kind, reference):
        if batch == 8:
            raise MemoryError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
        seen.append(json.loads((tmp_path / "decode_chip.json").read_text()))  # what a run stopped here leaves
        raise ValueError(f"stop at {batch}")

    seen = []

    monkeypatch.setattr(chip_step, "measure", measure)
    assert chip_step.main(["--model", "qwen3-30b-a3b", "--batch", "8", "--batch", "64", "--out", str(tmp_path)]) == 0
    assert [f["batch"] for f in seen[0]["failed"]] == [8]
    written = json.loads((tmp_path / "decode_chip.json").read_text())
    assert written["steps"] == [] and [f["batch"] for f in written["failed"]] == [8, 64]
    assert "MemoryError: RESOURCE_EXHAUSTED" in written["failed"][0]["error"]
    md = (tmp_path / "decode_chip.md").read_text()
    assert "failed: qwen3-30b-a3b at batch 8, context 4096: MemoryError: RESOURCE_EXHAUSTED" in md


@pytest.mark.parametrize("head_dim", [128, 64])
def test_chip_step_gives_every_implementation_the_same_cache_history(head_dim):
    """The paged caches of all ours hold the static caches' random history slot for slot (sequence b's slot s at
    page table[b, s // page], row s % page): the implementations attend over the same keys and values, so their
    tokens can be compared (drawn apart, all ours decoded other tokens than XLA's at 40-60 % of a batch). A head dim
    of 64 is kept padded to 128 with zeros (chip_step.cache_head_dim)."""
    from benchmarks.decode import chip_step

    kind = models.LayerKind("gemma4-sliding", 1, 4, 2, head_dim, 300, False)  # two pages, the second part padding
    seed = int(np.random.default_rng().integers(1 << 16))
    setups = {impl: chip_step.Setup(models.GEMMA4, (kind,), 3, 1000, 3, impl) for impl in ("default", "ours")}
    (static,), (paged,) = (chip_step.init_caches(setups[i], seed) for i in ("default", "ours"))
    k, v = (np.asarray(x, np.float32) for x in static)
    pk, pv, table = (np.asarray(x) for x in paged)
    slots = k.shape[2]
    assert slots == chip_step.cache_keys(kind, 1000, 3) == 300 and not np.isnan(k).any() and k.std() > 0.5
    assert k.shape[-1] == head_dim and pk.shape[-1] == pv.shape[-1] == 128
    s = np.arange(slots)
    for b in range(3):
        pages, rows = table[b, s // models.PAGE], s % models.PAGE
        np.testing.assert_array_equal(pk[pages, rows, :, :head_dim].astype(np.float32), k[b].transpose(1, 0, 2))
        np.testing.assert_array_equal(pv[pages, rows, :, :head_dim].astype(np.float32), v[b].transpose(1, 0, 2))
        assert not pk[pages, rows, :, head_dim:].any() and not pv[pages, rows, :, head_dim:].any()


def test_chip_step_fits_layers_to_the_budget():
    """As many layers as fit beside their caches and the XLA path's copy of their expert weights: Qwen3-30B-A3B's
    1.24 GB layers at batch 64, context 4096, 3 of 48 (the step compiles for the v5e at that count, both paths)."""
    from benchmarks.decode import chip_step

    layers = chip_step.fitting_layers(models.QWEN3, 64, 4096, 34)
    assert layers == 3
    experts = models.QWEN3.experts * models.QWEN3.expert_bytes()
    per_layer = chip_step._layer_weight_bytes(models.QWEN3, models.QWEN3.kinds[0]) + experts
    cache = 2 * 64 * (4096 + 256) * 4 * 128 * 2
    used = chip_step._embedding_bytes(models.QWEN3) + layers * (per_layer + cache)
    assert used <= chip_step.HBM_BUDGET_BYTES < used + per_layer + cache
    # context 32768: four layers at batch 1, one at 64; at 128 not one layer's caches fit, said before compiling
    assert chip_step.fitting_layers(models.QWEN3, 1, 32768, 34) == 4
    assert chip_step.fitting_layers(models.QWEN3, 64, 32768, 34) == 1
    with pytest.raises(ValueError, match=r"does not fit: .* batch 128, context 32768 take [\d.]+ GB"):
        chip_step.fitting_layers(models.QWEN3, 128, 32768, 34)


def test_chip_step_measures_every_layer_kind_of_a_cell():
    """A model of several layer kinds is measured as whole periods of its pattern where one fits (gpt-oss's sliding +
    full pair at batch 64, context 4096), else each kind alone (Gemma 4's five sliding layers and a full one: at most
    three layers fit): a few sliding layers scaled to the model would leave out its full layers' cache reads. The
    cell's whole step is the head plus each kind's per-layer time times its count, against the whole model's
    ceiling; a kind not measured leaves no whole-model figure."""
    from benchmarks.decode import chip_step

    g, o = models.GEMMA4, chip_step.GPT_OSS
    assert chip_step.cell_kinds(models.QWEN3, 64, 4096, 34) == [None]
    assert chip_step.cell_kinds(o, 64, 4096, 34) == [None]
    assert chip_step.cell_kinds(o, 128, 4096, 34) == ["gpt-oss-sliding", "gpt-oss-full"]
    assert chip_step.cell_kinds(g, 64, 4096, 34) == ["gemma4-sliding", "gemma4-full"]
    assert chip_step.represents_model(o, chip_step.layer_kinds(o, 2))
    assert not chip_step.represents_model(g, chip_step.layer_kinds(g, 3))
    with pytest.raises(ValueError, match="fewer than one period of its pattern"):  # before any weight is made
        chip_step.measure(g, batch=64, context=4096)
    with pytest.raises(ValueError, match=r"kind: expected one of \['gemma4-sliding', 'gemma4-full'\]"):
        chip_step.kind_view(g, "full")
    assert chip_step.fitting_layers(chip_step.kind_view(g, "gemma4-full"), 1, 4096, 34) == 3

    rng = np.random.default_rng()
    per_layer = {k.name: {i: rng.uniform(500, 3000) for i in chip_step.IMPLS} for k in g.kinds}
    head = {i: rng.uniform(1000, 2000) for i in chip_step.IMPLS}
    check = {"tokens": 34, "equal": 33, "swapped": 1, "widest_swapped_gap": 0.01, "top_logit_drift_max": 0.02}
    check |= {"worst_sequence_equal": 33, "steps": 34, "ok": True}

    def kind_result(kind, layers):
        impls = {}
        for i in chip_step.IMPLS:
            step = head[i] + layers * per_layer[kind][i]
            impls[i] = {"step_us": step, "head_us": head[i], "per_layer_us": per_layer[kind][i]}
        tokens = {i: dict(check) for i in ("ours", "experts")}
        return {
            "model": g.name,
            "batch": 64,
            "context": 4096,
            "kind": kind,
            "layers": layers,
            "impls": impls,
            "tokens": tokens,
            "device": "TPU v5 lite",
            "timing": "device time (profiler), median step",
        }

    sliding, full = kind_result("gemma4-sliding", 2), kind_result("gemma4-full", 1)
    (row,) = chip_step.compose_cells([sliding, full])
    ceiling = chip_step.ceiling_bytes(g, chip_step.layer_kinds(g, 30), 64, 4096) / chip_step.HBM_BANDWIDTH * 1e6
    for i in chip_step.IMPLS:
        whole = head[i] + 25 * per_layer["gemma4-sliding"][i] + 5 * per_layer["gemma4-full"][i]
        assert row["impls"][i]["model_step_us_scaled"] == pytest.approx(whole)
        assert row["impls"][i]["ceiling_fraction"] == pytest.approx(ceiling / whole)
    assert row["tokens"]["ours"]["tokens"] == 68 and row["tokens"]["ours"]["equal"] == 66
    table = "\n".join(chip_step.markdown([row]))
    assert "| gemma4-26b-a4b | 64 | 4096 | 2 gemma4-sliding / 1 gemma4-full of 30 |" in table
    assert f"{sliding['impls']['ours']['step_us']:,.1f} / {full['impls']['ours']['step_us']:,.1f}" in table
    assert len(chip_step.target_lines([row])) == 3 + 2  # the three targets, two token checks

    # the same cell from recorded points (decode_v5e.json's form), the sliding layers' XLA path at 4096 without its
    # head: not composable, so the sliding layers at context 1024 stand in (their caches hold the window: the same
    # program), and the row says so
    points = []
    for r in (sliding, full, dict(sliding, context=1024)):
        for i, m in r["impls"].items():
            point = {k: r[k] for k in ("model", "batch", "context", "kind", "layers")} | {"impl": i}
            points.append(point | {"step_us": m["step_us"], "head_us": m["head_us"], "device_kind": "TPU v5 lite"})
    points[0]["head_us"] = None  # the sliding layers' XLA path at 4096
    rows = chip_step.compose_cells(chip_step.results_from_points(points))
    (again,) = [r for r in rows if r["context"] == 4096]
    for i in chip_step.IMPLS:
        assert again["impls"][i]["model_step_us_scaled"] == pytest.approx(row["impls"][i]["model_step_us_scaled"])
    assert again["layers_label"] == "2 gemma4-sliding (at context 1024) / 1 gemma4-full of 30"
    rows = chip_step.compose_cells(chip_step.results_from_points(points[:6]))  # no stand-in: no whole figure
    assert rows[0]["layers_label"].endswith("(a head not timed apart)")
    assert "model_step_us_scaled" not in rows[0]["impls"]["ours"]

    (partial,) = chip_step.compose_cells([sliding])
    assert "(no gemma4-full measured)" in partial["layers_label"]
    # at 32768 tokens of context and batch 64 not one full layer fits the chip (its caches alone 8.6 GB): said so
    (unfit,) = chip_step.compose_cells([dict(sliding, context=32768)])
    assert unfit["layers_label"] == "2 gemma4-sliding of 30 (gemma4-full: one layer does not fit the chip)"
    assert all("model_step_us_scaled" not in m for m in partial["impls"].values())
    assert chip_step.target_lines([partial])[0].startswith("tokens, ")  # no target judged without a whole figure


def test_chip_step_ceiling_and_targets(tmp_path):
    """The step's HBM ceiling counts a layer's weights, the experts its batch touches and the keys it reads, plus
    lm_head; the targets at batch 64, context 4096 say met or the measured gap."""
    from benchmarks.decode import chip_step

    q = models.QWEN3
    (kind,) = q.kinds
    touched = q.experts * (1 - (1 - q.top_k / q.experts) ** 64)
    assert 120 < touched < 128  # batch 64, top-8 of 128: nearly every expert
    expected = q.vocab * q.hidden * 2 + q.dense_bytes_per_layer(kind) + touched * q.expert_bytes()
    expected += 64 * 4096 * kind.kv_bytes_per_token
    assert chip_step.ceiling_bytes(q, [kind], 64, 4096) == int(expected)
    impls = {
        "default": {"step_us": 3000.0, "model_step_us_scaled": 40000.0},
        "ours": {"step_us": 1000.0, "model_step_us_scaled": 16000.0, "ceiling_fraction": 0.75},
        "experts": {"step_us": 2000.0, "model_step_us_scaled": 30000.0},
    }
    result = {"model": q.name, "batch": 64, "context": 4096, "impls": impls}
    ours_8 = dict(impls["ours"], model_tokens_per_s_scaled=500.0)
    small = dict(result, batch=8, impls={k: dict(v, model_tokens_per_s_scaled=100.0) for k, v in impls.items()})
    small["impls"]["ours"] = ours_8
    big = dict(result, impls={k: dict(v, model_tokens_per_s_scaled=1000.0) for k, v in impls.items()})
    assert chip_step.chart([small, big], tmp_path / "chart.png") and (tmp_path / "chart.png").stat().st_size > 0
    lines = chip_step.target_lines([result, small])
    assert lines == [
        f"target, {q.name}: all ours >= 2.0x XLA's tokens/s: met (2.50x)",
        f"target, {q.name}: our experts_forward only >= 1.5x XLA's tokens/s: NOT MET (1.33x)",
        f"target, {q.name}: all ours >= 70% of the step's HBM ceiling: met (75.0%)",
    ]


def test_device_mode_without_a_tpu_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("TPU_KERNELS_BENCH_DEVICE", "cpu")
    with pytest.raises(SystemExit, match="--device: expected a TPU host"):
        decode_main.main(["--device", "--out", str(tmp_path)])


def test_device_mode_measures_a_build_of_this_checkout(monkeypatch):
    """On a TPU host "all ours" must run this checkout's kernels, not the published package's: the 8 workers are
    spawned with LOCAL_KERNELS naming a fresh build (spawned processes inherit the environment) and kernelize's layers
    from it. TorchTPU and the spawn are stand-ins here; the spawn records what the workers would get."""
    import types

    import torch
    import torch.multiprocessing as mp

    from benchmarks.decode import device_mode, generation

    monkeypatch.setenv("TPU_KERNELS_BENCH_DEVICE", "tpu")
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    for name, value in (("MASTER_ADDR", "localhost"), ("MASTER_PORT", "29511")):
        monkeypatch.setenv(name, value)  # restored afterwards: run() sets them for the workers
    launched = {}
    tpu = types.SimpleNamespace(
        device_count=lambda: device_mode.CHIPS,
        distributed=types.SimpleNamespace(set_tpu_launch_env=lambda nproc_per_node: launched.update(n=nproc_per_node)),
    )
    monkeypatch.setattr(torch, "tpu", tpu, raising=False)

    def spawn(worker, args, nprocs, join):
        options, out_dir = args
        build_dir = pathlib.Path(options["build_dir"])
        launched.update(nprocs=nprocs, env=os.environ.get("LOCAL_KERNELS"), build_dir=build_dir)
        assert (build_dir / "torch-tpu" / "metadata.json").is_file()  # the variant the TPU workers load
        layer = generation.local_layers(options["build_dir"])("RMSNorm")
        assert layer._repo_path == build_dir and layer.layer_name == "RMSNorm"
        assert worker is device_mode.worker and options["world_size"] == nprocs and options["device_type"] == "tpu"
        for rank in range(nprocs):
            rows = {m: {"series": []} for m, _ in options["models"]}
            (pathlib.Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(rows))

    monkeypatch.setattr(mp, "spawn", spawn)
    args = decode_main.parse_args(["--device", "--model", "qwen3-30b-a3b", "--batch", "8"])
    result = device_mode.run(args)
    assert launched["n"] == launched["nprocs"] == device_mode.CHIPS
    assert launched["env"] == f"{generation.HUB_REPO}={launched['build_dir'].parent}"
    assert "LOCAL_KERNELS" not in os.environ  # only while the workers run
    assert list(result["models"]) == ["qwen3-30b-a3b"] and generation.OURS_NOTE in result["notes"]


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--context", "-5"]])
def test_bad_arguments_name_themselves(argv, capsys):
    with pytest.raises(SystemExit):
        decode_main.parse_args(["--modeled", *argv])
    assert argv[0] in capsys.readouterr().err


def test_ring_all_reduce():
    message = 64 * 2048 * 2
    bandwidth_part = 14 * message / 16 / ring.LINK_BYTES_PER_S  # 2 (n - 1) steps of 1/(2n) of the message
    assert ring.all_reduce_s(message, 8, step_latency_s=0.0) == pytest.approx(bandwidth_part)
    assert ring.all_reduce_s(message, 8, step_latency_s=1e-6) == pytest.approx(bandwidth_part + 14e-6)
    assert ring.all_reduce_s(message, 1) == 0.0


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_busiest_chip_routing(batch):
    model = models.QWEN3
    chip, local, weights = programs.chip_routing(model, batch)
    index, _ = programs._moe.routing(batch, model.experts, model.top_k)
    assert local.shape == index.shape and weights.shape == index.shape
    mine = (index // model.local_experts) == chip
    np.testing.assert_array_equal(local[mine], index[mine] - chip * model.local_experts)
    assert (local[~mine] == model.local_experts).all()  # the sentinel
    touched = [len(np.unique(index[(index // model.local_experts) == c])) for c in range(models.CHIPS)]
    assert programs.experts_touched(model, batch) == max(touched)


def test_hbm_ceiling_matches_the_published_layouts_figure():
    # Qwen3-30B-A3B, batch 64, context 768, expert parallel with attention replicated: about 8.9 ms at 1.64 TB/s
    seconds = compose.ceiling_bytes(models.QWEN3, 64, 768) / 1.64e12
    assert seconds == pytest.approx(8.9e-3, rel=0.03)


def _sharded_matmul_sum(x, w):
    """x @ w with x replicated [T, K] and w's K rows split over "ep": each chip multiplies its columns of x by its rows
    of w, and the all-reduce sums the parts."""

    def body(x, w):
        rows = w.shape[0]
        mine = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index("ep") * rows, rows, axis=1)
        return jax.lax.psum((mine @ w).astype(jnp.float32), "ep")

    return jax.shard_map(body, in_specs=(jax.P(), jax.P("ep")), out_specs=jax.P())(x, w)


def test_sharded_program_compiles_for_a_whole_slice_as_the_per_chip_spmd_program():
    x = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
    (result,) = perf_model.compile_deviceless_many(
        [(_sharded_matmul_sum, (x, w), [(), ("ep",)])], "v6e", topology="v6e:2x4", mesh_axes=(("ep", 8),)
    )
    assert not isinstance(result, Exception), result
    hlo = result[0]["hlo"]
    assert "all-reduce" in hlo
    assert "bf16[128,512]" in hlo  # each chip's share of w (1024 / 8 rows), not the whole weight
    assert "bf16[1024,512]" not in hlo


def test_attention_charges_the_visit_builder_once_a_step_per_layer_kind():
    figures = {
        "ours": {"s": 10e-6, "kernel_s_by_name": {compose.VISITS_KERNEL: 2e-6, "paged_attention": 8e-6}},
        "xla": {"s": 7e-6},
    }
    assert compose._attention_s(figures, "ours", 48) == pytest.approx(48 * 8e-6 + 2e-6)
    assert compose._attention_s(figures, "xla", 48) == pytest.approx(48 * 7e-6)


def test_compiled_step_builds_the_visit_lists_once_for_every_layer():
    """The evidence the composition's rule stands on: two layers over the same traced metadata, compiled deviceless
    for v6e, keep one visit-list builder (XLA's CSE) feeding both layers' kernels."""
    from ladder import tpu_device, tpu_spec

    from benchmarks.ops import paged_attention as ops

    shape = programs.paged_shape(models.QWEN3.kinds[0], 8, 512)
    cfg = ops.config(shape)
    q, caches, *metadata = ops.specs(shape)

    def two_layers(q, k1, v1, k2, v2, *metadata):
        first = ops.kernel_attention(q, {"flash": (k1, v1)}, *metadata, cfg=cfg)
        return ops.kernel_attention(q + first, {"flash": (k2, v2)}, *metadata, cfg=cfg)

    k, v = caches["flash"]
    specs = [tpu_spec("v6e", x.shape, x.dtype) for x in (q, k, v, k, v, *metadata)]
    with jax.default_device(tpu_device("v6e")):
        lowered = jax.jit(two_layers).lower(*specs)
        optimized = lowered.compile().as_text()
    calls = [line for line in optimized.splitlines() if "custom-call(" in line and "tpu_custom_call" in line]
    assert lowered.as_text().count("tpu_custom_call") == 4  # as traced: a builder and a kernel per layer
    assert len(calls) == 3, calls
    assert sum(compose.VISITS_KERNEL in line for line in calls) == 1, calls


def test_chip_model_composes_the_measured_layers_as_the_v6e8_table_does():
    """The one-chip step modeled for the v5e (benchmarks/decode/chip_model.py) adds, for the layers measured (Gemma 4:
    seven layers are six sliding and one full), each kind's glue, KV write, attention and the one-chip experts,
    then the head once, with the variant of each part the implementation runs; measured / modeled per point and per
    implementation. Figures made up: no compile."""
    from benchmarks.decode import chip_model

    rng = np.random.default_rng()
    model = models.GEMMA4
    items = chip_model.items_for(model, 7, 64, 4096)
    figures = {key: {"s": float(rng.uniform(1e-5, 1e-3)), "kernel_s_by_name": {}} for key in items}
    kinds = {k.name: k for k in model.kinds}

    def f(part, kind, variant, context=0):
        return figures[(part, model.name, kind, 64, context, variant)]["s"]

    for impl, glue, attention, experts in [
        ("default", "default", "default", "default"),
        ("experts", "default", "default", "ours"),
        ("ours", "ours", "ours", "ours"),
    ]:
        parts = chip_model.modeled_step_s(model, 7, 64, 4096, impl, figures)
        expected = f("head", "", glue) + 7 * f("experts1", "", experts)
        for name, count in (("gemma4-sliding", 6), ("gemma4-full", 1)):
            assert name in kinds
            layer = f("glue", name, glue) + f("kv_write", name, "default") + f("attention", name, attention, 4096)
            expected += count * layer
        assert sum(parts.values()) == pytest.approx(expected), impl
    point = {"model": model.name, "batch": 64, "context": 4096, "layers": 7, "impl": "ours", "step_us": 5000.0}
    (row,) = chip_model.side_by_side([point, {**point, "model": "gpt-oss-20b"}], figures)
    assert row["measured_over_modeled"] == pytest.approx(5000.0 / row["modeled_us"])
    assert chip_model.summary([row])["ours"]["n"] == 1
    assert "| gemma4-26b-a4b | 64 | 4096 | 7 | all ours | 5,000.0 |" in "\n".join(chip_model.markdown([row]))


def test_measured_decode_points_carry_their_provenance():
    """benchmarks/calibration/decode_v5e.json: every point measured on the v5e with its versions and date, and every
    (model, batch) with all three implementations at the same layers."""
    from benchmarks.decode import chip_model

    points = json.loads(chip_model.POINTS.read_text())["points"]
    groups = {}
    for p in points:
        assert p["device_kind"] == "TPU v5 lite" and p["jax"] and p["libtpu"] and p["date"], p
        assert p["step_us"] > 0 and p["layers"] >= 1 and p["steps"] >= 32, p
        groups.setdefault((p["model"], p["batch"], p["context"], p["layers"], p.get("kind")), set()).add(p["impl"])
    assert all(impls == {"default", "ours", "experts"} for impls in groups.values()), groups
    assert {m for m, *_ in groups} == {"qwen3-30b-a3b", "gemma4-26b-a4b", "gpt-oss-20b"}


def test_decode_chip_mode_hands_its_options_to_the_one_chip_step(monkeypatch):
    """python -m benchmarks.decode --chip ...: the one-chip JAX step (chip_step.main) with every other option."""
    from benchmarks.decode import chip_step

    seen = []
    monkeypatch.setattr(chip_step, "main", lambda argv: seen.append(argv) or 0)
    assert decode_main.main(["--chip", "--model", "gpt-oss-20b", "--steps", "40"]) == 0
    assert seen == [["--model", "gpt-oss-20b", "--steps", "40"]]
