#!/usr/bin/env bash
# torch 2.13.0 (CPU build) and torch-tpu 0.2.0 for the TPU test machine, which has Python 3.11 with jax 0.10.2,
# jaxlib, libtpu, numpy and pytest but no torch and no network, and takes at most 64 MiB of ignored files a run (the
# tracked checkout, about 3 MiB, counts too). The wheels (about 517 MiB) travel in parts, one group folder a run, over
# consecutive runs; the machine keeps build/ between runs only while it stays up (it goes back 100 s after a call
# ends), so the runs go back to back. The last run reassembles, checks every sha256 and installs.
#
# Modes:
#   download [python]  here, with PyPI and this machine's pip configuration: the wheels into .whl-torch/ (ignored by
#                      git). torch==2.13.0+cpu comes from the local wheel pip's configured find-links holds (PyPI has
#                      no CPU build of torch on Linux; TORCH_WHEEL=/path/to/torch-2.13.0+cpu-...whl takes that file
#                      instead). WITH_LIBTPU=0 leaves libtpu out, WITH_MODELS=0 transformers and kernels
#                      (the model checks' needs, about 27 MiB). Files of .whl-torch/ not in the list go.
#   split [--wheels DIR] [--out DIR]
#                      every wheel of DIR (default .whl-torch) cut into parts of at most PART_MIB MiB (default 58),
#                      packed into group folders OUT/1, OUT/2, ... (default .whl-torch/parts) of at most GROUP_MIB MiB
#                      each (default 59), MANIFEST.json (the size and sha256 of each whole wheel and of each part)
#                      in every group. torch, torch-tpu, transformers, kernels and their dependencies fill the
#                      first groups (1-6), libtpu 0.0.50 the last ones (7-10): torch-tpu requires libtpu>=0.0.50,
#                      and the machine's own libtpu (0.0.42.1, jax 0.10.2's `tpu` extra's pin) is older. Refuses when a
#                      group plus the checkout's travelling files (git ls-files -co --exclude-standard) pass 64 MiB.
#   stash [--from DIR] [--to DIR]
#                      on the test machine, each run: checks the parts of every group carried in FROM (default
#                      .whl-torch/parts) against the manifest, copies them to TO/<n>/ (default build/torch-parts),
#                      says which groups TO holds and which are still missing, and prints the machine's Python,
#                      glibc and libtpu version.
#   assemble [--parts DIR] [--target DIR] [--libtpu-target DIR] [--wheels-out DIR] [--no-install]
#                      on the test machine, last run: every wheel rebuilt from its parts under PARTS (default
#                      build/torch-parts) into WHEELS-OUT (default build/torch-wheels), each part's and each whole
#                      wheel's sha256 checked (a corrupt or missing part stops it, naming the group to carry again),
#                      then `pip install --no-index --no-deps --target`: libtpu into LIBTPU-TARGET (default
#                      TARGET-libtpu, put first on PYTHONPATH so that jax and torch-tpu load the same libtpu), the rest
#                      into TARGET (default build/torch-site, appended to PYTHONPATH). libtpu's groups may be left
#                      out altogether; then the machine's own libtpu stays.
#   PYTHON (default python3; .venv/bin/python for download) runs the modes.
#
# The sequence (device runs through the session's `run` tool; N groups, N printed by split; 10 with libtpu):
#   here:   scripts/torch_tpu_parts.sh download && scripts/torch_tpu_parts.sh split
#   run k, for k = 1 .. N-1, one right after the other (within 100 s of the previous call's end):
#           carry [".whl-torch/parts/k"], command: bash scripts/torch_tpu_parts.sh stash
#   run N:  carry [".whl-torch/parts/N", "build/torch-tpu", "build/torch-cpu"], command:
#           set -o pipefail; bash scripts/torch_tpu_parts.sh stash && bash scripts/torch_tpu_parts.sh assemble &&
#           export PYTHONPATH=$PWD/build/torch-site-libtpu:$PYTHONPATH:$PWD/build/torch-site &&
#           python3 scripts/torch_tpu_probe.py 2>&1 | tee $OUT/probe.log   (then the ops check, the models
#           check and benchmarks.torch_ops: docs/torch_on_chip.md has the whole command)
#   Run 1's stash prints the machine's libtpu version: where it is 0.0.50 or newer, in three parts (torch-tpu 0.2.0
#   refuses "0.0.50.1"), libtpu's groups can stay behind (then N is the last torch group). A run that says a group
#   is corrupt or missing: carry that group again (stash is idempotent) before run N. If the machine went back
#   between runs (build/ gone: stash lists every earlier group as missing), start again at run 1. Later runs on the
#   same machine need only the export line (the install stays in build/). docs/torch_on_chip.md has the findings.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/wheel_list.sh
mode=${1:-}
[ $# -gt 0 ] && shift

# The wheels, for CPython 3.11 on x86-64 Linux, at the versions the project's .venv resolves. torch's Requires-Dist:
# filelock, typing-extensions>=4.10.0, setuptools>=77.0.3, sympy>=1.13.3 (mpmath), networkx>=2.5.1, jinja2
# (MarkupSafe), fsspec>=0.8.5. torch-tpu's: numpy>=2, absl-py>=2, libtpu>=0.0.50, portpicker>=1.6 (psutil),
# tensorboard>=2.20, frozendict>=2, immutabledict>=4, pyzmq>=27, torch>=2.11.0,<=2.15.0. numpy is on the machine;
# tensorboard is not carried (nothing in torch-tpu imports it; the machine's own package index has it).
core_wheels=(
    torch==2.13.0+cpu
    torch-tpu==0.2.0
    filelock==4.3.2
    typing_extensions==4.16.0
    setuptools==84.2.1
    sympy==1.14.0
    mpmath==1.3.0
    networkx==3.6.1
    jinja2==3.1.6
    MarkupSafe==3.0.4
    fsspec==2026.9.0
    absl-py==2.5.1
    portpicker==1.6.0
    psutil==7.2.2
    frozendict==2.5.1
    immutabledict==4.3.1
    pyzmq==27.3.0
)
# For the model checks (scripts/torch_tpu_models_check.py): transformers and kernels (get_local_kernel) with what
# they import, at the .venv's versions (kernels' sigstore is left out: only its signature verification imports it).
model_wheels=(
    transformers==5.22.2
    kernels==0.17.2
    huggingface_hub==2.4.0
    tokenizers==0.23.3
    safetensors==0.8.0
    regex==2026.12.2
    PyYAML==6.0.4
    tqdm==4.70.1
    packaging==26.4
    typer==0.29.2
    click==8.5.1
    hf-xet==1.8.0
    httpx2==2.17.0
    httpcore2==2.17.0
    truststore==0.10.5
    anyio==4.16.0
    h11==0.16.0
    idna==3.21
    certifi==2026.10.19.post1
    shellingham==1.5.4
    rich==15.0.0
    markdown-it-py==4.3.0
    mdurl==0.1.2
    Pygments==2.21.0
    annotated-doc==0.0.7
    tomlkit==0.15.3
)
# libtpu: torch-tpu 0.2.0 requires >=0.0.50, and its device set-up passes libtpu's version to its runtime, which
# refuses a four-part version ("0.0.50.1", "0.0.42.1": set_libtpu_version() raises, so the backend does not load).
# 0.0.50 is the oldest that fits both; jax 0.10.2's own `tpu` extra pins libtpu 0.0.42.*.
libtpu_wheel=libtpu==${LIBTPU_VERSION:-0.0.50}

download() {
    local python=${1:-${PYTHON:-}}
    if [ -z "$python" ]; then
        python=.venv/bin/python
        [ -x "$python" ] || python=python3
    fi
    local dest=.whl-torch
    local wheels=("${core_wheels[@]}")
    [ "${WITH_MODELS:-1}" = 0 ] || wheels+=("${model_wheels[@]}")
    [ "${WITH_LIBTPU:-1}" = 0 ] || wheels+=("$libtpu_wheel")
    mkdir -p "$dest"
    local fetch=("${wheels[@]}")
    if [ -n "${TORCH_WHEEL:-}" ]; then
        cp -f "$TORCH_WHEEL" "$dest/"
        fetch=("${wheels[@]:1}")
    fi
    # pip's own configuration stays in force: its find-links holds the local torch CPU wheel.
    "$python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.11 --implementation cp --platform manylinux_2_31_x86_64 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 \
        --platform manylinux2010_x86_64 --platform manylinux1_x86_64 -d "$dest" "${fetch[@]}" 2>&1 |
        grep -v "is ignored: it is neither a file nor a directory" || true
    keep_listed_wheels torch_tpu_parts.sh "$dest" "${wheels[@]}"
    for stem in torch torch_tpu; do
        echo "== Requires-Dist of $(cd "$dest" && ls ${stem}-[0-9]*.whl)"
        unzip -p "$dest"/${stem}-[0-9]*.whl '*.dist-info/METADATA' | grep '^Requires-Dist' || true
    done
    ls -l "$dest"/*.whl | awk '{printf "%8.1f MiB  %s\n", $5 / 1048576, $NF}'
    echo "total: $(du -cb "$dest"/*.whl | tail -1 | awk '{printf "%.1f MiB", $1 / 1048576}') in $KEPT_WHEELS wheels"
}

case "$mode" in
download)
    download "$@"
    exit 0
    ;;
split | stash | assemble) ;;
*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac

# travelling size of the checkout (tracked and untracked, not ignored, files), for split's check
if [ "$mode" = split ]; then
    TREE_BYTES=$(git ls-files -z -co --exclude-standard 2>/dev/null | xargs -0 -r du -cb 2>/dev/null | tail -1 |
        cut -f1 || echo 0)
    export TREE_BYTES
fi
exec "${PYTHON:-python3}" - "$mode" "$@" <<'PY'
import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys

MIB = 1 << 20
RUN_LIMIT = 64 * MIB  # what one device run carries: the checkout's travelling files and the carried group
MANIFEST = "MANIFEST.json"
MANIFEST_RESERVE = 256 * 1024  # room kept in each group for its copy of the manifest


class Refused(Exception):
    pass


def sha256_of(path, offset=0, size=None):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = os.path.getsize(path) - offset if size is None else size
        while left > 0:
            block = f.read(min(left, 8 * MIB))
            if not block:
                break
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def mib(n):
    return f"{n / MIB:.1f} MiB"


def env_mib(name, default):
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        raise Refused(f"{name}={os.environ[name]!r}: expected a number of MiB") from None
    if value <= 0:
        raise Refused(f"{name} must be positive")
    return int(value * MIB)


def is_libtpu(wheel_name):
    return wheel_name.lower().startswith("libtpu-")


def pack(chunks, group_bytes):
    """First-fit decreasing: lists of chunks, each list's sizes summing to at most group_bytes less the reserve."""
    groups = []
    for chunk in sorted(chunks, key=lambda c: -c["bytes"]):
        for group in groups:
            if sum(c["bytes"] for c in group) + chunk["bytes"] + MANIFEST_RESERVE <= group_bytes:
                group.append(chunk)
                break
        else:
            groups.append([chunk])
    return groups


def split(args):
    part_bytes = env_mib("PART_MIB", 58)
    group_bytes = env_mib("GROUP_MIB", 59)
    if part_bytes + MANIFEST_RESERVE > group_bytes:
        raise Refused(f"PART_MIB ({mib(part_bytes)}) leaves no room in GROUP_MIB ({mib(group_bytes)}) for the manifest")
    wheels_dir, out = pathlib.Path(args.wheels), pathlib.Path(args.out)
    wheels = sorted(wheels_dir.glob("*.whl"))
    if not wheels:
        raise Refused(f"no wheels in {wheels_dir} (run the download mode first)")
    if out.exists():
        strays = [p for p in out.iterdir() if not (p.is_dir() and p.name.isdigit())]
        if strays:
            raise Refused(f"{out} holds other things than group folders ({strays[0].name}); not removing it")
        shutil.rmtree(out)
    entries, chunks = [], []
    for wheel in wheels:
        size = wheel.stat().st_size
        count = max(1, -(-size // part_bytes))
        width = max(2, len(str(count)))
        entry = {
            "file": wheel.name,
            "bytes": size,
            "sha256": sha256_of(wheel),
            "install": "libtpu" if is_libtpu(wheel.name) else "site",
            "parts": [],
        }
        for i in range(count):
            offset = i * part_bytes
            part = {"name": f"{wheel.name}.part{i + 1:0{width}d}", "offset": offset}
            part["bytes"] = min(part_bytes, size - offset)
            entry["parts"].append(part)
            chunks.append({"wheel": wheel, "part": part, "bytes": part["bytes"], "libtpu": is_libtpu(wheel.name)})
        entries.append(entry)
    # torch, torch-tpu and their dependencies first; libtpu's parts in groups of their own at the end
    groups = pack([c for c in chunks if not c["libtpu"]], group_bytes)
    groups += pack([c for c in chunks if c["libtpu"]], group_bytes)
    for number, group in enumerate(groups, 1):
        folder = out / str(number)
        folder.mkdir(parents=True)
        for chunk in group:
            part = chunk["part"]
            part["group"] = number
            with open(chunk["wheel"], "rb") as src, open(folder / part["name"], "wb") as dst:
                src.seek(part["offset"])
                left = part["bytes"]
                while left > 0:
                    block = src.read(min(left, 8 * MIB))
                    dst.write(block)
                    left -= len(block)
            part["sha256"] = sha256_of(folder / part["name"])
    identity = hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:16]
    manifest = {
        "split_id": identity,
        "groups": len(groups),
        "part_bytes": part_bytes,
        "group_bytes": group_bytes,
        "wheels": entries,
    }
    text = json.dumps(manifest, indent=1) + "\n"
    tree = int(os.environ.get("TREE_BYTES") or 0)
    print(
        f"{len(groups)} groups in {out} (= device runs), split {identity}; the checkout travels with each: {mib(tree)}"
    )
    largest = 0
    for number in range(1, len(groups) + 1):
        folder = out / str(number)
        (folder / MANIFEST).write_text(text)
        total = sum(p.stat().st_size for p in folder.iterdir())
        largest = max(largest, total)
        if total > group_bytes:
            raise Refused(f"group {number} is {mib(total)}, over GROUP_MIB ({mib(group_bytes)})")
        names = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
        print(f"  {number}: {mib(total):>10}  {len(names)} parts: {', '.join(names)}")
    whole = sum(e["bytes"] for e in entries)
    print(f"total: {mib(whole)} in {len(entries)} wheels; largest group {mib(largest)}")
    first_libtpu = next((c["part"]["group"] for c in chunks if c["libtpu"]), None)
    if first_libtpu:
        print(
            f"libtpu's parts: groups {first_libtpu}..{len(groups)} "
            "(leave them out where the machine's libtpu >= 0.0.50)"
        )
    if largest + tree > RUN_LIMIT:
        raise Refused(
            f"a run would carry {mib(largest + tree)} (largest group + checkout), over 64 MiB: "
            "lower GROUP_MIB and PART_MIB"
        )


def read_manifest(folder):
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise Refused(f"{folder}: no readable {MANIFEST} ({error})") from None


def group_folders(root):
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def one_manifest(root):
    folders = group_folders(root)
    if not folders:
        raise Refused(f"no group folders in {root}")
    manifest = read_manifest(folders[0])
    for folder in folders[1:]:
        other = read_manifest(folder)
        if other["split_id"] != manifest["split_id"]:
            raise Refused(
                f"group {folder.name} is from split {other['split_id']}, group {folders[0].name} from split "
                f"{manifest['split_id']}: every group must come from one split (carry them all again)"
            )
    return manifest, folders


def check_part(folder, part):
    path = folder / part["name"]
    if not path.is_file():
        raise Refused(
            f"missing part {part['name']} of group {part['group']} in {folder}: carry group {part['group']} again"
        )
    size = path.stat().st_size
    if size != part["bytes"]:
        raise Refused(
            f"corrupt part {part['name']} of group {part['group']}: {size} bytes, the manifest says {part['bytes']}: "
            f"carry group {part['group']} again"
        )
    got = sha256_of(path)
    if got != part["sha256"]:
        raise Refused(
            f"corrupt part {part['name']} of group {part['group']}: sha256 {got}, the manifest says {part['sha256']}: "
            f"carry group {part['group']} again"
        )
    return path


def machine_facts():
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    spec = importlib.util.find_spec("libtpu")
    where = os.path.dirname(spec.origin) if spec and spec.origin else "-"
    libc = "".join(platform.libc_ver())
    print(
        f"machine: Python {platform.python_version()} {platform.machine()}, {libc}; jax {version('jax')}, "
        f"jaxlib {version('jaxlib')}, libtpu {version('libtpu')} ({where}); torch {version('torch')}"
    )


def stash(args):
    source, dest = pathlib.Path(args.source), pathlib.Path(args.to)
    machine_facts()
    carried = group_folders(source)
    manifest = None
    for folder in carried:
        manifest = read_manifest(folder)
        number = int(folder.name)
        parts = [p for w in manifest["wheels"] for p in w["parts"] if p["group"] == number]
        target = dest / folder.name
        if target.is_dir():
            try:
                same = read_manifest(target)["split_id"] == manifest["split_id"]
            except Refused:  # an earlier copy that stopped before its manifest
                same = False
            if not same:
                shutil.rmtree(target)
        target.mkdir(parents=True, exist_ok=True)
        for part in parts:
            path = check_part(folder, part)
            shutil.copyfile(path, target / (part["name"] + ".tmp"))
            os.replace(target / (part["name"] + ".tmp"), target / part["name"])
        shutil.copyfile(folder / MANIFEST, target / MANIFEST)
        print(f"stashed group {number} ({len(parts)} parts, {mib(sum(p['bytes'] for p in parts))}) in {target}")
    if not carried:
        print(f"no group carried in {source}")
    if not group_folders(dest):
        return
    manifest, folders = one_manifest(dest)
    have = sorted(int(f.name) for f in folders)
    missing = [n for n in range(1, manifest["groups"] + 1) if n not in have]
    print(
        f"{dest} holds groups {have} of {manifest['groups']} (split {manifest['split_id']}); "
        f"missing: {missing or 'none'}"
    )


def assemble(args):
    root = pathlib.Path(args.parts)
    manifest, folders = one_manifest(root)
    have = {int(f.name): f for f in folders}
    out = pathlib.Path(args.wheels_out)
    out.mkdir(parents=True, exist_ok=True)
    built = {"site": [], "libtpu": []}
    for wheel in manifest["wheels"]:
        groups = sorted({p["group"] for p in wheel["parts"]})
        absent = [g for g in groups if g not in have]
        if absent:
            if wheel["install"] == "libtpu" and len(absent) == len(groups):
                print(f"{wheel['file']}: none of its groups {groups} is here; the machine's own libtpu stays")
                continue
            raise Refused(f"{wheel['file']}: groups {absent} are missing from {root}: carry them (stash) first")
        target = out / wheel["file"]
        partial = out / (wheel["file"] + ".partial")
        try:
            with open(partial, "wb") as dst:
                for part in wheel["parts"]:
                    path = check_part(have[part["group"]], part)
                    with open(path, "rb") as src:
                        shutil.copyfileobj(src, dst, 8 * MIB)
        except Refused:
            partial.unlink()
            raise
        got = sha256_of(partial)
        if got != wheel["sha256"] or partial.stat().st_size != wheel["bytes"]:
            partial.unlink()
            raise Refused(f"{wheel['file']}: reassembled sha256 {got}, the manifest says {wheel['sha256']}")
        os.replace(partial, target)
        built[wheel["install"]].append(target)
        print(f"{wheel['file']}: {mib(wheel['bytes'])}, sha256 {got[:16]}... ok")
    if args.no_install:
        return
    site = pathlib.Path(args.target).resolve()
    libtpu_site = pathlib.Path(args.libtpu_target or f"{args.target}-libtpu").resolve()
    for wheels, target in ((built["site"], site), (built["libtpu"], libtpu_site)):
        if not wheels:
            continue
        command = [sys.executable, "-m", "pip", "install", "--isolated", "-q", "--disable-pip-version-check"]
        command += ["--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target)]
        env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
        print(f"installing {len(wheels)} wheels into {target}", flush=True)
        if subprocess.run(command + [str(w) for w in wheels], env=env).returncode:
            raise Refused(f"pip install into {target} failed (above)")
    front = f"{libtpu_site}:" if built["libtpu"] else ""
    print("installed; before python3 runs torch:")
    print(f"  export PYTHONPATH={front}$PYTHONPATH:{site}")


def main():
    parser = argparse.ArgumentParser(prog="torch_tpu_parts.sh")
    modes = parser.add_subparsers(dest="mode", required=True)
    p = modes.add_parser("split")
    p.add_argument("--wheels", default=".whl-torch")
    p.add_argument("--out", default=".whl-torch/parts")
    p = modes.add_parser("stash")
    p.add_argument("--from", dest="source", default=".whl-torch/parts")
    p.add_argument("--to", default="build/torch-parts")
    p = modes.add_parser("assemble")
    p.add_argument("--parts", default="build/torch-parts")
    p.add_argument("--target", default="build/torch-site")
    p.add_argument("--libtpu-target", default=None)
    p.add_argument("--wheels-out", default="build/torch-wheels")
    p.add_argument("--no-install", action="store_true")
    args = parser.parse_args()
    try:
        {"split": split, "stash": stash, "assemble": assemble}[args.mode](args)
    except Refused as error:
        print(f"torch_tpu_parts.sh {args.mode}: {error}", file=sys.stderr)
        sys.exit(1)


main()
PY
