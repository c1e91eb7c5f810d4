"""The paged KV pool (engine/block_manager.py), both tiny pairs: preemption forced by a tiny pool
changes no output (greedy and seeded sampling); concurrent requests with one system prompt hold one
copy of its full pages; prompts of a page size +-1 and trees crossing pages give transformers' greedy
tokens, and no page of a rejected branch is kept; a paged row holds what an unpaged prefill leaves;
a request the pool can never hold is refused at submit; a preempted request cancelled while it waits
leaves nothing held; a hybrid's cache re-sized for a bigger tree keeps the pool's pages."""

from __future__ import annotations

import pytest
import torch

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine.block_manager import BlockManager, PageTable
from ddtree_runtime.engine.kv_cache import target_cache
from ddtree_runtime.engine.prefill import prefill
from ddtree_devtools.engine_runs import serve
from ddtree_devtools.tiny_corpus import heldout_questions, mixed_prompts

PAGE = 8
MAX_NEW = 32
MODES = ("ddtree", "ar", "dflash")


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def models(request):
    return request.getfixturevalue("tiny_models" if request.param == "qwen3" else "tiny_hybrid_models")


def make(models, **kw) -> Engine:
    return Engine(EngineConfig(str(models / "target"), str(models / "draft"), page_size=PAGE, **kw))


@pytest.fixture(scope="module")
def reference_engine(models) -> Engine:
    return make(models, prefix_cache=False)


def alone(engine: Engine, prompt: list[int], p: SamplingParams) -> list[int]:
    return [t for r in engine.generate(prompt, p) for t in r.token_ids]


def test_block_manager_counts_references_and_copies_partial_pages():
    manager = BlockManager(6, 4)
    table = PageTable(manager, 3, 8, torch.device("cpu"))
    assert table.grow(0, 10) and table.pages[0] == [1, 2, 3] and manager.free_pages == 3
    assert table.block[0, :4].tolist() == [1, 2, 3, 0]              # unassigned entries: the scratch page
    assert table.share(0, 1, 9) == (3, 4)                          # two full pages shared, the third copied
    assert table.pages[1] == [1, 2, 4] and manager.shared_pages == 2
    assert table.truncate(0, 6) == (2, 5)                          # row 0 writes into shared page 2 next: a copy
    assert table.pages[0] == [1, 5] and manager.refs[2] == 1 and manager.refs[3] == 0
    assert not table.grow(2, 30) and table.pages[2] == []          # too few free: nothing taken
    table.move([2], [1])
    assert table.pages[1] == [] and table.pages[2] == [1, 2, 4] and table.block[1].tolist() == [0] * 8
    table.release(0)
    table.release(2)
    assert manager.free_pages == 6 and manager.shared_pages == 0


def test_preemption_by_a_tiny_pool_changes_no_output(models, reference_engine):
    """Six requests through a pool that holds one and a third of the longest: the newest are preempted (their
    pages given back) and recomputed from their tokens later; every output, greedy and seeded, is the
    request's alone; at the end every page is free."""
    prompts = mixed_prompts(reference_engine.tokenizer, 2, 5, 2, 9, cut=3)
    jobs = [(p, SamplingParams(max_new_tokens=MAX_NEW, mode=MODES[i % 3], ignore_eos=True)) for i, p in
            enumerate(prompts)]
    jobs += [(prompts[0], SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, seed=7, ignore_eos=True)),
             (prompts[2], SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, seed=3, mode="ar",
                                         ignore_eos=True))]
    want = [alone(reference_engine, p, sp) for p, sp in jobs]
    longest = max(len(p) for p in prompts) + MAX_NEW + 40
    tiny = make(models, max_running=4, prefix_cache=False, kv_pool_tokens=longest + longest // 3)
    assert serve(tiny, jobs) == want
    assert tiny.stats.preemptions > 0
    assert tiny.pages.free_pages == tiny.pages.num_pages


def test_concurrent_requests_share_a_system_prompts_pages(tiny_models):
    """Four requests with one long system prompt, submitted together: the first computes it, the
    others take its full pages by reference (one copy, counted in the block manager) and skip its
    prefill; each output is its own alone."""
    engine = make(tiny_models, max_running=4)
    plain = make(tiny_models, prefix_cache=False)
    system = " ".join(heldout_questions(6, seed=41))
    prompts = [engine.tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                     {"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)
               for q in heldout_questions(4, seed=42)]
    common = min(next(i for i, (a, b) in enumerate(zip(prompts[0], p)) if a != b) for p in prompts[1:])
    assert common > 6 * PAGE
    jobs = [(p, SamplingParams(max_new_tokens=MAX_NEW, mode=MODES[i % 3])) for i, p in enumerate(prompts)]
    seen = {}

    def watch(e: Engine) -> None:
        rows = [e.page_table.pages[r.slot] for r in e.scheduler.running]
        if len(rows) == 4 and "shared" not in seen:
            seen["shared"] = e.pages.shared_pages
            seen["first_pages"] = {tuple(pages[:common // PAGE]) for pages in rows}
            seen["used"] = e.pages.used_pages
            seen["held"] = sum(len(pages) for pages in rows)

    assert serve(engine, jobs, watch) == [alone(plain, p, sp) for p, sp in jobs]
    assert seen["shared"] >= common // PAGE and len(seen["first_pages"]) == 1       # one copy of the prompt
    assert seen["used"] <= seen["held"] - 3 * (common // PAGE)
    assert engine.stats.prefix_tokens_saved >= 3 * (common // PAGE) * PAGE


def test_page_boundaries_give_transformers_greedy(models):
    """Prompts of a page size -1, +0, +1 (and two pages +-1), trees of 17 nodes crossing pages every
    round: transformers' greedy tokens; a row never holds more pages than its context and one round
    need (a rejected branch's fresh page is written over next round, not kept), and once every request
    is done the pool holds only the cached sequences' own lengths (pages they share counted once)."""
    from transformers import AutoModelForCausalLM

    engine = make(models, max_running=3)
    hf = AutoModelForCausalLM.from_pretrained(str(models / "target"), dtype=torch.float32).eval()
    base = mixed_prompts(engine.tokenizer, 0, 0, 1, 13, cut=1)[0] * 4
    prompts = [base[:n] for n in (PAGE - 1, PAGE, PAGE + 1, 2 * PAGE - 1, 2 * PAGE + 1)]
    want = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                            eos_token_id=sorted(engine.eos_ids), pad_token_id=engine.tokenizer.pad_token_id)
        want.append(g[0, len(p):].tolist())
    jobs = [(p, SamplingParams(max_new_tokens=MAX_NEW, mode=("ddtree", "ar")[i % 2])) for i, p in enumerate(prompts)]

    def watch(e: Engine) -> None:
        for r in e.scheduler.running:
            reserve = e.sizing.round_reserve(e.scheduler.tree_slots(r))
            assert len(e.page_table.pages[r.slot]) <= -(-(r.n_ctx + reserve) // PAGE)

    assert serve(engine, jobs, watch) == want
    held = [engine.page_table.pages[seq.row] for seq in engine.prefix.by_row.values()]
    assert [len(pages) for pages in held] == [-(-seq.end // PAGE) for seq in engine.prefix.by_row.values()]
    assert engine.pages.used_pages == len({p for pages in held for p in pages})  # shared prefix pages once


def test_a_paged_row_holds_what_an_unpaged_prefill_leaves(models):
    """A prompt prefilled in 8-token chunks beside a running request (each chunk attending over the
    earlier ones through the block table): its row holds, to 1e-5, what one prefill into a contiguous
    cache leaves (the target's KV; a hybrid's recurrent state and conv tail)."""
    engine = make(models, max_running=2, max_batched_tokens=PAGE)
    prompt = (mixed_prompts(engine.tokenizer, 1, 17, 0, 0, cut=1)[0] * 3)[:45]
    engine.submit(prompt[:5], SamplingParams(max_new_tokens=200, mode="ar", ignore_eos=True))
    engine.step()
    rid = engine.submit(prompt, SamplingParams(max_new_tokens=4, mode="ar"))
    while engine.scheduler.find(rid) not in engine.scheduler.running:
        engine.step()
    req = engine.scheduler.find(rid)
    assert len(prompt) > 3 * PAGE and req.n_ctx == len(prompt)
    cache = target_cache(engine.target.config, 512, "cpu", torch.float32)
    with torch.inference_mode():
        prefill(engine.target, torch.tensor([prompt]), cache)
    got = engine.runner.target_cache.held(req.slot, len(prompt))
    n = len(prompt)
    torch.testing.assert_close(got[0], cache.k[:, 0, :, :n], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[1], cache.v[:, 0, :, :n], atol=1e-5, rtol=1e-4)
    if hasattr(cache, "state"):
        torch.testing.assert_close(engine.runner.target_cache.state[:, req.slot], cache.state[:, 0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(engine.runner.target_cache.conv[:, req.slot], cache.conv[:, 0], atol=1e-5, rtol=1e-4)


def test_a_request_the_pool_can_never_hold_is_refused_at_submit(tiny_models):
    engine = make(tiny_models, kv_pool_tokens=20 * PAGE)
    with pytest.raises(ValueError, match="needs .* KV pages of 8 tokens, the pool holds 20"):
        engine.submit([1] * 100, SamplingParams(max_new_tokens=100))
    assert not engine.has_work
    cap = engine.capacity()
    assert cap["tokens"] == 20 * PAGE and cap["pages_free"] == 20 and cap["requests_full_context"] == 0


def test_cancelling_a_preempted_request_frees_everything(models, reference_engine):
    """A request preempted, then cancelled while it waits to be recomputed, and one cancelled while
    running beside it: the others' outputs are their own alone, and no page stays held."""
    prompts = mixed_prompts(reference_engine.tokenizer, 3, 8, 0, 0, cut=1)
    jobs = [(p, SamplingParams(max_new_tokens=MAX_NEW, mode=MODES[i % 3], ignore_eos=True)) for i, p in
            enumerate(prompts)]
    want = [alone(reference_engine, p, sp) for p, sp in jobs]
    longest = max(len(p) for p in prompts) + MAX_NEW + 40
    engine = make(models, max_running=3, prefix_cache=False, kv_pool_tokens=longest + longest // 3)
    ids = [engine.submit(p, sp) for p, sp in jobs]
    out = {i: [] for i in ids}
    cancelled = set()
    while engine.has_work:
        for request_id, o in engine.step():
            out[request_id] += o.token_ids
        preempted = [r for r in engine.scheduler.waiting if r.preempted]
        if preempted and not cancelled:
            cancelled.add(preempted[0].id)
            engine.cancel(preempted[0].id)
    assert cancelled and engine.stats.preemptions > 0
    assert [out[i] for i in ids if i not in cancelled] == [w for i, w in zip(ids, want) if i not in cancelled]
    assert engine.pages.free_pages == engine.pages.num_pages and engine.pages.shared_pages == 0


def test_a_hybrid_pool_re_sized_for_a_bigger_tree_keeps_its_pages(tiny_hybrid_models):
    """A hybrid's tree scratch is per row: a request for a much bigger tree waits for an idle engine,
    the target cache is rebuilt over the same pages, and every output is the AR reference."""
    engine = make(tiny_hybrid_models, max_running=2)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Count from 1 to 60."}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    reference = alone(engine, prompt, SamplingParams(max_new_tokens=24, mode="ar"))
    pages = engine.pages.num_pages
    first = engine.submit(prompt, SamplingParams(max_new_tokens=24))
    out = {first: [t for _, o in engine.step() for t in o.token_ids]}
    big = engine.submit(prompt, SamplingParams(max_new_tokens=24, tree_budget=300))
    out[big] = []
    waited = False
    while engine.has_work:
        waited |= any(r.id == big for r in engine.scheduler.waiting) and bool(engine.scheduler.running)
        for request_id, o in engine.step():
            out.setdefault(request_id, []).extend(o.token_ids)
    assert waited and engine.pages.num_pages == pages
    assert out[big] == reference and out[first] == reference
