"""Modeled times: the kernel, the default implementation and any further baselines of every case through the static
performance model.

The compiles are batched: `perf_model.model_functions` compiles a chunk of functions in one subprocess (a lone
compile is ~3-5 s here, most of it the subprocess's start: importing jax and loading libtpu). Chunks run on a thread
pool of `workers` (default 2: one chunk's host-side traffic analysis, which evaluates the routing/metadata on the
CPU, overlaps another's compile subprocess).
"""

from __future__ import annotations

import concurrent.futures

from . import perf_model
from . import suite as _suite

IMPLS = _suite.IMPLS
CHUNK = 12  # functions per compile subprocess (a progress step each chunk; bounds a crash's loss)


def _item(case: _suite.Case, impl: str):
    op = case.op
    args = op.model_args(case.shape) if op.model_args else op.specs(case.shape)
    return op.function(impl, case.shape), args


def run(cases: list[_suite.Case], gen: str, *, bar=None, workers: int | None = None) -> dict:
    """{(case id, impl): ProgramModel, or the Exception that modeling raised}, for every impl that applies."""
    workers = workers or 2
    keys = [(c, impl) for c in cases for impl, why_not in c.op.impls(c.shape).items() if why_not is None]
    chunks = [keys[i : i + CHUNK] for i in range(0, len(keys), CHUNK)]
    results = {}

    def model_chunk(chunk):
        items, out = [], {}
        for case, impl in chunk:
            try:
                items.append(((case, impl), _item(case, impl)))
            except Exception as e:  # noqa: BLE001 - one failing case must not lose the others
                out[(case.id, impl)] = e
        models = perf_model.model_functions([it for _, it in items], gen=gen) if items else []
        for ((case, impl), _), m in zip(items, models):
            out[(case.id, impl)] = m
        return out, len(chunk)

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for future in concurrent.futures.as_completed([pool.submit(model_chunk, ch) for ch in chunks]):
            out, n = future.result()
            results.update(out)
            if bar is not None:
                bar.update(n)
    return results
