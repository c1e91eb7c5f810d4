"""Prefix reuse across requests, in shared pages: running requests and finished requests' rows kept as
cached sequences.

The engine's pool is paged (block_manager.py): each row maps its positions to pages. When a request
leaves, its row is not wiped: it becomes a cached sequence (the tokens whose KV its pages hold, and for
a hybrid target the recurrent and conv state at two points of it), kept until its row or its pages are
needed. A new request whose prompt starts with a running or cached sequence's tokens starts its
prefill after them: it takes that prefix's full pages by reference (the target's and the drafter's KV
both live in them) and a copy of the partial last page, or takes the cached row over where it lies.
N requests with one system prompt hold one copy of its full pages (token granularity all the same:
the partial page is copied).

A hybrid target's Gated DeltaNet state is one fixed-size block for the whole sequence so far, not one
per token, so a hybrid prefix can only be reused where a state was kept: the end of the sequence (the
row's live state when the request left: a completion continued with its own answer) and one point in
the prompt (a snapshot taken as the prefill passes it). That point is where the prompt's last chat turn
starts (its last turn-start token, Qwen's <|im_start|>), else the prompt's end: chat templates
re-render the previous answer and the generation prompt (Qwen3's drop the answer's think block and the
empty one the generation prompt opened), so the next turn's prompt leaves the cached sequence inside
the old assistant turn, and the last point it shares for sure is the start of that turn. A
pure-attention target can reuse any prefix length.

At least one prompt token is always computed (the first token's logits come from it), and a
speculative request reuses no further than the drafter's context was kept (an AR request's drafter
context is never written). A drafter with sliding-window layers keeps their keys in a ring per row
(draft_cache.py), at the row's end and at its prompt's snapshot point: a speculative prompt reusing L
tokens either prefills the window before its own end itself (L <= its length - `draft_reach`) or takes
one of those rings, which must lie at or before its end (a ring further on has moved past the window
its first draft reads). Eviction: least recently used, when an admission needs a row."""

from __future__ import annotations

from dataclasses import dataclass

COMPARE_BLOCK = 256  # tokens compared per slice in common_prefix (list equality runs in C)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    lo = 0
    while lo + COMPARE_BLOCK <= n and a[lo:lo + COMPARE_BLOCK] == b[lo:lo + COMPARE_BLOCK]:
        lo += COMPARE_BLOCK
    hi = min(n, lo + COMPARE_BLOCK)
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


class TokenView:
    """The first n tokens of head + tail without building the list (a running request's prompt and
    output: matched against at every admission, so no copy of a long context each time)."""

    def __init__(self, head: list[int], tail: list[int], n: int) -> None:
        self.head, self.tail, self.n = head, tail, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        if isinstance(index, slice):
            lo, hi, _ = index.indices(self.n)
            cut = len(self.head)
            return self.head[lo:min(hi, cut)] + self.tail[max(lo - cut, 0):max(hi - cut, 0)]
        if not 0 <= index < self.n:
            raise IndexError(index)
        return self.head[index] if index < len(self.head) else self.tail[index - len(self.head)]


@dataclass(eq=False)
class CachedSequence:
    row: int              # the pool row holding it
    tokens: list[int] | TokenView  # the sequence whose KV the row holds, positions 0..len-1
    snapshot_at: int      # where the prompt's state snapshot was taken (hybrid)
    draft_len: int        # positions of the drafter's context kept (0: none)
    last_used: int = 0    # the cache's clock when it was added or last reused
    live: bool = False    # a running request's row (its state moves on: a hybrid reuses its snapshot only)

    @property
    def end(self) -> int:
        return len(self.tokens)


@dataclass
class Hit:
    seq: CachedSequence
    length: int            # prompt tokens reused
    from_snapshot: bool    # the hybrid's state comes from the prompt's snapshot, not the sequence's end


@dataclass
class PrefixStats:
    lookups: int = 0       # admissions that looked for a prefix
    hits: int = 0          # ... and reused one
    tokens_saved: int = 0  # prompt tokens not recomputed
    evictions: int = 0     # cached sequences dropped for room


class PrefixCache:
    def __init__(self, snapshots_only: bool) -> None:
        """snapshots_only: a hybrid target (reuse only at a kept state)."""
        self.snapshots_only = snapshots_only
        self.draft_reach = 0  # positions before a prompt's end its first draft's sliding layers read (pool.py)
        self.by_row: dict[int, CachedSequence] = {}
        self.stats = PrefixStats()
        self._clock = 0

    def __len__(self) -> int:
        return len(self.by_row)

    def add(self, row: int, tokens: list[int], snapshot_at: int, draft_len: int) -> None:
        self._clock += 1
        self.by_row[row] = CachedSequence(row, tokens, snapshot_at, draft_len, self._clock)

    def lookup(self, prompt: list[int], speculative: bool, live: list[CachedSequence] = (),
               count: bool = True) -> Hit | None:
        """The cached or `live` sequence (a running request's) that saves the most of `prompt`'s
        prefill, and how much (counted in the stats unless `count` is False: an admission's check;
        the caller shares the prefix's pages)."""
        if count:
            self.stats.lookups += 1
        best: Hit | None = None
        windowed = speculative and self.draft_reach > 0
        for seq in (*self.by_row.values(), *live):
            limit = min(common_prefix(prompt, seq.tokens), len(prompt) - 1)
            if speculative:
                limit = min(limit, seq.draft_len)
            points = [(limit, False)]  # (length, whether the state comes from the prompt's snapshot)
            if self.snapshots_only:
                kept = (seq.snapshot_at,) if seq.live else (seq.end, seq.snapshot_at)
                points = [(p, seq.live or p != seq.end) for p in kept if p <= limit]
            elif windowed:
                points += [(min(limit, seq.snapshot_at), True), (min(limit, len(prompt) - self.draft_reach), False)]
            if windowed:
                points = [point for point in points if self._window_served(seq, *point, len(prompt))]
            length, from_snapshot = max(points, default=(0, False), key=lambda point: point[0])
            if length > 0 and (best is None or length > best.length):
                best = Hit(seq, length, from_snapshot)
        if best is not None and count:
            self._clock += 1
            best.seq.last_used = self._clock
            self.stats.hits += 1
            self.stats.tokens_saved += best.length
        return best

    def _window_served(self, seq: CachedSequence, length: int, from_snapshot: bool, prompt: int) -> bool:
        """Whether a prompt of `prompt` tokens reusing `length` of `seq` has its first draft's sliding
        keys: its prefill writes them, or seq's ring at the point it comes from (its end, or its
        snapshot point) holds them: a ring the sequence's drafting wrote (an AR row's is not), lying at
        or before the prompt's end."""
        if length <= prompt - self.draft_reach:
            return True
        point = seq.snapshot_at if from_snapshot else seq.end
        return 0 < point <= min(seq.draft_len, prompt) and (from_snapshot or seq.draft_len == seq.end)

    def pop(self, row: int) -> CachedSequence | None:
        return self.by_row.pop(row, None)

    def evict(self, seq: CachedSequence) -> None:
        del self.by_row[seq.row]
        self.stats.evictions += 1

    def least_recent(self, spare: tuple[CachedSequence | None, ...]) -> CachedSequence | None:
        """The least recently used cached sequence other than those in `spare`."""
        candidates = [s for s in self.by_row.values() if all(s is not k for k in spare)]
        return min(candidates, key=lambda s: s.last_used, default=None)

    def clear(self) -> None:
        self.by_row.clear()


def snapshot_point(prompt: list[int], turn_token: int | None, reused: int) -> int:
    """Where a hybrid request's prompt state is kept: at its last turn-start token (the chat turn being
    answered starts there), if that lies past what it reused; else at the prompt's end."""
    if turn_token is not None:
        for i in range(len(prompt) - 1, reused, -1):
            if prompt[i] == turn_token:
                return i
    return len(prompt)
