#!/usr/bin/env bash
# Downloads into .whl-tpu/ (ignored by git) the wheels the benchmarks' baselines need on the TPU test machine, which
# has no network and, beside jax 0.10.2, jaxlib, libtpu, numpy and pytest, none of them:
#   - tokamax 0.0.12 and the packages it imports there (the versions the main environment resolves for it; qwix
#     brings flax, optax, rich, treescope, msgpack and PyYAML in);
#   - flatbuffers, which jax.export needs to serialize the programs the benchmarks trace in worker processes;
#   - tpu-inference 0.32.0 (pure Python), without its dependencies (vllm, torch): the benchmarks import its Pallas
#     kernels module by module (benchmarks/ops/_vllm.py), which need nothing beyond jax.
# Every wheel is for CPython 3.11 on x86-64 Linux (the test machine's), downloaded without dependencies.
#
# On the test machine, with .whl-tpu carried over with the checkout (installed into build/, which git ignores; PYTHONPATH
# appended to, never replaced):
#   PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile \
#       --no-cache-dir --target build/tpu-site .whl-tpu/*.whl && export PYTHONPATH=$PYTHONPATH:$PWD/build/tpu-site
# (tpu-inference's wheel also installs top-level `tests` and `tools` packages; appended last on the path, they shadow
# nothing of the checkout's.)
#
# Usage: scripts/tpu_wheels.sh [python]   (default: .venv/bin/python, else python3; any pip that can download)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/wheel_list.sh
python=${1:-}
if [ -z "$python" ]; then
    python=.venv/bin/python
    [ -x "$python" ] || python=python3
fi
dest=.whl-tpu
wheels=(
    tokamax==0.0.12
    einshape==1.0
    qwix==0.1.8
    pydantic==2.14.4
    pydantic_core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    typeguard==2.13.3
    immutabledict==4.3.1
    tensorboardX==2.6.5
    jaxtyping==0.3.11
    wadler_lindig==0.1.8
    absl-py==2.5.1
    tqdm==4.70.1
    flax==0.12.8
    optax==0.2.8
    rich==15.0.0
    treescope==0.1.10
    msgpack==1.2.4
    PyYAML==6.0.4
    typing_extensions==4.16.0
    tpu-inference==0.32.0
    flatbuffers==25.12.19
)
mkdir -p "$dest"
PIP_CONFIG_FILE=/dev/null "$python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.11 --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" "${wheels[@]}"
# Only the wheels named above travel (a wheel left from another version would be installed beside them).
keep_listed_wheels tpu_wheels.sh "$dest" "${wheels[@]}"
ls -1 "$dest"
echo "total: $(du -sh "$dest" | cut -f1) in $KEPT_WHEELS wheels ($dest)"
