"""A short prompt piece at a fixed shape (engine/runner.py's PrefillRunner, graphed on CUDA): padded to a
width bucket, its keys to a bucket, over a static copy of its row's block table. On the CPU the same
padding and bucketing run without the graph, and must leave what the eager causal pass leaves: the
piece's hidden states, drafter features and KV, whatever row the request holds and however much padding
its width bucket adds; the positions before the piece are untouched. A hybrid's piece also leaves the
eager pass's recurrent state and conv tail, and its snapshot where the piece holds the snapshot point."""

import pytest
import torch

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine.runner import PREFILL_WIDTHS, prefill_kv_len, prefill_width

PAGE = 8


def test_widths_and_key_buckets():
    assert [prefill_width(n) for n in (1, 32, 33, 200, 260, 512, 513)] == [32, 32, 64, 256, 384, 512, None]
    assert PREFILL_WIDTHS == tuple(sorted(PREFILL_WIDTHS))
    # graphed: a doubling of 512 keys (few graphs); eager: the CPU's small bucket; never past the cache
    assert [prefill_kv_len(n, 1 << 20, True) for n in (1, 512, 513, 16_600, 40_000)] == [512, 512, 1024, 32_768, 65_536]
    assert prefill_kv_len(16_600, 20_000, True) == 20_000 and prefill_kv_len(100, 20_000, False) == 128


@pytest.fixture(scope="module")
def engine(tiny_models) -> Engine:
    return Engine(EngineConfig(str(tiny_models / "target"), str(tiny_models / "draft"), page_size=PAGE,
                               max_running=3, prefix_cache=False))


@pytest.mark.parametrize("prefix,length", [(0, 5), (40, 1), (37, 32), (53, 33), (120, 200)])
@torch.inference_mode()
def test_a_padded_piece_leaves_what_the_eager_pass_leaves(engine, prefix, length):
    runner, cache, table = engine.runner, engine.runner.target_cache, engine.page_table
    short = runner.prefill_runner
    gen = torch.Generator().manual_seed(prefix + length)
    ids = torch.randint(0, engine.target.config.vocab_size, (prefix + length,), generator=gen).tolist()
    eager_row, short_row = 0, 2  # the graph's table is a copy: any row gives the same pass
    try:
        for row in (eager_row, short_row):
            assert table.grow(row, prefix + length)
            if prefix:  # the row's cached prefix, eagerly
                engine.target(torch.tensor([ids[:prefix]]), torch.arange(prefix)[None], cache.rows(row, row + 1))
        held_before = cache.held(short_row, prefix)
        piece, pos = torch.tensor([ids[prefix:]]), torch.arange(prefix, prefix + length)[None]
        h_eager, f_eager = engine.target(piece, pos, cache.rows(eager_row, eager_row + 1), start=prefix)
        h, feats, positions = short.run(short_row, ids[prefix:], prefix)
        assert h.shape[1] == prefill_width(length) and positions[0, :length].tolist() == pos[0].tolist()
        torch.testing.assert_close(h[:, :length], h_eager, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(feats[:, :length], f_eager, atol=1e-5, rtol=1e-5)
        for kept, eager in zip(cache.held(short_row, prefix + length), cache.held(eager_row, prefix + length)):
            torch.testing.assert_close(kept, eager, atol=1e-5, rtol=1e-5)
        for kept, before in zip(cache.held(short_row, prefix), held_before):
            assert torch.equal(kept, before)  # the padding lands past the piece
        again = short.run(short_row, ids[prefix:], prefix)[0]
        assert torch.equal(again, h)  # the same bucket again: the same pass
    finally:
        table.release(eager_row)
        table.release(short_row)


@pytest.fixture(scope="module")
def hybrid(tiny_hybrid_models) -> Engine:
    """With reuse on: the cache keeps each row's snapshot state."""
    return Engine(EngineConfig(str(tiny_hybrid_models / "target"), str(tiny_hybrid_models / "draft"),
                               page_size=PAGE, max_running=3))


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """The attention of the eager pass (causal SDPA) and of the padded one (a bias over the cache) may
    round differently; the linear layers' part is exact (test_gdn_chunk.py)."""
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def linear_state(cache, row: int) -> list[torch.Tensor]:
    """A hybrid row's conv tail and recurrent state, live and kept (copies)."""
    return [t[:, row].clone() for t in (cache.conv, cache.state, cache.snap_conv, cache.snap_state)]


# (prefix, length, keep): from the prompt's start and after a cached prefix; one chunk and several;
# more chunks of padding than of tokens (129 in 256); the snapshot point at the piece's first token, at
# its end, inside the conv window of the start, and across a chunk boundary
HYBRID_CASES = [(0, 5, None), (0, 70, 70), (40, 1, None), (37, 33, 2), (53, 129, 1), (120, 200, 130), (8, 64, None)]


@pytest.mark.parametrize("prefix,length,keep", HYBRID_CASES)
@torch.inference_mode()
def test_a_hybrid_padded_piece_leaves_what_the_eager_pass_leaves(hybrid, prefix, length, keep):
    """The padding's gates and betas are zeroed, so the linear layers' state passes through it: the
    hidden states, features, KV, conv tail and state after the piece (and the snapshot where the piece
    holds the snapshot point) are the eager pass's, in a row that held another sequence's state
    before; the other rows' state is untouched."""
    engine = hybrid
    cache, table, short = engine.runner.target_cache, engine.page_table, engine.runner.prefill_runner
    gen = torch.Generator().manual_seed(prefix + length)
    ids = torch.randint(0, engine.target.config.vocab_size, (prefix + length,), generator=gen).tolist()
    eager_row, short_row, other = 0, 2, 1
    try:
        for row in (eager_row, short_row, other):
            assert table.grow(row, prefix + length)
            for t in (cache.conv, cache.state, cache.snap_conv, cache.snap_state):  # what a row held before
                t[:, row] = torch.randn(t[:, row].shape, generator=gen).to(t.dtype)
            if prefix:  # the row's cached prefix, eagerly
                engine.target(torch.tensor([ids[:prefix]]), torch.arange(prefix)[None], cache.rows(row, row + 1))
        held_before, others = cache.held(short_row, prefix), linear_state(cache, other)
        piece, pos = torch.tensor([ids[prefix:]]), torch.arange(prefix, prefix + length)[None]
        rows = cache.rows(eager_row, eager_row + 1)
        rows.keep_at = keep
        h_eager, f_eager = engine.target(piece, pos, rows, start=prefix)
        h, feats, positions = short.run(short_row, ids[prefix:], prefix, keep)
        assert h.shape[1] == prefill_width(length) and positions[0, :length].tolist() == pos[0].tolist()
        close(h[:, :length], h_eager)
        close(feats[:, :length], f_eager)
        for kept, eager in zip(cache.held(short_row, prefix + length), cache.held(eager_row, prefix + length)):
            close(kept, eager)
        for kept, before in zip(cache.held(short_row, prefix), held_before):
            assert torch.equal(kept, before)  # the padding lands past the piece
        got, want = linear_state(cache, short_row), linear_state(cache, eager_row)
        for a, b in zip(got, want if keep is not None else want[:2]):
            close(a, b)
        assert all(torch.equal(a, b) for a, b in zip(linear_state(cache, other), others))
    finally:
        for row in (eager_row, short_row, other):
            table.release(row)


def test_a_hybrid_runs_its_short_pieces_through_the_runner(hybrid, monkeypatch):
    """The engine sends a hybrid's short prompt to the fixed-shape pass, with its snapshot point (the
    last turn start); the same prompt again resumes from the state that pass kept, through the eager
    pass, and gives the same tokens."""
    turn = hybrid.scheduler.turn_token
    assert turn is not None
    prompt = [turn] + list(range(3, 30)) + [turn] + list(range(40, 45))
    params = SamplingParams(max_new_tokens=6, mode="ddtree")
    calls = []
    run = hybrid.runner.prefill_runner.run
    monkeypatch.setattr(hybrid.runner.prefill_runner, "run", lambda *a: calls.append(a[1:]) or run(*a))
    padded = [t for r in hybrid.generate(prompt, params) for t in r.token_ids]
    assert calls == [(prompt, 0, 28)]  # the snapshot after the tokens before the second turn start
    monkeypatch.setattr(hybrid.runner, "prefill_runner", None)
    saved = hybrid.stats.prefix_tokens_saved
    assert [t for r in hybrid.generate(prompt, params) for t in r.token_ids] == padded
    assert hybrid.stats.prefix_tokens_saved - saved == 28
