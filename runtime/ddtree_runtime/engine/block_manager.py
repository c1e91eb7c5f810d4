"""The KV pool's pages: a free list, reference counts, and a block table per pool row.

A page holds PAGE_SIZE consecutive positions of one sequence, for every layer of the target and every
full layer of the drafter (one page id covers both caches; its sliding layers keep rings: draft_cache.py). A row's block table maps its logical position p to the
physical slot table[row, p // page_size] * page_size + p % page_size. Page 0 is the scratch page:
never handed out, it is what every unassigned table entry points at, so a pass may write its padding
(pad rows, pad nodes, positions past a row's pages) anywhere without touching a live page, and the
graphed passes read fixed-shape tables. A page may be held by several rows (a shared prompt prefix):
only full pages below what every holder has computed are shared; a partial page is copied."""

from __future__ import annotations

from collections import deque

import torch

SCRATCH_PAGE = 0


class BlockManager:
    """Page ids 1..num_pages, each with a reference count; freed pages go back to the free list."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need at least one page of at least one token, got {num_pages} x {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.free: deque[int] = deque(range(1, num_pages + 1))
        self.refs = [0] * (num_pages + 1)
        self.shared_pages = 0  # pages held by more than one row (kept as a count: read every step)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def free_pages(self) -> int:
        return len(self.free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self.free)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages (reference 1), or None (nothing taken) when fewer are free."""
        if n > len(self.free):
            return None
        pages = [self.free.popleft() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] += 1
            self.shared_pages += self.refs[p] == 2

    def release(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] -= 1
            self.shared_pages -= self.refs[p] == 1
            if self.refs[p] == 0:
                self.free.append(p)
            elif self.refs[p] < 0:
                raise RuntimeError(f"page {p} released more often than held")


class PageTable:
    """Each pool row's pages, on the host (lists) and on the device (`block`, [rows, width] long, the
    attention paths' input: a fixed-size buffer, so CUDA graphs capture it). Device updates are
    queued copies from pinned memory: they follow the passes already queued and never wait for them."""

    def __init__(self, manager: BlockManager, rows: int, width: int, device: torch.device) -> None:
        self.manager, self.width, self.device = manager, width, device
        self.page_size = manager.page_size
        self.pages: list[list[int]] = [[] for _ in range(rows)]
        self.block = torch.full((rows, width), SCRATCH_PAGE, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        """Logical positions a row addresses (those past its pages are the scratch page)."""
        return self.width * self.page_size

    def _put(self, row: int, lo: int, pages: list[int]) -> None:
        values = torch.tensor(pages, dtype=torch.long)
        if self.device.type == "cuda":
            values = values.pin_memory()  # the caching host allocator keeps it until the copy is done
        self.block[row, lo:lo + len(pages)].copy_(values, non_blocking=True)

    def grow(self, row: int, tokens: int) -> bool:
        """Back positions 0..tokens-1 of `row` with pages; False (nothing taken) when too few are free."""
        held = self.pages[row]
        need = self.manager.pages_for(tokens) - len(held)
        if need <= 0:
            return True
        if len(held) + need > self.width:
            raise RuntimeError(f"row {row} would need {len(held) + need} pages, the table holds {self.width}")
        fresh = self.manager.allocate(need)
        if fresh is None:
            return False
        self._put(row, len(held), fresh)
        held.extend(fresh)
        return True

    def shortfall(self, row: int, tokens: int) -> int:
        """Pages `grow(row, tokens)` would take."""
        return max(0, self.manager.pages_for(tokens) - len(self.pages[row]))

    def truncate(self, row: int, tokens: int, writable: bool = True) -> tuple[int, int] | None:
        """Keep only the pages of positions 0..tokens-1; `writable`: the page that position `tokens`
        falls in, if kept and shared, is replaced by a private copy (the row writes there next).
        Returns (source, copy) pages for the caller to copy the content of, or None. RuntimeError: no
        page free for the copy."""
        held = self.pages[row]
        keep = self.manager.pages_for(tokens)
        if keep < len(held):
            self.manager.release(held[keep:])
            del held[keep:]
            self.block[row, keep:].fill_(SCRATCH_PAGE)
        if not writable or tokens % self.page_size == 0 or not held or self.manager.refs[held[-1]] == 1:
            return None
        return self._private_last(row)

    def _private_last(self, row: int) -> tuple[int, int]:
        held = self.pages[row]
        fresh = self.manager.allocate(1)
        if fresh is None:
            raise RuntimeError("no free page for a copy-on-write")
        src = held[-1]
        self.manager.release([src])
        held[-1] = fresh[0]
        self._put(row, len(held) - 1, fresh)
        return src, fresh[0]

    def share(self, src: int, dst: int, tokens: int) -> tuple[int, int] | None:
        """Row dst (empty) starts with src's first `tokens` positions: its full pages by reference, the
        partial last one as a fresh page. Returns (source, copy) for the partial page, or None."""
        if self.pages[dst]:
            raise RuntimeError(f"row {dst} is not empty")
        full, part = divmod(tokens, self.page_size)
        shared = self.pages[src][:full]
        self.manager.share(shared)
        self.pages[dst] = list(shared)
        if shared:
            self._put(dst, 0, shared)
        if not part:
            return None
        fresh = self.manager.allocate(1)
        if fresh is None:
            raise RuntimeError("no free page for a shared prefix's last page")
        self.pages[dst].append(fresh[0])
        self._put(dst, full, fresh)
        return self.pages[src][full], fresh[0]

    def release(self, row: int) -> int:
        """Give back the row's pages (shared ones stay with their other holders); returns how many."""
        held = self.pages[row]
        self.manager.release(held)
        self.pages[row] = []
        self.block[row].fill_(SCRATCH_PAGE)
        return len(held)

    def move(self, dst: list[int], src: list[int]) -> None:
        """Row dst[i] takes row src[i]'s pages; a source row that is no destination is left empty. Every
        destination must be empty or a source itself (nothing is dropped here: release first)."""
        if not dst:
            return
        lists = [self.pages[s] for s in src]
        for s in src:
            self.pages[s] = []
        for d, held in zip(dst, lists):
            if self.pages[d]:
                raise RuntimeError(f"row {d} still holds pages")
            self.pages[d] = held
        d, s = (torch.tensor(rows, device=self.device) for rows in (dst, src))
        self.block.index_copy_(0, d, self.block.index_select(0, s))
        vacated = sorted(set(src) - set(dst))
        if vacated:
            self.block[torch.tensor(vacated, device=self.device)] = SCRATCH_PAGE

    def reset(self) -> None:
        for row in range(len(self.pages)):
            if self.pages[row]:
                self.release(row)
