"""scripts/torch_tpu_parts.sh, the wheels of torch and torch-tpu carried to the TPU test machine in parts: split, the
runs' stash and the reassembly, on small synthetic wheels (PART_MIB / GROUP_MIB shrink the parts and groups)."""

import base64
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "torch_tpu_parts.sh"
MIB = 1 << 20


def run(mode, *args, part_mib="1", group_mib="2.5", check=True):
    env = dict(os.environ, PYTHON=sys.executable, PART_MIB=part_mib, GROUP_MIB=group_mib)
    result = subprocess.run(["bash", str(SCRIPT), mode, *map(str, args)], env=env, capture_output=True, text=True)
    if check:
        assert result.returncode == 0, f"{mode} failed:\n{result.stdout}\n{result.stderr}"
    return result


def sha256(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def random_file(path, size, seed):
    # deterministic, incompressible bytes (sha256 in counter mode)
    blocks = (hashlib.sha256(f"{seed}:{i}".encode()).digest() for i in range(-(-size // 32)))
    path.write_bytes(b"".join(blocks)[:size])
    return path


def tiny_wheel(folder, name, version, payload_bytes):
    """A real installable py3-none-any wheel holding package `name` and an incompressible payload."""
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n".encode(),
        f"{name}/payload.bin": b"".join(
            hashlib.sha256(f"{name}:{i}".encode()).digest() for i in range(payload_bytes // 32)
        ),
        f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{name}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = f"{name}-{version}.dist-info/RECORD"
    lines = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{path},sha256={digest},{len(data)}")
    lines.append(f"{record},,")
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        for path, data in files.items():
            archive.writestr(path, data)
        archive.writestr(record, "\n".join(lines) + "\n")
    return wheel


def carry_group_by_group(parts, tmp_path, groups):
    """What the device runs do: run k brings parts/k alone in its checkout and stashes it into build/torch-parts."""
    stash = tmp_path / "machine" / "build" / "torch-parts"
    for k in groups:
        carried = tmp_path / f"run{k}" / "parts"
        shutil.copytree(parts / str(k), carried / str(k))
        out = run("stash", "--from", carried, "--to", stash).stdout
        assert f"stashed group {k}" in out
    return stash


def test_split_stash_assemble_round_trip(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    originals = [
        random_file(wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", 3 * MIB, 1),
        random_file(wheels / "torch_tpu-0.2.0-cp311-cp311-manylinux_2_31_x86_64.whl", 3 * MIB // 2 + 17, 2),
        random_file(wheels / "sympy-1.14.0-py3-none-any.whl", 300_000, 3),
        random_file(wheels / "libtpu-0.0.50-cp311-cp311-manylinux_2_31_x86_64.whl", 2 * MIB + 5, 4),
    ]
    parts = tmp_path / "parts"
    out = run("split", "--wheels", wheels, "--out", parts).stdout
    manifest = json.loads((parts / "1" / "MANIFEST.json").read_text())
    groups = manifest["groups"]
    assert f"{groups} groups in" in out
    assert sorted(int(p.name) for p in parts.iterdir()) == list(range(1, groups + 1))
    for k in range(1, groups + 1):
        folder = parts / str(k)
        assert json.loads((folder / "MANIFEST.json").read_text()) == manifest  # every group carries the manifest
        assert all(p.stat().st_size <= MIB for p in folder.iterdir() if p.name != "MANIFEST.json")
        assert sum(p.stat().st_size for p in folder.iterdir()) <= 2.5 * MIB
    by_name = {w["file"]: w for w in manifest["wheels"]}
    for original in originals:
        entry = by_name[original.name]
        assert entry["sha256"] == sha256(original) and entry["bytes"] == original.stat().st_size
        assert len(entry["parts"]) == -(-entry["bytes"] // MIB)
    # libtpu's parts come last, in groups of their own (those runs can be left out)
    libtpu_groups = {p["group"] for p in by_name[originals[3].name]["parts"]}
    other_groups = {p["group"] for w in manifest["wheels"] if not w["file"].startswith("libtpu") for p in w["parts"]}
    assert min(libtpu_groups) > max(other_groups) and max(libtpu_groups) == groups

    stash = carry_group_by_group(parts, tmp_path, range(1, groups))
    out = run("stash", "--from", tmp_path / "nothing", "--to", stash).stdout
    assert f"missing: [{groups}]" in out
    stash = carry_group_by_group(parts, tmp_path, [groups])
    assert "missing: none" in run("stash", "--from", tmp_path / "nothing", "--to", stash).stdout

    rebuilt = tmp_path / "rebuilt"
    run("assemble", "--parts", stash, "--wheels-out", rebuilt, "--no-install")
    for original in originals:
        assert sha256(rebuilt / original.name) == sha256(original)

    # a corrupted part is refused, naming the part and the group to carry again
    part = by_name[originals[0].name]["parts"][1]
    damaged = stash / str(part["group"]) / part["name"]
    data = bytearray(damaged.read_bytes())
    data[1000] ^= 0xFF
    damaged.write_bytes(bytes(data))
    result = run("assemble", "--parts", stash, "--wheels-out", tmp_path / "again", "--no-install", check=False)
    assert result.returncode == 1
    assert f"corrupt part {part['name']} of group {part['group']}: sha256" in result.stderr
    assert f"carry group {part['group']} again" in result.stderr
    assert not (tmp_path / "again" / originals[0].name).exists()
    # ... and so is it when a run brings it damaged
    carried = tmp_path / "bad-run" / "parts"
    shutil.copytree(parts / str(part["group"]), carried / str(part["group"]))
    shutil.copyfile(damaged, carried / str(part["group"]) / part["name"])
    result = run("stash", "--from", carried, "--to", tmp_path / "other-stash", check=False)
    assert result.returncode == 1 and f"corrupt part {part['name']}" in result.stderr

    # a missing torch group stops the assembly; libtpu's groups may be left out altogether
    shutil.rmtree(stash / str(part["group"]))
    result = run("assemble", "--parts", stash, "--wheels-out", tmp_path / "again", "--no-install", check=False)
    assert result.returncode == 1 and f"groups [{part['group']}] are missing" in result.stderr


def test_assemble_skips_absent_libtpu_groups_and_installs(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    tiny_wheel(wheels, "probe_pkg", "1.0", 40_000)
    tiny_wheel(wheels, "libtpu", "0.0.50", 30_000)
    parts = tmp_path / "parts"
    sizes = {"part_mib": "0.01", "group_mib": "0.3"}  # 10 KiB parts; each group keeps 256 KiB for its manifest
    run("split", "--wheels", wheels, "--out", parts, **sizes)
    manifest = json.loads((parts / "1" / "MANIFEST.json").read_text())
    by_name = {w["file"].split("-")[0]: w for w in manifest["wheels"]}
    assert len(by_name["probe_pkg"]["parts"]) > 1
    core_groups = sorted({p["group"] for p in by_name["probe_pkg"]["parts"]})
    stash = carry_group_by_group(parts, tmp_path, core_groups)
    out = run("assemble", "--parts", stash, "--wheels-out", tmp_path / "w", "--no-install", **sizes).stdout
    assert "the machine's own libtpu stays" in out
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [by_name["probe_pkg"]["file"]]

    stash = carry_group_by_group(parts, tmp_path, sorted({p["group"] for p in by_name["libtpu"]["parts"]}))
    site = tmp_path / "site"
    out = run("assemble", "--parts", stash, "--target", site, "--wheels-out", tmp_path / "w", **sizes).stdout
    assert (site / "probe_pkg" / "__init__.py").read_text() == "VERSION = '1.0'\n"
    assert (tmp_path / "site-libtpu" / "libtpu" / "__init__.py").is_file()
    assert not (site / "libtpu").exists()
    assert f"export PYTHONPATH={tmp_path / 'site-libtpu'}:$PYTHONPATH:{site}" in out


def test_a_download_folder_keeps_exactly_the_listed_wheels(tmp_path):
    """scripts/wheel_list.sh (both download scripts): every wheel of the pinned list is kept (names matched as pip
    normalizes them), any other file goes (the parts folder stays), and a listed wheel missing is an error naming it."""
    for name in ("foo-1.0-py3-none-any.whl", "Bar_Baz-2.0-py3-none-any.whl", "foo-0.9-py3-none-any.whl"):
        (tmp_path / name).write_bytes(os.urandom(16))
    (tmp_path / "parts").mkdir()
    helper = ROOT / "scripts" / "wheel_list.sh"

    def keep(*specs):
        command = (
            f'source "{helper}"; keep_listed_wheels caller "{tmp_path}" {" ".join(specs)}; echo "kept $KEPT_WHEELS"'
        )
        return subprocess.run(["bash", "-c", command], capture_output=True, text=True)

    kept = keep("foo==1.0", "bar-baz==2.0")
    assert kept.returncode == 0 and "kept 2" in kept.stdout and "removing foo-0.9" in kept.stdout, kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "Bar_Baz-2.0-py3-none-any.whl",
        "foo-1.0-py3-none-any.whl",
        "parts",
    ]
    missing = keep("foo==1.1")
    assert missing.returncode == 1 and "caller: no wheel of foo==1.1" in missing.stderr, missing


def test_the_ops_check_runs_each_op_of_the_hub_build_on_a_device_against_the_cpu(hub_root, capsys):
    """scripts/torch_tpu_ops_check.py, the torch ops on the chip against the CPU, wired to the Hub build: here with
    the CPU standing in for the device (no chip), so that its inputs and calls are known to be right for the ops it
    checks; an op that drifted from its inputs fails here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("torch_tpu_ops_check", ROOT / "scripts" / "torch_tpu_ops_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    only = [
        "rms_norm",
        "fused_add_rms_norm",
        "reshape_and_cache_flash",
        "reshape_and_cache_flash_fp8",
        "ragged_paged_attention",
        "experts_forward_quantized",
    ]
    argv = ["--package", str(hub_root / "build" / "torch-tpu"), "--device", "cpu"]
    assert check.main([*argv, *(a for name in only for a in ("--only", name))]) == 0
    out = capsys.readouterr().out
    assert "torch ops on cpu: 8 checks, 0 failures" in out  # the quantized experts are three checks
    assert out.count("\nok   ") + out.startswith("ok   ") == 8


def _script(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_models_check_generates_on_a_device_as_on_the_cpu(hub_root, capsys, monkeypatch):
    """scripts/torch_tpu_models_check.py (tiny transformers models through the Hub build on the chip against the CPU),
    here with the CPU standing in for the device: experts_forward registered in transformers' experts interface runs,
    the logits match transformers' default and generation gives the same tokens."""
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-community/tpu-kernels={hub_root}")
    check = _script("torch_tpu_models_check")
    argv = ["--build", str(hub_root / "build"), "--device", "cpu", "--only", "qwen3_moe_experts"]
    assert check.main(argv) == 0
    out = capsys.readouterr().out
    assert "models on cpu: 1 checks, 0 failures" in out
    assert "ok   qwen3_moe_experts:" in out and "greedy tokens equal" in out and "experts_forward x" in out


def test_the_models_check_tells_a_near_tie_from_a_wrong_token():
    """Where the device's greedy tokens part from the CPU's, the check passes only a near-tie of the CPU's logits."""
    import torch

    check = _script("torch_tpu_models_check")

    class Logits:  # a stand-in model: fixed logits at every position
        def __init__(self, values):
            self.values = torch.tensor(values)

        def __call__(self, tokens):
            return type("Out", (), {"logits": self.values.expand(tokens.shape[0], tokens.shape[1], -1)})()

    cpu_tokens, device_tokens = torch.tensor([[5, 6, 0]]), torch.tensor([[5, 6, 1]])
    tie = check._compare_generation(Logits([1.0, 1.0 - 1e-4, -2.0]), cpu_tokens, device_tokens, 2)
    assert "near-tie" in tie
    with pytest.raises(AssertionError, match="not a tie"):
        check._compare_generation(Logits([1.0, 0.5, -2.0]), cpu_tokens, device_tokens, 2)
    assert "equal" in check._compare_generation(Logits([1.0, 0.5]), cpu_tokens, cpu_tokens.clone(), 2)


def test_the_torch_ops_timing_records_each_call_and_runs_its_jax_function(hub_root, tmp_path):
    """benchmarks/torch_ops.py (a torch op's device time on the chip against its own JAX function called directly),
    wired on the CPU: the recorded op and its arguments rebuild the JAX program, both sides run; the table divides
    the traced device time by the calls."""
    from benchmarks import torch_ops

    args = torch_ops.argparse.Namespace(
        package=hub_root / "build" / "torch-tpu", calls=2, device="cpu", only=["rms_norm tokens=8 "], out=tmp_path
    )
    record = torch_ops.measure(args)
    (row,) = record["rows"]
    assert "error" not in row, row
    assert row["ops"] == ["rms_norm"]
    assert row["torch"]["host_s_per_call"] > 0 and row["jax"]["host_s_per_call"] > 0
    summary = torch_ops._summary([("a(1)", 2e-6), ("b(2)", 1e-6), ("a(1)", 4e-6), ("b(2)", 1e-6)], 2, 1e-3)
    assert summary["device_s_per_call"] == pytest.approx(4e-6)
    assert summary["programs"]["a(1)"] == {"executions": 2, "median_s": pytest.approx(3e-6)}
    table = torch_ops.markdown([{"case": "c", "torch": summary, "jax": {**summary, "device_s_per_call": 2e-6}}], "h")
    assert "| c | 4.0 | 2.0 | 2.00x |" in table
