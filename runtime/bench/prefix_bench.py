"""The second turn of a long conversation with and without prefix reuse, on a GPU.

    PYTHONPATH=runtime python runtime/bench/prefix_bench.py [--shapes qwen3.6-27b,qwen3-8b]
        [--context 32768] [--new 200] [--answer 64] [--out OUT.json]

Randomly initialised models of real shapes (gpu_bench.SHAPES), bf16, one engine per shape (ddtree@16, the
drafter's context reused too). A conversation laid out as a chat template lays it out, with a
turn-start token standing for <|im_start|>: turn 1 is a prompt ending in an assistant header, answered
with --answer tokens; turn 2 is `context` tokens in all, --new of them new. Two turn-2 forms: the
completion form (turn 1's prompt and answer as generated, then the new tokens: it matches the cached
sequence to its end) and the chat form (turn 1's answer re-rendered with its first 8 tokens dropped, as
Qwen3's templates drop a think block: it leaves the cached sequence inside the assistant turn, so a
hybrid reuses up to that turn's start, where its state was kept). Times to first token
(`Engine.generate` up to its first token): turn 1 (with and without the prompt state kept: keeping it
splits the prefill there), and each turn-2 form with its prefix reused and, on an emptied cache,
without; for the reused turn 2 also where its time goes (PHASES: placing, each prefill pass, the first
token, the drafter's first pass, the rest) and when its first round ends. Writes the JSON after every
measurement."""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

from gpu_bench import build_models, sync
from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams

HEADER = 3           # tokens of an assistant header after the turn-start token ("assistant\n" and a newline)
DROPPED = 8          # tokens of turn 1's answer the chat form leaves out when it re-renders it
REPEATS = 2          # each time to first token measured this often (the smaller kept: the first may allocate)


def first_token_s(engine: Engine, prompt: list[int], max_new: int = 1) -> tuple[float, list[int]]:
    """Time to the first token of `prompt`, and all `max_new` tokens (greedy ddtree@16)."""
    sync(engine.device)
    t0 = time.perf_counter()
    gen = engine.generate(prompt, SamplingParams(max_new_tokens=max_new, mode="ddtree", tree_budget=16,
                                                 ignore_eos=True))
    out = list(next(gen).token_ids)
    sync(engine.device)
    ttft = time.perf_counter() - t0
    for r in gen:
        out += r.token_ids
    return ttft, out


def first_round_s(engine: Engine, prompt: list[int]) -> float:
    """Time from submission to the end of the first decoding round (the step after the prefill's)."""
    sync(engine.device)
    t0 = time.perf_counter()
    gen = engine.generate(prompt, SamplingParams(max_new_tokens=8, mode="ddtree", tree_budget=16, ignore_eos=True))
    next(gen)
    next(gen)
    sync(engine.device)
    seconds = time.perf_counter() - t0
    gen.close()
    return seconds


def drop_cached(engine: Engine, row: int | None = None) -> None:
    """Evict the cached sequences (all, or the one in `row`), their pages given back to the pool (the
    prefix cache's own pop and clear only forget them: a paged row would still hold its pages)."""
    for seq in list(engine.prefix.by_row.values()):
        if row is None or seq.row == row:
            engine.pool.evict(seq)


# What a turn's first token is made of: the engine's methods timed (synchronised), each without the
# time of those nested in it, so the parts add up to the whole: placing the request at its cached
# prefix (lookup, page references, the partial page's copy), each prefill pass (`_prefill`:
# one a turn, a hybrid keeping its turn-start state inside it), the first token's choice,
# the drafter's first pass (eager), and the rest of the step.
# (the engine's part, its method): the phase's name
PHASES = {("scheduler", "_place"): "place", ("runner", "_prefill"): "prefill",
          ("runner", "_first_token"): "first_token", ("runner", "_draft_prompt"): "first_draft"}


class PhaseTimes:
    """Synchronised wall time of each of PHASES' methods, exclusive of the ones nested in it."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.times, self._stack = engine, {}, []
        for part, method in PHASES:
            owner = getattr(engine, part)
            setattr(owner, method, self._timed((part, method), getattr(owner, method)))

    def _timed(self, method: str, fn):
        def run(*args, **kw):
            sync(self.engine.device)
            self._stack.append(0.0)  # the time of calls nested in this one
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                sync(self.engine.device)
                total = time.perf_counter() - t0
                nested = self._stack.pop()
                if self._stack:
                    self._stack[-1] += total
                self.times.setdefault(PHASES[method], []).append(round(total - nested, 5))
        return run

    def take(self) -> dict:
        times, self.times = self.times, {}
        return times


def breakdown_ms(phases: dict, ttft_s: float) -> dict:
    """A measured turn's phases in milliseconds (each summed over its calls), the prefill passes
    counted, and what the step spent besides them."""
    out = {name: round(1e3 * sum(times), 2) for name, times in phases.items()}
    out["prefill_passes"] = len(phases.get("prefill", []))
    out["other"] = round(1e3 * ttft_s - sum(v for k, v in out.items() if k != "prefill_passes"), 2)
    return out


def conversation(vocab: int, turn: int, context: int, new: int, answer: int, g: torch.Generator) -> dict:
    """Turn 1's prompt (system turn, user turn, assistant header) and turn 2's new tokens (a user turn
    and the next header); turn 1's answer comes from the engine."""
    def rand(n: int) -> list[int]:
        return torch.randint(0, vocab - 2, (n,), generator=g).tolist()  # never the turn-start token
    system, header = [turn] + rand(200), [turn] + rand(HEADER)
    user1 = [turn] + rand(context - new - answer - len(system) - len(header) - 1)
    return {"prompt1": system + user1 + header, "header": header,
            "new": [turn] + rand(new - len(header) - 1) + header}


def measure(engine: Engine, conv: dict, answer: int, report: dict, save, phases: PhaseTimes) -> None:
    """Turn 1, then each turn-2 form reused (turn 1's sequence stays cached in row 1: the request is
    admitted to row 0, so the prefix is copied over, the dearer of the two ways), then without reuse."""
    turn = engine.scheduler.turn_token
    p1 = conv["prompt1"]

    def turn1_ttft() -> float:
        drop_cached(engine)
        return first_token_s(engine, p1)[0]
    engine.scheduler.turn_token = None  # no prompt state kept: the prefill in one piece
    report["turn1_ttft_s_one_piece"] = min(turn1_ttft() for _ in range(REPEATS))
    engine.scheduler.turn_token = turn
    report["turn1_ttft_s"] = min(turn1_ttft() for _ in range(REPEATS))
    phases.take()
    turn1_ttft()
    report["turn1_phases_s"] = phases.take()
    report["turn1_prompt_tokens"] = len(p1)
    save()
    drop_cached(engine)
    _, a1 = first_token_s(engine, p1, answer)
    forms = {"completion": p1 + a1 + conv["new"],
             "chat": p1[:len(p1) - len(conv["header"])] + conv["header"] + a1[DROPPED:] + conv["new"]}
    firsts = {}
    for name, prompt in forms.items():
        row = report[name] = {"prompt_tokens": len(prompt)}
        times = []
        for _ in range(REPEATS + 1):
            phases.take()
            before = engine.stats.prefix_tokens_saved
            t, firsts[name] = first_token_s(engine, prompt)
            times.append(t)
            row["tokens_reused"] = engine.stats.prefix_tokens_saved - before
            drop_cached(engine, row=0)  # the measured request's own sequence: the next repeat reuses turn 1's again
        row["phases_s"] = phases.take()  # the last repeat's
        row["breakdown_ms"] = breakdown_ms(row["phases_s"], times[-1])
        row["first_round_s_reused"] = first_round_s(engine, prompt)  # the prefill's step, then its first round
        drop_cached(engine, row=0)
        assert [seq.row for seq in engine.prefix.by_row.values()] == [1]
        row["ttft_s_reused_each"] = times
        row["ttft_s_reused"] = min(times)
        row["ratio_to_turn1"] = row["ttft_s_reused"] / report["turn1_ttft_s"]
        save()
    for name, prompt in forms.items():
        row = report[name]
        times = []
        for _ in range(REPEATS):
            drop_cached(engine)
            t, first = first_token_s(engine, prompt)
            times.append(t)
        row["ttft_s_full"] = min(times)
        row["first_token_same"] = first == firsts[name]
        print(f"  {name}: {json.dumps(row)}", flush=True)
        save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3.6-27b,qwen3-8b")
    ap.add_argument("--context", type=int, default=32768, help="turn 2's prompt tokens")
    ap.add_argument("--new", type=int, default=200, help="turn 2's new tokens")
    ap.add_argument("--answer", type=int, default=64, help="turn 1's answer tokens")
    ap.add_argument("--out", default="bench/results/runtime-prefix-bench.json")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script on small shapes")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {"gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "dtype": args.dtype,
                    "torch": torch.__version__, "context": args.context,
                    "new": args.new, "answer": args.answer, "shapes": {}}

    def save() -> None:
        out_path.write_text(json.dumps(report, indent=2))

    g = torch.Generator().manual_seed(7)
    for shape in args.shapes.split(","):
        rows = report["shapes"][shape] = {}
        try:
            target, drafter = build_models(shape, device, dtype)
            target.config.max_position_embeddings = max(target.config.max_position_embeddings, args.context + 2048)
            engine = Engine(EngineConfig(f"random-{shape}", None, mode="ddtree", tree_budget=16, device=args.device,
                                         dtype=args.dtype, max_context=args.context + 1024, max_running=2),
                            target=target, drafter=drafter)
            vocab = target.config.vocab_size
            engine.scheduler.turn_token = vocab - 2  # stands for <|im_start|> (random weights have no tokenizer)
            warm = torch.randint(0, vocab - 2, (1500,), generator=g).tolist()
            first_token_s(engine, warm, 40)                                # compiles, autotuning, graphs
            first_token_s(engine, warm[:1000] + warm[:300], 4)             # a reused prefill too
            conv = conversation(vocab, engine.scheduler.turn_token, args.context, args.new, args.answer, g)
            measure(engine, conv, args.answer, rows, save, PhaseTimes(engine))
        except Exception:  # noqa: BLE001 (the benchmark reports what failed and goes on)
            rows["error"] = traceback.format_exc()[-3000:]
            print(rows["error"], flush=True)
        save()
        engine = target = drafter = None
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print(f"\n{'shape':<13}{'turn 1 s':>9}{'(one piece)':>12}{'form':>12}{'reused':>8}{'TTFT s':>8}{'full s':>8}"
          f"{'/ turn 1':>10}")
    for shape, rows in report["shapes"].items():
        for form in ("completion", "chat"):
            r = rows.get(form)
            if r and "ttft_s_full" in r:
                print(f"{shape:<13}{rows['turn1_ttft_s']:>9.3f}{rows['turn1_ttft_s_one_piece']:>12.3f}{form:>12}"
                      f"{r['tokens_reused']:>8}{r['ttft_s_reused']:>8.3f}{r['ttft_s_full']:>8.3f}"
                      f"{r['ratio_to_turn1']:>10.3f}")
    print("turn 2 reused, where its time to first token goes (ms, synchronised; 'other': the rest of the step):")
    for shape, rows in report["shapes"].items():
        for form in ("completion", "chat"):
            r = rows.get(form)
            if r and "breakdown_ms" in r:
                print(f"{shape:<13}{form:>12}  " + ", ".join(f"{k} {v}" for k, v in r["breakdown_ms"].items())
                      + f"; first round done at {1e3 * r['first_round_s_reused']:.1f}")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
