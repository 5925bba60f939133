"""Modeled times: the kernel, the default implementation and any further baselines of every case through the static
performance model.

The compiles are batched: `perf_model.model_functions` compiles a chunk of functions in one subprocess (a lone
compile is ~3-5 s here, most of it the subprocess's start: importing jax and loading libtpu). Chunks run on a thread
pool of `workers` (default 2: one chunk's host-side traffic analysis, which evaluates the routing/metadata on the
CPU, overlaps another's compile subprocess).
"""

from __future__ import annotations

import concurrent.futures

import jax

from . import perf_model
from . import suite as _suite

IMPLS = _suite.IMPLS
CHUNK = 12  # functions per compile subprocess (a progress step each chunk; bounds a crash's loss)


def case_item(case: _suite.Case, impl: str):
    """(the function, the model's arguments) of `case`'s `impl`: what the model compiles for it. An op measured in
    place (`Op.in_place`) is modeled in place too: its in-place function, the state's shapes first and donated."""
    op = case.op
    args = op.model_args(case.shape) if op.model_args else op.specs(case.shape)
    if op.in_place is not None and impl in op.in_place.functions:
        state = jax.eval_shape(lambda: op.in_place.state(case.shape, 0))  # shapes only: nothing is allocated
        fn = perf_model.donated(op.in_place_function(impl, case.shape), range(op.in_place.n_state))
        return fn, (*state, *args)
    return op.function(impl, case.shape), args


def run(cases: list[_suite.Case], gen: str, *, bar=None, workers: int | None = None) -> dict:
    """{(case id, impl): ProgramModel, or the Exception that modeling raised}, for every impl that applies."""
    keys = [(c, impl) for c in cases for impl, why_not in c.op.impls(c.shape).items() if why_not is None]
    return run_items(
        [((c.id, impl), lambda c=c, impl=impl: case_item(c, impl)) for c, impl in keys], gen, bar=bar, workers=workers
    )


def run_items(items, gen: str, *, bar=None, workers: int | None = None) -> dict:
    """{key: ProgramModel, or the Exception that modeling raised} for items (key, build), build() -> (fn, args)."""
    workers = workers or 2
    chunks = [items[i : i + CHUNK] for i in range(0, len(items), CHUNK)]
    results = {}

    def model_chunk(chunk):
        built, out = [], {}
        for key, build in chunk:
            try:
                built.append((key, build()))
            except Exception as e:  # noqa: BLE001 - one failing case must not lose the others
                out[key] = e
        models = perf_model.model_functions([it for _, it in built], gen=gen) if built else []
        for (key, _), m in zip(built, models):
            out[key] = m
        return out, len(chunk)

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for future in concurrent.futures.as_completed([pool.submit(model_chunk, ch) for ch in chunks]):
            out, n = future.result()
            results.update(out)
            if bar is not None:
                bar.update(n)
    return results
