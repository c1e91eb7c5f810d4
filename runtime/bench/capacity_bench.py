"""What the paged pool holds on a 96 GB card, measured: the H200 with the memory above a RTX PRO 6000's
97,887 MiB held back by one allocation, random weights of a real shape (gpu_bench.build_models).

    PYTHONPATH=runtime:runtime/bench python runtime/bench/capacity_bench.py --shape qwen3.6-27b \\
        [--card-mib 97887] [--parts share,batch,long] [--out F]

Parts (each adds its figures to the JSON; share runs first, on the fresh pool, so no cached sequence
holds pages it would count):
- always, the pool: its tokens against the memory arithmetic two ways: (a) the card's memory after the
  weights, all of it (mem_fraction 1.0): the free memory measured once the weights are in, less a
  prefill's workspace and the rows' state, over a token's KV bytes (the "pool >= 95%" target's measure,
  as issue 24's first figures); (b) capacity.py's estimate for this card at the configured mem_fraction
  (ddops's plan line for the host: the card's total memory, the weights counted from the configs);
- batch: `--requests` requests of `--prompt` random tokens and `--answer` tokens each (ignore_eos), all
  submitted at once: the most running together (the batch size /metrics shows), wall time, tokens/s;
- long: one request of the full context (max_context - 16 prompt tokens, 16 answer tokens) is admitted
  and finishes: its time to first token;
- share: `--requests` requests with one shared `--system` token system prompt and their own 256-token
  turns (each starting with a turn-start token, as a chat template lays them out), submitted together:
  the most pages in use against one copy of the system prompt plus every tail (target: at most 1.2x),
  and a second turn's time to first token against the first's (at most 10%).
After each part: torch's peak allocated and reserved memory in it, the peak above what was allocated
when it began (long: the 131K prefill's activations, against the workspace the pool was sized with), and
the card's free memory (what mem_fraction's headroom was used for).
Not a test: figures depend on the machine."""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

import torch

import ddtree_runtime.engine.memory as memory
from ddtree_runtime import capacity
from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_bench import SHAPES, build_models, nbytes

MIB = 2**20
TAIL = 256
TURN_START = 1  # stands for <|im_start|> (random prompts draw no token below 1000, or below a small vocabulary's 1/4)


def hold_back(card_mib: int) -> torch.Tensor | None:
    """Take, in one allocation, what this GPU has beyond a card of `card_mib` MiB."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    extra = total - card_mib * MIB
    return torch.empty(extra, dtype=torch.uint8, device="cuda") if extra > 0 else None


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_bytes() -> int:
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else memory.free_bytes(torch.device("cpu"))


class Peaks:
    """Torch's peak allocated and reserved memory in each part, and the peak above what was allocated
    when the part began (its activations, beside the weights and the pool)."""

    def __init__(self) -> None:
        self.start = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0

    def take(self, report: dict, part: str) -> None:
        """Record the part's peaks, then reset them for the next part."""
        if not torch.cuda.is_available():
            return
        report.setdefault("peaks_mib", {})[part] = {
            "allocated": torch.cuda.max_memory_allocated() / MIB, "reserved": torch.cuda.max_memory_reserved() / MIB,
            "allocated_above_start": (torch.cuda.max_memory_allocated() - self.start) / MIB,
            "free_now": torch.cuda.mem_get_info()[0] / MIB}
        torch.cuda.reset_peak_memory_stats()
        self.start = torch.cuda.memory_allocated()


def config_dicts(target, drafter) -> tuple[dict, dict]:
    """The random models' configs as the config.json dicts capacity.py reads (ddops reads the checkpoints')."""
    dcfg = drafter.config
    windows = [dcfg.layer_attention(i).window for i in range(dcfg.num_hidden_layers)]
    layout = {"layer_types": ["full_attention" if w is None else "sliding_attention" for w in windows]}
    if any(w is not None for w in windows):  # z-lab's fields for the sliding layers (drafter_layout.py)
        layout |= {"use_sliding_window": True, "sliding_window": max(w for w in windows if w is not None)}
    return dataclasses.asdict(target.config), {**dataclasses.asdict(dcfg), **layout, "block_size": dcfg.block_size,
                                               "dflash_config": {"target_layer_ids": list(dcfg.target_layer_ids)}}


def random_prompt(vocab: int, n: int, g: torch.Generator) -> list[int]:
    low = min(1000, vocab // 4)  # clear of the special tokens at either end
    return torch.randint(low, vocab - low, (n,), generator=g).tolist()


def run_all(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> dict:
    """Submit every job at once and step until all finish: the most running together and in use."""
    sync()
    t0 = time.perf_counter()
    ids = [engine.submit(p, q) for p, q in jobs]
    first: dict[int, float] = {}
    tokens, most_running, most_batch, most_pages, most_shared = 0, 0, 0, 0, 0
    while engine.has_work:
        outs = engine.step()
        now = time.perf_counter()
        for i, out in outs:
            first.setdefault(i, now - t0)
            tokens += len(out.token_ids)
        s = engine.stats
        most_running, most_batch = max(most_running, s.running), max(most_batch, s.batch_size)
        most_pages, most_shared = max(most_pages, s.pages_used), max(most_shared, s.pages_shared)
    sync()
    wall = time.perf_counter() - t0
    return {"requests": len(ids), "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "most_running": most_running, "most_batch_size": most_batch, "most_pages_used": most_pages,
            "most_pages_shared": most_shared, "ttft_s": [first.get(i) for i in ids],
            "preemptions": engine.stats.preemptions}


def first_token_s(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    sync()
    t0 = time.perf_counter()
    out, ttft = [], None
    for r in engine.generate(prompt, params):
        if ttft is None:
            sync()
            ttft = time.perf_counter() - t0
        out += r.token_ids
    return ttft, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.6-27b", choices=sorted(SHAPES))
    ap.add_argument("--card-mib", type=int, default=97887, help="the card to imitate (RTX PRO 6000: 97887)")
    ap.add_argument("--max-context", type=int, default=131072)
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--tree-budget", type=int, default=16)
    ap.add_argument("--mem-fraction", type=float, default=None, help="default: the engine's")
    ap.add_argument("--parts", default="share,batch,long")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--answer", type=int, default=1024)
    ap.add_argument("--system", type=int, default=16384)
    ap.add_argument("--out", default="bench/results/runtime-capacity-bench.json")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    report: dict = {"args": vars(args), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
                    "python": platform.python_version()}

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))

    blocker = hold_back(args.card_mib)
    report["held_back_mib"] = 0 if blocker is None else blocker.numel() // MIB
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a smoke run at a small shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, drafter = build_models(args.shape, device, dtype)
    target.config.max_position_embeddings = max(target.config.max_position_embeddings, args.max_context)
    report["weights_gib"] = (nbytes(target) + nbytes(drafter)) / 2**30
    free_after_weights = free_bytes()
    peaks = Peaks()
    extra = {} if args.mem_fraction is None else {"mem_fraction": args.mem_fraction}
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(target_dir=args.shape, draft_dir=None, device=device.type,
                                 dtype=str(dtype).removeprefix("torch."), max_context=args.max_context, max_running=args.max_running, mode="ddtree",
                                 tree_budget=args.tree_budget, **extra),
                    target=target, drafter=drafter, tokenizer=None)
    report["engine_build_s"] = time.perf_counter() - t0
    peaks.take(report, "engine")
    cap = engine.capacity()
    rows = engine.rows * engine.sizing.row_bytes(engine.tree_slots)
    workspace = engine.sizing.prefill_bytes(engine.max_context)
    ceiling = (free_after_weights - workspace - rows) * engine.page_size // engine.sizing.page_bytes()
    plan = capacity.pool_capacity(args.card_mib * MIB, *config_dicts(target, drafter),
                                  dtype=str(dtype).removeprefix("torch."), mem_fraction=engine.config.mem_fraction,
                                  max_running=args.max_running, max_context=engine.max_context,
                                  tree_budget=args.tree_budget, prefix_cache=engine.prefix is not None)
    report["pool"] = {**cap, "free_after_weights_gib": free_after_weights / 2**30,
                      "mem_fraction": engine.config.mem_fraction,
                      "token_bytes": engine.sizing.page_bytes() // engine.page_size,
                      "workspace_gib": workspace / 2**30, "row_state_gib": rows / 2**30,
                      # (a), issue 24's first measure (the keys it was written under)
                      "ceiling_tokens": ceiling, "share_of_ceiling": cap["tokens"] / ceiling,
                      "ceiling_is": "(a) the free memory measured after the weights, all of it (mem_fraction 1.0), "
                                    "less the prefill workspace and the rows' state, over a token's KV bytes",
                      "plan_tokens": plan.pool_tokens, "share_of_plan": cap["tokens"] / plan.pool_tokens,
                      "plan_is": f"(b) capacity.pool_capacity for a card of {args.card_mib} MiB at mem_fraction "
                                 f"{engine.config.mem_fraction:g}: ddops's plan line for the host",
                      "plan_breakdown": plan.breakdown()}
    print(f"pool: {cap['tokens']} tokens; holds {cap['requests_8k']} x 8K, {cap['requests_full_context']} x "
          f"{engine.max_context}\n"
          f"  (a) {cap['tokens'] / ceiling:.1%} of the card's memory after the weights at mem_fraction 1.0: {ceiling} "
          f"tokens ({free_after_weights / 2**30:.1f} GiB free after the weights, less a {workspace / 2**30:.1f} GiB "
          f"prefill workspace and {rows / 2**30:.1f} GiB of rows' state)\n"
          f"  (b) {cap['tokens'] / plan.pool_tokens:.1%} of capacity.py's estimate at mem_fraction "
          f"{engine.config.mem_fraction:g} (ddops's plan): {plan.pool_tokens} tokens ({plan.breakdown()})", flush=True)
    save()
    vocab, g = target.config.vocab_size, torch.Generator().manual_seed(0)

    if "share" in parts:
        # each prompt as a chat lays it out: the system prompt, then its own turn, starting with the
        # turn-start token (where a hybrid keeps its prompt state, the point a shared prefix is reused at)
        engine.scheduler.turn_token = TURN_START
        system = random_prompt(vocab, args.system, g)
        params = SamplingParams(max_new_tokens=64, ignore_eos=True)
        jobs = [(system + [TURN_START] + random_prompt(vocab, TAIL - 1, g), params) for _ in range(args.requests)]
        shared = run_all(engine, jobs)
        page = engine.page_size
        reserve = engine.sizing.request_pages(TAIL + 64, engine.tree_slots)
        one_copy = -(-args.system // page) + args.requests * (reserve + 1)
        shared["one_copy_plus_tails_pages"] = one_copy
        shared["pages_ratio"] = shared["most_pages_used"] / one_copy
        # a conversation's second turn: the first turn's prompt and answer, and 200 new tokens (a system
        # prompt of its own, so that its first turn is prefilled cold)
        for _ in range(2):  # the second conversation's figures: the first one's shapes captured their graphs
            turn1 = random_prompt(vocab, args.system, g) + [TURN_START] + random_prompt(vocab, TAIL - 1, g)
            t1, answer = first_token_s(engine, turn1, params)
            saved = engine.stats.prefix_tokens_saved
            t2, _ = first_token_s(engine, turn1 + answer + [TURN_START] + random_prompt(vocab, 199, g), params)
            saved = engine.stats.prefix_tokens_saved - saved
        shared.update({"turn1_ttft_s": t1, "turn2_ttft_s": t2, "turn2_over_turn1": t2 / t1, "turn2_reused": saved})
        report["share"] = shared
        print(f"share: {args.requests} x ({args.system} shared + {TAIL}): most pages {shared['most_pages_used']} "
              f"= {shared['pages_ratio']:.2f}x one copy plus tails ({one_copy}); shared pages "
              f"{shared['most_pages_shared']}; turn 2 TTFT {t2 * 1e3:.0f} ms = {t2 / t1:.1%} of turn 1's "
              f"{t1 * 1e3:.0f} ms ({saved} tokens reused)", flush=True)
        peaks.take(report, "share")
        save()

    if "batch" in parts:
        params = SamplingParams(max_new_tokens=args.answer, ignore_eos=True)
        jobs = [(random_prompt(vocab, args.prompt, g), params) for _ in range(args.requests)]
        report["batch"] = run_all(engine, jobs)
        b = report["batch"]
        print(f"batch: {b['requests']} x ({args.prompt} + {args.answer}): most running {b['most_running']}, "
              f"batch size {b['most_batch_size']}, {b['tokens_per_s']:.0f} tok/s, {b['wall_s']:.1f} s, "
              f"preemptions {b['preemptions']}", flush=True)
        peaks.take(report, "batch")
        save()

    if "long" in parts:
        prompt = random_prompt(vocab, engine.max_context - 16, g)
        ttft, out = first_token_s(engine, prompt, SamplingParams(max_new_tokens=16, ignore_eos=True))
        report["long"] = {"prompt_tokens": len(prompt), "answer_tokens": len(out), "ttft_s": ttft}
        print(f"long: {len(prompt)} + {len(out)} tokens accepted, first token in {ttft:.1f} s", flush=True)
        peaks.take(report, "long")
        if "peaks_mib" in report:
            above = report["long"]["prefill_above_start_mib"] = report["peaks_mib"]["long"]["allocated_above_start"]
            print(f"long: the prefill took {above / 1024:.1f} GiB above the weights and the pool at its peak, "
                  f"against the {workspace / 2**30:.1f} GiB workspace the pool was sized with", flush=True)
        save()

    for part, p in report.get("peaks_mib", {}).items():
        print(f"peak in {part}: allocated {p['allocated']:.0f} MiB, reserved {p['reserved']:.0f} MiB "
              f"(with the {report['held_back_mib']} MiB held back); free after it {p['free_now']:.0f} MiB", flush=True)
    save()


if __name__ == "__main__":
    main()
