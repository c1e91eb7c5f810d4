"""Serving a set of requests on an Engine the way the tests compare runs: all submitted at once, then
steps until the engine is idle."""

from __future__ import annotations

from collections.abc import Callable

from ddtree_runtime.engine import Engine, SamplingParams


def serve(engine: Engine, jobs: list[tuple[list[int], SamplingParams]],
          watch: Callable[[Engine], None] | None = None) -> list[list[int]]:
    """Each job's (prompt, params) tokens, in the order given; `watch(engine)` after every step."""
    ids = [engine.submit(prompt, p) for prompt, p in jobs]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_work:
        for request_id, o in engine.step():
            out[request_id] += o.token_ids
        if watch is not None:
            watch(engine)
    return [out[i] for i in ids]
