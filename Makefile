# tpu-kernels developer entry points. Everything creates .venv/ and installs the pinned stack on first use.
#   make test    the whole verification ladder (rungs 1-4) on this machine, no TPU needed
#   make bench   benchmark tables (measured on a TPU when present, modeled, roofline); add BENCH_ARGS=--full
#   make bench-tpu  on a TPU host with jax installed (a TPU VM, no network needed): the measured tables with that
#                host's own $(PYTHON), installing nothing; BENCH_TPU_ARGS (default --no-model) and BENCH_ARGS pass options
#   make decode-tpu on a TPU host with jax installed: a whole MoE decode step on one chip, ours against XLA's path
#   make tpu-check  on a TPU host with jax installed: the on-chip correctness tier, every JAX kernel test compiled
#                with Mosaic and run on the chip against its reference (docs/verification.md), installing nothing
#   make build   the Hub package: build/torch-tpu/ and build/torch-cpu/
#   make lint    ruff format --check and ruff check (configured in pyproject.toml); make test runs it first
PYTHON ?= python3
# Where the environment sets PYTHONDONTWRITEBYTECODE, no module's bytecode is ever cached, and every process (each
# xdist worker, each deviceless-compile subprocess) compiles the jax, torch and transformers sources it imports again:
# importing torch took 16 s of CPU without bytecode and 7 s with it, jax's Pallas TPU 7 s and 2 s. The environments
# here are our own (.venv/, .venv-jax012/), so their bytecode is written on first import (pip installs with
# --no-compile: only what is imported is compiled).
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: venv test bench bench-tpu decode-tpu tpu-host tpu-check build lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml scripts/requirements.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) scripts/requirements.py test bench | $(PY) -m pip install -q --no-compile -r /dev/stdin
	$(PY) scripts/requirements.py --no-deps | $(PY) -m pip install -q --no-compile --no-deps -r /dev/stdin
	$(PY) -m pip install -q --no-compile --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $@

lint: venv
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

build: venv
	$(PY) scripts/build_hub.py

# The JAX-only tests under Python 3.12 + jax 0.12 (scripts/jax_compat.sh, which makes its own environment) start
# first, in the background at a lower priority, so that they fill the time the cores are not busy with the main
# environment's install and the main suite; the main suite runs on two xdist workers (TEST_WORKERS) with one host CPU
# device, then the shard_map tests (8 host devices, tests/conftest.py) in a pytest process of their own.
TEST_WORKERS ?= 2
test:
	@mkdir -p build; nice -n 10 scripts/jax_compat.sh -q $(PYTEST_ARGS) > build/jax012-tests.log 2>&1 & compat=$$!; \
	$(MAKE) --no-print-directory lint build && \
	TPU_KERNELS_HOST_DEVICES=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal --ignore=tests/test_sharded.py \
		$(PYTEST_ARGS); main=$$?; \
	$(PY) -m pytest -n $(TEST_WORKERS) tests/test_sharded.py $(PYTEST_ARGS); sharded=$$?; \
	wait $$compat; compat_rc=$$?; \
	echo "=== JAX-only tests under Python 3.12 + jax 0.12 (full log: build/jax012-tests.log) ==="; \
	tail -n 15 build/jax012-tests.log; \
	test $$main -eq 0 && test $$sharded -eq 0 && test $$compat_rc -eq 0

bench: venv
	$(PY) -m benchmarks $(BENCH_ARGS)

# A TPU host's own Python (jax, jaxlib and libtpu preinstalled; perhaps no network, no torch): nothing is installed.
# The JAX package is found through a folder holding one link, tpu_kernels_jax -> kernels/ (what the editable install
# maps), appended to the host's PYTHONPATH with the checkout root (benchmarks/); tqdm and matplotlib are used where
# present (else plain progress lines and no charts).
TPU_HOST_PATH := $(CURDIR)/build/tpu-host
TPU_HOST_ENV := PYTHONPATH=$${PYTHONPATH:+$$PYTHONPATH:}$(CURDIR):$(TPU_HOST_PATH) PYTHONUNBUFFERED=1
BENCH_TPU_ARGS ?= --no-model

tpu-host:
	@mkdir -p $(TPU_HOST_PATH) && ln -sfn $(CURDIR)/kernels $(TPU_HOST_PATH)/tpu_kernels_jax

bench-tpu: tpu-host
	$(TPU_HOST_ENV) $(PYTHON) -m benchmarks $(BENCH_TPU_ARGS) $(BENCH_ARGS)

# A whole MoE decode step on one chip (benchmarks/decode/chip_step.py), measured by device time, on the host's own
# Python as bench-tpu: DECODE_ARGS passes options (--model, --batch, --context, --steps, --layers, --out).
decode-tpu: tpu-host
	$(TPU_HOST_ENV) $(PYTHON) -m benchmarks.decode.chip_step $(DECODE_ARGS)

# The on-chip tier on a TPU host's own Python, as bench-tpu: TPU_KERNELS_ON_CHIP=1 makes tests/conftest.py collect the
# JAX kernel tests only, deselect those marked cpu_only and refuse a host whose jax finds no TPU. One process holds the
# chip (no xdist). Tests still to start after TPU_CHECK_BUDGET_S seconds are skipped, so that a run under a time limit
# ends with its summary ("on-chip tier: N cases, F failures"); the log and a JUnit XML go to TPU_CHECK_OUT; every
# compiled program is cached in build/tpu-check-cache for the next run. TPU_CHECK_ARGS: pytest options (-k, -x, paths);
# TPU_KERNELS_SWEEP_DRAWS: the random draws per kernel family (default 8 on the chip).
TPU_CHECK_BUDGET_S ?= 480
TPU_CHECK_OUT ?= build/tpu-check
tpu-check: SHELL := /bin/bash
tpu-check: .SHELLFLAGS := -o pipefail -c
tpu-check: tpu-host
	@mkdir -p $(TPU_CHECK_OUT)
	$(TPU_HOST_ENV) TPU_KERNELS_ON_CHIP=1 TPU_KERNELS_TIME_BUDGET_S=$(TPU_CHECK_BUDGET_S) \
		JAX_COMPILATION_CACHE_DIR=$(CURDIR)/build/tpu-check-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
		$(PYTHON) -m pytest -p no:xdist -p no:cacheprovider --durations=20 --junitxml=$(TPU_CHECK_OUT)/tpu-check.xml \
		$(TPU_CHECK_ARGS) 2>&1 | tee $(TPU_CHECK_OUT)/tpu-check.log

clean:
	rm -rf build .pytest_cache bench-results
