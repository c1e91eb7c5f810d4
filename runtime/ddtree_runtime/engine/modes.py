"""The speculative modes as objects, one registry: what each needs and how its round's tree is made.

The engine asks a request's mode instead of branching on its name: whether it drafts (needs the
drafter, keeps a draft between rounds, shares a speculative prefix), how many tree slots its round
writes, and how the trees of a round's rows are built from their drafts (a lone request: one row). The names are
limits.MODES (declared there, torch-free, for ddops and the settings); a test checks they agree.
"""

from __future__ import annotations

import torch

from ..capacity import round_tree_slots
from ..limits import MODES
from .forecast import forecast_accepted
from .tree import Tree, TreeBuilder


class Mode:
    """A decoding mode. `drafts`: it runs the drafter, and a round verifies a tree (or chain) of draft
    tokens; without it a round is one target step (autoregressive)."""
    name: str
    drafts: bool = True

    def tree_slots(self, budget: int, block_size: int) -> int:
        """Nodes (root included) of this mode's round at a tree budget: what the pool reserves for it."""
        return round_tree_slots(self.name, budget, block_size)

    def trees(self, builder: TreeBuilder, drafted: list[torch.Tensor], budget: int,
              block_size: int) -> list[Tree | None]:
        """The trees of rows of this mode and one budget, from their drafts ([block-1, V] each); None:
        a row verifies its root alone."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class AutoRegressive(Mode):
    """One token a round from the target alone: no drafter, no tree."""
    name, drafts = "ar", False

    def trees(self, builder, drafted, budget, block_size):
        return [None] * len(drafted)


class DFlash(Mode):
    """The drafter's block read as one chain: its top-1 token at every depth."""
    name = "dflash"

    def trees(self, builder, drafted, budget, block_size):
        return [builder.chain(d) for d in drafted]


class DDTree(Mode):
    """A best-first tree of `budget` draft nodes over the drafter's per-depth distributions."""
    name = "ddtree"

    def trees(self, builder, drafted, budget, block_size):
        return self.forecast_trees(builder, drafted, budget, block_size, [])[0]

    def forecast_trees(self, builder, drafted: list[torch.Tensor], budget: int, block_size: int,
                       budgets: list[int]) -> tuple[list[Tree], torch.Tensor | None]:
        """`trees`, and the drafter's expected accepted tokens ([R, len(budgets)], thousandths) of the
        first b nodes of each, for each b in budgets (forecast.py; None for no budgets)."""
        depth = min(block_size - 1, budget)
        nodes, scores = builder.build(_stacked([d[:depth] for d in drafted]), budget)
        forecast = forecast_accepted(scores, nodes.shape[-1], budgets) if budgets else None
        # a graphed build's static buffers: one build per budget a round, staged by the verify before the next
        return [Tree(row) for row in nodes], forecast


REGISTRY: dict[str, Mode] = {mode.name: mode for mode in (DDTree(), DFlash(), AutoRegressive())}


def mode_named(name: str) -> Mode:
    """The mode called `name`; ValueError naming the choices otherwise."""
    mode = REGISTRY.get(name)
    if mode is None:
        raise ValueError(f"mode must be one of {MODES}, got {name!r}")
    return mode


def _stacked(rows: list[torch.Tensor]) -> torch.Tensor:
    """The tensors as one [R, ...]: a view when they are evenly spaced rows of one buffer (the drafts of
    a batched drafter pass, 146 MB at 16 requests of Qwen3-8B) or a single one, else a stacked copy."""
    first = rows[0]
    if len(rows) == 1:
        return first[None]
    step = rows[1].data_ptr() - first.data_ptr()
    even = step > 0 and step % first.element_size() == 0 and all(
        r.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and r.shape == first.shape
        and r.stride() == first.stride() and r.data_ptr() - first.data_ptr() == i * step for i, r in enumerate(rows))
    if not even:
        return torch.stack(rows)
    return first.as_strided((len(rows), *first.shape), (step // first.element_size(), *first.stride()))
