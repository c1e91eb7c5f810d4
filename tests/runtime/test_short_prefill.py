"""A short prompt piece at a fixed shape (engine/runner.py's PrefillRunner, graphed on CUDA): padded to a
width bucket, its keys to a bucket, over a static copy of its row's block table. On the CPU the same
padding and bucketing run without the graph, and must leave what the eager causal pass leaves: the
piece's hidden states, drafter features and KV, whatever row the request holds and however much padding
its width bucket adds; the positions before the piece are untouched."""

import pytest
import torch

from ddtree_runtime.engine import Engine, EngineConfig
from ddtree_runtime.engine.runner import PREFILL_WIDTHS, prefill_kv_len, prefill_width

PAGE = 8


def test_widths_and_key_buckets():
    assert [prefill_width(n) for n in (1, 32, 33, 200, 512, 513)] == [32, 32, 64, 256, 512, None]
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


def test_a_hybrid_runs_its_short_pieces_eagerly(tiny_hybrid_models):
    """A hybrid's recurrent state would run on over the padding: no fixed-shape prompt pass."""
    engine = Engine(EngineConfig(str(tiny_hybrid_models / "target"), str(tiny_hybrid_models / "draft"),
                                 page_size=PAGE, max_running=2))
    assert engine.runner.prefill_runner is None
