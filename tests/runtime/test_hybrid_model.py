"""The hybrid (Gated DeltaNet + gated full attention) target against transformers' Qwen3_5ForCausalLM:
prefill logits, a tree pass where every node must see exactly its own path, and the state committed
along one path, which must not carry anything from the branches that were not kept."""

from __future__ import annotations

import pytest
import torch

from ddtree_runtime.engine.kv_cache import HybridCache, target_cache, target_cache_bytes
from ddtree_runtime.engine.runner import TargetRunner
from ddtree_runtime.engine.tree import Tree, ancestor_mask
from ddtree_runtime.model import Qwen35Config, load_target
from ddtree_runtime.model.gated_delta import gated_delta, state_at, tree_paths
from ddtree_runtime.model.gdn_chunk import CHUNK as PROMPT_CHUNK
from ddtree_runtime.model.gdn_chunk import PaddedPrompt
from ddtree_runtime.model.layers import TreeInputs

VOCAB = 320
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
# a tree whose nodes come in best-first order (parents first) with branches at several depths
PARENTS = [0, 0, 0, 1, 1, 2, 3, 3, 6, 8, 5, 9]


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYERS),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, layer_types=LAYERS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False)
    hf = Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms at zero (scale 1): make the 1 + w conversion matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("qwen3_5")
    hf.save_pretrained(path)
    return hf, load_target(path)


def hf_last_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1]


def test_config_reads_nested_text_config():
    text = {"model_type": "qwen3_5_text", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
            "full_attention_interval": 4, "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                                              "mrope_section": [11, 11, 10]}}
    cfg = Qwen35Config.from_dict({"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": True})
    assert cfg.full_layers == [3, 7] and len(cfg.linear_layers) == 6
    assert cfg.rotary_dim == 1 and cfg.rope_theta == 1e7 and cfg.tie_word_embeddings


def test_prefill_matches_transformers(hf_pair):
    hf, ours = hf_pair
    ids = torch.randint(0, VOCAB, (1, 150), generator=torch.Generator().manual_seed(1))  # > two chunks
    with torch.no_grad():
        ref = hf(ids).logits[0]
        h, _ = ours(ids, torch.arange(150)[None])
        # and resumed: 100 tokens, then 50 more from the cached recurrent state (full-attention layers
        # attend to everything before, so the continuation is one token at a time)
        cache = target_cache(ours.config, 256, "cpu", torch.float32)
        ours(ids[:, :100], torch.arange(100)[None], cache, start=0)
        resumed = [ours(ids[:, i:i + 1], torch.tensor([[i]]), cache, start=i)[0] for i in range(100, 150)]
    assert torch.allclose(ours.logits(h)[0], ref, atol=1e-4), (ours.logits(h)[0] - ref).abs().max()
    assert torch.allclose(ours.logits(torch.cat(resumed, dim=1))[0], ref[100:], atol=1e-4)


@pytest.mark.parametrize("length", [PROMPT_CHUNK - 1, PROMPT_CHUNK + 1, 2 * PROMPT_CHUNK + 3,
                                    5 * PROMPT_CHUNK - 7])
def test_prefill_logits_match_transformers_across_chunk_boundaries(hf_pair, length):
    hf, ours = hf_pair
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
    cache = target_cache(ours.config, 512, "cpu", torch.float32)
    with torch.no_grad():
        ref = hf(ids).logits[0]
        h, _ = ours(ids, torch.arange(length)[None], cache, start=0)
    assert torch.allclose(ours.logits(h)[0], ref, atol=1e-4), (ours.logits(h)[0] - ref).abs().max()


def test_parallel_form_equals_the_recurrence_on_every_path():
    """gated_delta over a tree == the token-by-token recurrence along each node's own path."""
    g = torch.Generator().manual_seed(2)
    t, h, dk, dv = len(PARENTS), 3, 8, 5
    q = torch.nn.functional.normalize(torch.randn(1, h, t, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(1, h, t, dk, generator=g), dim=-1)
    v, beta = torch.randn(1, h, t, dv, generator=g), torch.rand(1, h, t, generator=g)
    decay, s0 = -torch.rand(1, h, t, generator=g), torch.randn(1, h, dk, dv, generator=g)
    mask, node_depths = ancestor_mask(torch.tensor(PARENTS), 15), torch.tensor(depths(PARENTS))
    out, step = gated_delta(q, k, v, decay, beta, s0, tree_paths(mask, node_depths, 4))
    for node in range(t):
        path = path_to(node)
        s = s0
        for j in path:
            s = s * decay[..., j].exp()[..., None, None]
            u = beta[..., j, None] * (v[:, :, j] - (s * k[:, :, j, :, None]).sum(-2))
            s = s + k[:, :, j, :, None] * u[..., None, :]
        assert torch.allclose(out[:, :, node], (s * q[:, :, node, :, None]).sum(-2), atol=1e-5)
        assert torch.allclose(state_at(step, s0, torch.tensor(path)), s, atol=1e-5)
    window = tree_paths(mask, node_depths, 4).window
    assert window[9].tolist() == [3 + 3, 3 + 6, 3 + 8, 3 + 9]   # 9 <- 8 <- 6 <- 3: all tree nodes
    assert window[1].tolist() == [1, 2, 3, 4]                   # conv tail, root, itself


def depths(parents: list[int]) -> list[int]:
    out = [0]
    for p in parents[1:]:
        out.append(out[p] + 1)
    return out


def path_to(node: int) -> list[int]:
    path = [node]
    while path[-1] != 0:
        path.append(PARENTS[path[-1]])
    return path[::-1]


def test_tree_pass_sees_only_each_nodes_path_and_commits_only_the_kept_one(hf_pair):
    hf, ours = hf_pair
    g = torch.Generator().manual_seed(3)
    context = torch.randint(0, VOCAB, (70,), generator=g).tolist()
    tokens = torch.randint(0, VOCAB, (len(PARENTS),), generator=g).tolist()
    cache = target_cache(ours.config, 256, "cpu", torch.float32, nodes=17)
    assert isinstance(cache, HybridCache)
    runner = TargetRunner(ours, cache, torch.device("cpu"), max_depth=15)
    n = len(context) - 1  # the last context token is the tree's root, as in the engine
    with torch.no_grad():
        ours(torch.tensor([context[:n]]), torch.arange(n)[None], cache, start=0)
        tokens[0] = context[n]
        tree = Tree(torch.tensor([tokens[1:], PARENTS[1:], depths(PARENTS)[1:]]))
        logits = runner.run([tokens[0]], [n], [tree]).logits[0]
        for node in range(len(PARENTS)):
            seq = context[:n] + [tokens[j] for j in path_to(node)]
            assert torch.allclose(logits[node], hf_last_logits(hf, seq), atol=1e-4), f"node {node}"
        # keep the deepest path through a node whose siblings were rejected; the next step must see only it
        kept = path_to(11)
        cache.compact(torch.tensor([n]), torch.tensor([kept]), torch.tensor([len(kept)]))
        after = context[:n] + [tokens[j] for j in kept]
        nxt = int(logits[11].argmax())
        step = runner.run([nxt], [len(after)], [None]).logits[0]
        assert torch.allclose(step[0], hf_last_logits(hf, after + [nxt]), atol=1e-4)


def test_a_commit_leaves_each_rows_conv_tail_the_last_inputs_of_its_own_path(hf_pair):
    """Paths shorter and longer than the conv's K-1 rows, in one batch: each row's tail is the last K-1
    rows of [its old tail | its path's inputs], in every linear layer."""
    cfg = hf_pair[1].config
    cache = target_cache(cfg, 64, "cpu", torch.float32, batch=3, nodes=9)
    g = torch.Generator().manual_seed(5)
    cache.conv.copy_(torch.randn(cache.conv.shape, generator=g))
    cache.inputs.copy_(torch.randn(cache.inputs.shape, generator=g))
    nodes = torch.tensor([[0, 0, 0, 0, 0], [0, 2, 0, 0, 0], [0, 1, 4, 7, 8]])
    length = torch.tensor([1, 2, 5])
    conv, inputs = cache.conv.clone(), cache.inputs.clone()
    cache.compact(torch.tensor([10, 20, 30]), nodes, length)
    k1 = conv.shape[2]
    for b in range(3):
        path = inputs[:, b, nodes[b, :length[b]]]                       # [layers, path, C]
        assert torch.equal(cache.conv[:, b], torch.cat([conv[:, b], path], dim=1)[:, -k1:]), f"row {b}"


def test_memory_estimate_is_what_the_cache_allocates(hf_pair):
    cfg = hf_pair[1].config
    cache = target_cache(cfg, 512, "cpu", torch.float32, nodes=65)
    allocated = sum(t.numel() * t.element_size() for t in (cache.k, cache.v, cache.conv, cache.state,
                                                           cache.inputs, *vars(cache.step).values()))
    workspace = 6 * 4 * cfg.linear_num_value_heads * 65 * 65
    assert target_cache_bytes(cfg, 512, 65, 4) == allocated + workspace


def test_a_budget_that_cannot_fit_is_refused_at_start(tiny_hybrid_models, tmp_path):
    import json
    import shutil

    from ddtree_runtime.engine import Engine, EngineConfig

    target = tmp_path / "target"
    shutil.copytree(tiny_hybrid_models / "target", target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2 ** 31}))
    with pytest.raises(ValueError, match=r"max context 1073741824 needs \d+\.\d GiB for the caches and a "
                                         r"prefill's activations, but .* GiB of cpu is free: the longest"):
        Engine(EngineConfig(str(target), str(tiny_hybrid_models / "draft"), max_context=2 ** 30))
    with pytest.raises(ValueError, match="exceeds the target's max_position_embeddings 2048"):
        Engine(EngineConfig(str(tiny_hybrid_models / "target"), str(tiny_hybrid_models / "draft"),
                            max_context=4096))


def test_advance_along_moves_each_sequence_along_its_own_path():
    """The batched commit: each sequence's state advanced in place along its own path (of its own
    length), as state_at gives it for that sequence alone."""
    from ddtree_runtime.model.gated_delta import Step, advance_along

    g = torch.Generator().manual_seed(4)
    n, b, h, t, dk, dv = 2, 3, 2, 9, 4, 5
    step = Step(torch.randn(n, b, h, t, dk, generator=g), torch.randn(n, b, h, t, dv, generator=g),
                -torch.rand(n, b, h, t, generator=g).cumsum(-1))
    state = torch.randn(n, b, h, dk, dv, generator=g)
    paths = [[0, 2, 5], [0], [0, 1, 3, 4, 8]]
    nodes = torch.tensor([p + [0] * (5 - len(p)) for p in paths])
    expected = [state_at(Step(step.k[:, i], step.u[:, i], step.g[:, i]), state[:, i], torch.tensor(p))
                for i, p in enumerate(paths)]
    advance_along(step, state, nodes, torch.tensor([len(p) for p in paths]))
    for i in range(b):
        assert torch.allclose(state[:, i], expected[i], atol=1e-5)


# (start, real tokens, width, keep): from zeros and from a carried state; the padding past one chunk
# and past several; the state kept at the first token, at the end, across a chunk boundary
PADDED = [(0, 5, 32, None), (0, 70, 128, 70), (9, 1, 32, 1), (9, 129, 256, 64), (40, 33, 64, 2)]


@pytest.mark.parametrize("start,length,width,keep", PADDED)
@torch.inference_mode()
def test_a_padded_prompt_piece_is_the_eager_one(hf_pair, start, length, width, keep):
    """A linear layer over a prompt piece padded to a fixed width (gdn_chunk.PaddedPrompt: the real
    length, the row and the snapshot point on the device) gives what the eager prompt pass gives: its
    outputs, the row's conv tail and state after the piece and, with `keep`, the snapshot; from zeros
    at the prompt's start whatever the row held; no other row changes. Exactly from the in-projection
    on (test_gdn_chunk.py); the projection's GEMM over 32 rows and over 5 may round differently."""
    _, ours = hf_pair
    layer = ours.model.layers[0].linear_attn
    gen = torch.Generator().manual_seed(start + length)
    cache = HybridCache(ours.config, 8, "cpu", torch.float32, batch=3, snapshots=True)
    for t in cache._states():
        t.copy_(torch.randn(t.shape, generator=gen))
    cache.conv[:, 0], cache.state[:, 0] = cache.conv[:, 2], cache.state[:, 2]  # the same sequence so far
    x = torch.randn(1, width, ours.config.hidden_size, generator=gen)
    eager = cache.rows(0, 1)
    eager.keep_at = keep
    want = layer(x[:, :length], eager, start, None)
    untouched = [t[:, 1].clone() for t in cache._states()]
    prompt = PaddedPrompt(torch.tensor([2]), torch.tensor([start > 0]), torch.tensor([length]),
                          None if keep is None else torch.tensor([keep]))
    got = layer(x, cache, start, TreeInputs(None, None, 0, None, prompt=prompt))
    assert got.shape[1] == width
    torch.testing.assert_close(got[:, :length], want, atol=1e-6, rtol=1e-5)
    for t in cache._states() if keep is not None else cache._states()[:2]:
        torch.testing.assert_close(t[layer.slot, 2], t[layer.slot, 0], atol=1e-6, rtol=1e-5)
    assert all(torch.equal(t[:, 1], before) for t, before in zip(cache._states(), untouched))
