"""The drafter's vocabulary (`--draft-vocab`): the target tokens the drafter may propose.

A DFlash drafter has no LM head of its own: its block goes through the target's, which on Qwen3.6 is
248,320 rows (2.5 GB in bf16). Reading it is ~0.6 ms of an H200's lone round and, at 16 running, a
[256, 248320] product of ~1 ms, each round, for tokens of which a few thousand carry nearly all the
drafter's hits. With a draft vocabulary the drafter's logits are computed over those rows only (their
copy, kept beside the head), and its trees are built over them. The target still verifies every node over
its whole vocabulary, so what is committed is unchanged, greedy and seeded alike: only how often a draft
is accepted can move, where the target's next token lies outside the set. This is FR-Spec's
frequency-ranked draft head, and the hot-token map SGLang takes for EAGLE (`--speculative-token-map`).

The value is one of:
- N, a count: the N lowest token ids (in a byte-level BPE vocabulary, Qwen's among them, ids follow the
  merges' order, so the low ones are the frequent ones) and the tokenizer's added tokens (its special
  and chat-template tokens, which a template-shaped reply drafts often);
- a file of token ids: a JSON list, whitespace-separated integers (one a line), or a `.pt` file holding a
  1-D integer tensor (SGLang's and FR-Spec's published maps). Its order is kept: the drafter's logit j is
  the file's j-th token's.
Either way the end-of-sequence ids are added, so a draft can end where the target would.

A map from real text: `python -m ddtree_runtime.draft_vocab --target DIR --top N FILE...` counts the tokens
of the files (a traffic sample: prompts and completions) with the target's tokenizer and writes the N
most frequent ids as a JSON list.

Standard library only where no `.pt` file is named: the server checks the value before loading a model."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

# A count smaller than this leaves the drafter nothing to rank a tree's levels by
MIN_DRAFT_VOCAB = 2


class DraftVocabError(ValueError):
    """A --draft-vocab value that cannot be used, in one line: what, and how to fix it."""


def draft_vocab_ids(spec: str, vocab_size: int, added: Iterable[int] = (), eos: Iterable[int] = ()) -> list[int]:
    """The drafter's token ids for --draft-vocab `spec` over a target of `vocab_size` tokens: distinct,
    in the count's or the file's order, then the added tokens (a count only) and the eos ids not yet in."""
    if re.fullmatch(r"\s*\d+\s*", spec):  # a count, else a file's path
        count = int(spec)
        if not MIN_DRAFT_VOCAB <= count <= vocab_size:
            raise DraftVocabError(f"--draft-vocab {count}: expected a count from {MIN_DRAFT_VOCAB} to the target's "
                                  f"{vocab_size} tokens, or a file of token ids")
        ids = [*range(count), *added]
    else:
        ids = _read_ids(Path(spec))
        outside = next((t for t in ids if not 0 <= t < vocab_size), None)
        if outside is not None:
            raise DraftVocabError(f"--draft-vocab {spec}: token id {outside} is outside the target's vocabulary "
                                  f"(0..{vocab_size - 1}); is the file for another tokenizer?")
    kept = list(dict.fromkeys(t for t in [*ids, *eos] if 0 <= t < vocab_size))
    if len(kept) < MIN_DRAFT_VOCAB:
        raise DraftVocabError(f"--draft-vocab {spec}: {len(kept)} token id(s); the drafter needs at least "
                              f"{MIN_DRAFT_VOCAB}")
    return kept


def _read_ids(path: Path) -> list[int]:
    if not path.is_file():
        raise DraftVocabError(f"--draft-vocab {path}: no such file (give a count, or a file of token ids)")
    if path.suffix == ".pt":
        return _torch_ids(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise DraftVocabError(f"--draft-vocab {path}: cannot read it as text: {exc}") from None
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except ValueError as exc:
            raise DraftVocabError(f"--draft-vocab {path}: not a JSON list of token ids: {exc}") from None
    else:
        values = text.split()
    ids = []
    for value in values:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.isdigit())):
            raise DraftVocabError(f"--draft-vocab {path}: {value!r} is not a token id (expected integers only)")
        ids.append(int(value))
    return ids


def _torch_ids(path: Path) -> list[int]:
    import torch

    try:
        value = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a pickle or zip error of any kind: the file is not a tensor file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]  # torch's own run over lines
        raise DraftVocabError(f"--draft-vocab {path}: cannot load it as a tensor: {first}") from None
    if (not isinstance(value, torch.Tensor) or value.dim() != 1 or value.is_floating_point() or value.is_complex()
            or value.dtype == torch.bool):
        raise DraftVocabError(f"--draft-vocab {path}: expected a 1-D tensor of token ids")
    return [int(t) for t in value.tolist()]


def most_frequent(counts: Counter, top: int) -> list[int]:
    """The `top` most frequent ids, the lower id first among equal counts (so a map is reproducible)."""
    return [t for t, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:top]]


def main(argv: list[str] | None = None) -> int:
    """Count the tokens of text files with a target's tokenizer; print (or --out) the most frequent as a
    --draft-vocab file. Exit 2 on a bad argument, in one line."""
    ap = argparse.ArgumentParser(prog="python -m ddtree_runtime.draft_vocab",
                                 description="A --draft-vocab file: the most frequent tokens of a text sample.")
    ap.add_argument("--target", required=True, metavar="DIR", help="the target model directory (its tokenizer)")
    ap.add_argument("--top", type=int, default=32768, metavar="N", help="ids to keep (default: 32768)")
    ap.add_argument("--out", metavar="FILE", help="write the JSON list here (default: standard output)")
    ap.add_argument("files", nargs="+", metavar="FILE", help="text to count (UTF-8)")
    args = ap.parse_args(argv)
    if args.top < MIN_DRAFT_VOCAB:
        print(f"draft_vocab: error: --top {args.top}: keep at least {MIN_DRAFT_VOCAB} ids", file=sys.stderr)
        return 2
    missing = next((f for f in args.files if not Path(f).is_file()), None)
    if missing is not None:
        print(f"draft_vocab: error: {missing}: no such file", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.target)
    except (OSError, ValueError) as exc:
        print(f"draft_vocab: error: --target {args.target}: no tokenizer there ({type(exc).__name__})", file=sys.stderr)
        return 2
    counts: Counter = Counter()
    for name in args.files:
        with open(name, encoding="utf-8", errors="replace") as f:
            for line in f:  # a line at a time: a traffic sample can be larger than memory
                counts.update(tokenizer(line, add_special_tokens=False)["input_ids"])
    ids = most_frequent(counts, args.top)
    text = json.dumps(ids)
    if args.out:
        Path(args.out).write_text(text + "\n")
        print(f"{len(ids)} of {len(counts)} distinct tokens ({sum(counts.values())} counted) -> {args.out}",
              file=sys.stderr)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
