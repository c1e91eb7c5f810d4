"""Who runs this step: the waiting queue, the running batch and the cache slots they hold.

Slots are the batch rows of the engine's cache pool. The running requests always hold slots 0..R-1 in
order, so a batched pass works on the first rows of the pool (a view, no gather); the one request
being prefilled holds slot R. When a request leaves, the last running one moves into its slot (and the
prefilling one down after it): the engine copies those rows, at most two, once per departure."""

from __future__ import annotations

from collections import deque

from .types import RequestState


class Scheduler:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []   # running[i].slot == i
        self.prefilling: RequestState | None = None

    def __len__(self) -> int:
        """Requests in the engine: waiting, prefilling and running."""
        return len(self.waiting) + len(self.running) + (self.prefilling is not None)

    def add(self, req: RequestState) -> None:
        self.waiting.append(req)

    def next_prefill(self, admissible) -> RequestState | None:
        """The request to prefill now: the one in progress, else the head of the queue if a slot is
        free and `admissible(req)` (the engine's check that the pool can take it now); first come,
        first served, so a request that must wait holds back the ones behind it."""
        if self.prefilling is None and self.waiting and len(self.running) < self.slots \
                and admissible(self.waiting[0]):
            self.prefilling = self.waiting.popleft()
            self.prefilling.slot = len(self.running)
        return self.prefilling

    def start_running(self, req: RequestState) -> None:
        """A prefill finished: the request joins the batch (it already holds the next slot)."""
        self.prefilling = None
        self.running.append(req)

    def find(self, request_id: int) -> RequestState | None:
        for req in (*self.running, self.prefilling, *self.waiting):
            if req is not None and req.id == request_id:
                return req
        return None

    def remove(self, req: RequestState) -> list[tuple[int, int]]:
        """Take `req` out wherever it is; returns the slot moves (src, dst), in order, that keep the
        running requests in slots 0..R-1 and the prefilling one right after them."""
        if req in self.waiting:
            self.waiting.remove(req)
            return []
        if req is self.prefilling:
            self.prefilling = None
            return []
        moves = []
        last = self.running.pop()
        if last is not req:
            moves.append((last.slot, req.slot))
            last.slot = req.slot
            self.running[req.slot] = last
        if self.prefilling is not None:
            moves.append((self.prefilling.slot, len(self.running)))
            self.prefilling.slot = len(self.running)
        req.slot = -1
        return moves
