"""The speculative modes' registry: the one list of names (limits.MODES, which ddops and the settings
read without torch) is the registry's, and each mode states what its round reserves and builds."""

from __future__ import annotations

import pytest
import torch

from ddtree_runtime.engine.modes import REGISTRY, mode_named
from ddtree_runtime.engine.tree import TreeBuilder
from ddtree_runtime.limits import MODES


def test_the_registry_is_the_declared_mode_list():
    assert tuple(REGISTRY) == MODES
    assert [m.name for m in REGISTRY.values()] == list(MODES)


def test_each_mode_says_what_it_needs_and_reserves():
    ar, dflash, ddtree = mode_named("ar"), mode_named("dflash"), mode_named("ddtree")
    assert (ar.drafts, dflash.drafts, ddtree.drafts) == (False, True, True)
    assert [m.tree_slots(budget=16, block_size=8) for m in (ar, dflash, ddtree)] == [1, 8, 17]


def test_a_round_builds_the_modes_tree():
    builder, drafted = TreeBuilder(torch.device("cpu")), torch.randn(7, 50)
    assert mode_named("ar").trees(builder, [None, None], 4, 8) == [None, None]
    [chain] = mode_named("dflash").trees(builder, [drafted], 4, 8)
    assert chain.size == 8 and torch.equal(chain.tokens, drafted.argmax(-1))
    [tree] = mode_named("ddtree").trees(builder, [drafted], 4, 8)  # a lone request: a batch of one
    assert tree.size == 5
    rows = mode_named("ddtree").trees(builder, [drafted, torch.randn(7, 50)], 4, 8)
    assert torch.equal(rows[0].nodes, tree.nodes)


def test_an_unknown_mode_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="mode must be one of .*'beam'"):
        mode_named("beam")
