"""Two gloo ranks, one launch each (test_tp_ranks.py starts them): `python tp_ranks.py RANK PORT
OUT PAIR_DIR...`. For each tiny pair, rank 0 serves the cases below alone (TP=1) and then over both
ranks (TP=2, as the Leader of engine/distributed.py, rank 1 following), and writes every case's tokens
under both to OUT (JSON); torch is imported once per process for every pair and mode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ddtree_runtime.engine import Engine, EngineConfig, SamplingParams
from ddtree_runtime.engine.distributed import Leader, follow, join
from ddtree_runtime.server.ranks import end_process
from ddtree_devtools.tiny_corpus import mixed_prompts

MAX_NEW = 24
MODES = ("ar", "dflash", "ddtree")


def config(pair: Path, world: int, quantization: str = "none", draft_vocab: str | None = None) -> EngineConfig:
    return EngineConfig(str(pair / "target"), str(pair / "draft"), device="cpu", dtype="float32", tree_budget=16,
                        max_running=4, max_batched_tokens=16, tensor_parallel=world, quantization=quantization,
                        draft_vocab=draft_vocab)


# --draft-vocab over two ranks: the drafter's rows of a head each rank holds half of
DRAFT_VOCAB = "500"


def greedy_case(engine) -> list[int]:
    """One greedy ddtree request: for --quantize fp8 (each rank quantizes its own shard: the blocks of a
    row-parallel shard are its own) and --draft-vocab."""
    prompt = mixed_prompts(engine.tokenizer, 0, 0, 1, 77, cut=2)[0]
    return alone(engine, prompt, SamplingParams(MAX_NEW, mode="ddtree"))


def alone(engine, prompt: list[int], p: SamplingParams) -> list[int]:
    return [t for r in engine.generate(prompt, p) for t in r.token_ids]


def batched(engine, jobs: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """Every job submitted at once (one more joining at the second step), stepped to the end."""
    ids = [engine.submit(prompt, p) for prompt, p in jobs[:-1]]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    step = 0
    while engine.has_work or step < 2:
        if step == 1:
            ids.append(engine.submit(*jobs[-1]))
            tokens[ids[-1]] = []
        for rid, out in engine.step():
            tokens[rid] += out.token_ids
        step += 1
    return [tokens[i] for i in ids]


def cases(engine) -> dict[str, list]:
    prompts = mixed_prompts(engine.tokenizer, 2, 321, 2, 77, cut=2)
    out: dict[str, list] = {}
    for mode in MODES:
        out[f"greedy {mode}"] = alone(engine, prompts[2], SamplingParams(MAX_NEW, mode=mode))
        out[f"seeded {mode}"] = alone(engine, prompts[1], SamplingParams(MAX_NEW, temperature=1.0, top_p=0.9,
                                                                         seed=7, mode=mode))
    mixes = [SamplingParams(MAX_NEW, mode=mode) for mode in MODES]
    out["greedy batch"] = batched(engine, list(zip(prompts, mixes + [SamplingParams(MAX_NEW, mode="ddtree",
                                                                                    tree_budget=4)])))
    out["seeded batch"] = batched(engine, [(p, SamplingParams(MAX_NEW, temperature=0.8, seed=11 + i, mode=m))
                                           for i, (p, m) in enumerate(zip(prompts, MODES + ("ddtree",)))])
    # unseeded sampling: each rank would draw its own seed; the leader gives them one (no divergence)
    out["unseeded runs"] = [len(alone(engine, prompts[3], SamplingParams(8, temperature=1.0, mode="ddtree"))) > 0]
    return out


def main() -> None:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    pairs = [Path(p) for p in sys.argv[4:]]
    torch.set_num_threads(1)
    results: dict[str, dict] = {}
    heads: dict[str, torch.Tensor] = {}  # TP=1's drafter head rows of the draft vocabulary
    if rank == 0:  # every TP=1 reference first: once joined, an engine is one of two ranks
        for pair in pairs:
            engine = Engine(config(pair, 1))
            vocab = Engine(config(pair, 1, draft_vocab=DRAFT_VOCAB))
            heads[pair.name] = vocab.drafter.head
            results[pair.name] = {"tp1": cases(engine), "kv_heads": [engine.target.config.num_key_value_heads],
                                  "fp8": [greedy_case(Engine(config(pair, 1, "fp8")))], "vocab": [greedy_case(engine), greedy_case(vocab)]}
    tp, _ = join(config(pairs[0], 2), rank, port)
    for pair in pairs:
        engine = Engine(config(pair, 2))
        if rank == 0:
            leader = Leader(engine, tp, on_lost=lambda why: sys.exit(f"rank lost: {why}"))
            results[pair.name]["tp2"] = cases(leader)
            results[pair.name]["kv_heads"].append(engine.target.config.num_key_value_heads)
            results[pair.name]["prefix_hits"] = engine.stats.prefix_hits  # the repeated prompts' reuse
            leader.close()
            fp8 = Engine(config(pair, 2, "fp8"))
            leader = Leader(fp8, tp, on_lost=lambda why: sys.exit(f"rank lost: {why}"))
            results[pair.name]["fp8"].append(greedy_case(leader))
            results[pair.name]["fp8_engine"] = fp8.quantization
            leader.close()
            vocab = Engine(config(pair, 2, draft_vocab=DRAFT_VOCAB))
            leader = Leader(vocab, tp, on_lost=lambda why: sys.exit(f"rank lost: {why}"))
            results[pair.name]["vocab"].append(greedy_case(leader))
            results[pair.name]["vocab_head_whole"] = torch.equal(vocab.drafter.head, heads[pair.name])
            leader.close()
        else:
            follow(engine, tp)
            follow(Engine(config(pair, 2, "fp8")), tp)
            follow(Engine(config(pair, 2, draft_vocab=DRAFT_VOCAB)), tp)
    if rank == 0:
        out.write_text(json.dumps(results))
    end_process(0)  # as the server's ranks end: not through the interpreter's exit (ranks.end_process)


if __name__ == "__main__":
    main()
