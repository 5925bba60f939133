#!/usr/bin/env bash
# The JAX-only tests under Python 3.12 + jax 0.12 (what TPU VMs run), in .venv-jax012/. Used by `make test`.
# Modules that need torch are left out by tests/conftest.py when torch is absent.
# Exit status: pytest's; 0 with a loud note when no Python 3.12 exists on this machine.
set -uo pipefail
cd "$(dirname "$0")/.."
venv=.venv-jax012
python312=""
for candidate in "$(PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null)" /root/.pyenv/versions/3.12*/bin/python3.12 \
                 "$(command -v python3.12)"; do
    # pyenv's shim exists even where it cannot run 3.12: keep the first interpreter that really starts.
    if [ -n "$candidate" ] && "$candidate" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then
        python312=$candidate
        break
    fi
done
if [ -z "$python312" ]; then
    echo "NOTE: no Python 3.12 on this machine: the jax 0.12 compatibility run did not happen"
    exit 0
fi
stamp=$venv/.installed-$(cksum pyproject.toml | cut -d' ' -f1)
if [ ! -e "$stamp" ]; then
    [ -x $venv/bin/python ] || "$python312" -m venv $venv || exit 1
    "$python312" scripts/requirements.py --jax-compat | $venv/bin/python -m pip install -q --no-compile -r /dev/stdin || exit 1
    # The JAX kernels by their one import name (tpu_kernels_jax); torch's package is installed too but never imported.
    $venv/bin/python -m pip install -q --no-compile --no-deps --no-build-isolation -e . || exit 1
    rm -f $venv/.installed-* && touch "$stamp"
fi
# The main environment runs every test. Here the JAX modules run once more, without the repeats that only vary sizes:
# the tiny-block reruns and the benchmark-shape compile sweeps (each kernel's other compile tests stay: the lowering
# is what differs between jax versions), and without the perf model and its calibration (a benchmarks tool run in the
# main environment).
# Flash attention runs its features, the gradient of all of them at once, varlen, export and the v6e compile here; the
# head dim / dtype / gradient variations, the other generations' compiles and the visit-list checks (numpy) run in
# the main environment only.
# The KV cache write runs its write cases, one dtype of the RoPE variants, fp8 with traced scales, bad input and export
# here; paged attention its "everything" batch, bad input and export. Their deviceless compiles and flash attention's
# run in the main environment only: the Mosaic compiler is the same libtpu in both, and the jax-side lowering is what
# the export tests exercise here (the v6e compiles of the KV cache write and flash attention took 178 and 151 s under
# jax 0.12). Likewise the ragged dot's metadata kernel, row-scale gradient and backward-compile checks.
# The MoE gradient checks run in the main environment only: experts_forward's gradient is the ragged dot backward kernels
# (their gradient tests run here) composed in JAX, on both paths (the small-batch path's custom_vjp is the grouped
# path's), and they are this run's longest tests (14-39 s each under jax 0.12). One process, not xdist workers: the
# tests share jitted kernels, which two workers would each compile (a fresh-clone run took longer with two).
exec $venv/bin/python -m pytest -p no:cacheprovider -k "not small_blocks and not at_benchmark_shapes \
and not experts_forward_compiles_for_tpu and not prefill_grouped_matmuls_compile and not test_perf_model \
and not test_perf_calibration and not test_experts_forward_gradients and not test_gradients_gqa_head_dims \
and not test_bfloat16_gradients and not test_low_precision_dtypes and not test_visit_lists_match_brute_force_mask \
and not test_gradient_of_the_log_sum_exp and not test_head_dims_and_gqa and not test_varlen_traced_cu_seqlens \
and not (test_gradients_match_reference and not everything) and not (test_compiles_for_tpu and flash and not v6e) \
and not (test_kv_cache and (block_sizes_agree or fp8_round_trip or (rope_and_write_matches and float32) \
or compiles_for_tpu or donated or row_major)) \
and not (test_paged_attention and ((mixed_batch and not everything) or page_sizes or bfloat16 or float8 or brute_force \
or run_time or broken or compiles_for_tpu)) \
and not (test_compiles_for_tpu and flash) and not test_metadata_kernel_equals_the_jax_visit_list \
and not test_row_scale_and_its_gradient and not test_backward_compiles_for_tpu" "$@"
