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
# The main environment runs every test. Here, under jax 0.12, a smoke set: every kernel's TPU export (the jax-side
# lowering, what changes between jax versions) and a few reference checks per kernel in strict interpret mode that
# between them reach each kernel's main variants (forward and backward kernels, fused epilogues, both MoE paths, the
# KV cache write with RoPE and fp8, flash and paged attention with every feature at once; the backward kernels by
# the ragged dot's and rms_norm's gradients, flash attention's by its export). Deviceless compiles, the
# perf model and the size/dtype sweeps run in the main environment only (the Mosaic compiler is the same libtpu in
# both). A short list keeps this run inside make test's budget; one process, not xdist workers (the tests share
# jitted kernels, which two workers would each compile).
# One shard_map check (test_sharded.py: RMSNorm with its gradient) covers the varying-axes declarations every kernel
# makes through one helper (kernels/common/manual_axes.py), whose jax API moves between versions.
smoke=(
    "test_export_for_tpu" "test_exports_for_tpu"
    "(test_rms_norm_matches_reference and tuned and 2048)"
    "(test_fused_add_rms_norm_matches_reference and tuned and 200)"
    "(test_rms_norm_gradients and tuned and bfloat16)"
    "(test_apply_rotary_matches_reference and ((interleaved-tuned and not partial) or partial-padded-small))"
    "(test_rms_norm_rope_matches_reference and decode-bf16-mxu)"
    "(test_apply_rotary_from_positions_matches_reference and proportional)"
    "(test_ragged_dot_matches_reference_and_lax and m7-tail-bf16-t-to-f16-tuned)"
    "(test_fused_epilogue_matches_reference and (interleaved-silu-bias-bf16-t-tuned or window-concat-silu-bias-tuned))"
    "(test_row_scale_and_its_gradient and concat-gelu-bf16-tuned)"
    "(test_experts_forward_matches_reference and (t7-interleaved-silu-bias-f32-grouped or t7-ungated-gelu-bias-bf16-t))"
    "(test_write_changes_exactly_the_named_slots and (bf16_page16 or bf16_head512_v256))"
    "(test_rope_and_write_matches_rotary_reference and bfloat16)"
    "test_rope_and_write_fp8_with_traced_scales_and_long_decode_rows"
    "(test_flash_attention.py and everything and not gradients)"
    "(test_paged_attention.py and everything and test_mixed_batch)"
    "(test_prefill_blocks_read_each_head_by_strided_loads and 256)"
    "test_rms_norm_sharded"
)
selection=$(printf ' or %s' "${smoke[@]}")
TPU_KERNELS_SMOKE_SELECTIONS=$(printf '%s\n' "${smoke[@]}") \
    exec $venv/bin/python -m pytest -p no:cacheprovider -k "${selection# or }" "$@"
