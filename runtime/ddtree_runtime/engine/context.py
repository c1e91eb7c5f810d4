"""How long a context the engine serves: the model's own positions unless configured, bounded by what
its caches and a prefill's activations can take of the device's free memory, chosen once at start."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

MIN_CONTEXT = 512  # a default shortened below this is of no use: refuse to start instead


def serving_context(configured: int | None, positions: int, needed_bytes: Callable[[int], int], free: int,
                    device: str) -> int:
    """The engine's max context: `configured`, else the model's `positions` shortened to the longest
    context whose caches and prefill (`needed_bytes(context)`, growing with it) fit in `free` bytes.
    ValueError, naming the longest that fits, when a configured context cannot."""
    if configured is not None and configured > positions:
        raise ValueError(f"max_context {configured} exceeds the target's max_position_embeddings {positions}")
    wanted = positions if configured is None else configured
    if needed_bytes(wanted) <= free:
        return wanted
    lo, hi = 0, wanted  # needed_bytes(lo) fits (or lo is 0), needed_bytes(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if needed_bytes(mid) <= free else (lo, mid)
    what = (f"max context {wanted}" if configured is not None
            else f"the target's {positions} positions")
    short = (f"{what} needs {needed_bytes(wanted) / 2**30:.1f} GiB for the caches and a prefill's activations, "
             f"but {free / 2**30:.1f} GiB of {device} is free")
    if configured is None and lo >= MIN_CONTEXT:
        log.warning("%s; serving a context of %d tokens", short, lo)
        return lo
    if configured is not None and lo > 0:
        fix = f"the longest context that fits is {lo} tokens: set max context to that or less"
    else:
        fix = f"not even {MIN_CONTEXT} tokens fit: use a larger device"
    raise ValueError(f"{short}: {fix}, or lower the tree budget")
