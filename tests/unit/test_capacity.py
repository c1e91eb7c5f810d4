"""What the KV pool holds on the serving GPU (runtime/ddtree_runtime/capacity.py, ddops/capacity.py):
the arithmetic on the production shape, the plan's line from fixture facts, preflight's refusal, and
`ddops status`'s running / capacity."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from ddops import capacity
from ddops import pivot as pivot_module
from ddops.facts import HostFacts, Inspection, PivotFacts, Tree
from ddops.inventory import load_inventory
from ddops.profile import load_profile, resolve_profile
from ddops.status import _runtime_cell, replicas_table
from ddtree_runtime.capacity import Shape, pool_capacity

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures" / "capacity"
TARGET = json.loads((FIXTURES / "qwen3.6-27b.json").read_text())
DRAFT = json.loads((FIXTURES / "qwen3.6-27b-dflash.json").read_text())
RTX_PRO_6000 = 97887  # MiB, what nvidia-smi reports for the 96 GB card of CT200 and llm-two
GIB = 2**30


def host(memory_mib=RTX_PRO_6000, count=1, error=None) -> HostFacts:
    gpus = [{"index": i, "name": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "memory_used_mib": 600,
             "memory_total_mib": memory_mib, "utilization_pct": 0} for i in range(count)]
    return HostFacts.from_json({"hostname": "ct200", "gpus": {"list": [] if error else gpus, "error": error},
                                "training": None})


TREES = {"target": Tree(exists=True, config=TARGET), "draft": Tree(exists=True, config=DRAFT)}


@pytest.fixture(scope="module")
def zlab():
    """The production profile, at the SGLang service's --mem-fraction-static 0.88."""
    profile = load_profile(resolve_profile("zlab-ddtree16", REPO / "playbooks"), repo_root=REPO)
    return replace(profile, serve=replace(profile.serve, mem_fraction=0.88))


def test_the_production_shape_holds_16_requests_of_8k_and_one_of_131072():
    """Qwen3.6-27B + its DFlash drafter, bf16, on a 97,887 MiB card at 0.88, 16 running, 131,072 context."""
    c = pool_capacity(RTX_PRO_6000 * 2**20, TARGET, DRAFT, dtype="bfloat16", mem_fraction=0.88, max_running=16,
                      max_context=131072)
    # the weights are the real checkpoints' parameter counts (26.9B + 1.73B) in bf16
    assert (c.weights_bytes, Shape.from_config(DRAFT).drafter_parameters()) == (57_252_423_168, 1_730_213_120)
    # a token: 16 full-attention layers x 4 x 256 of the target, 5 x 8 x 128 of the drafter, K and V, bf16
    assert c.token_bytes == 2 * 2 * (16 * 4 * 256 + 5 * 8 * 128)
    # a running request's own state: 48 linear layers' recurrent state (about 151 MB) and conv tail, and
    # its tree pass's scratch
    assert 150e6 < Shape.from_config(TARGET).state_bytes(2) < 156e6
    assert c.requests(8192) >= 16 and c.running(8192) == 16 and c.requests(131072) >= 1
    assert c.summary() == (f"KV pool of {c.pool_tokens:,} tokens: 16 request(s) of 8K at once, 1 of max_context "
                           "131,072 (max_running 16)")
    # at 64 running, the state of 48 more requests leaves less for the pool
    assert pool_capacity(RTX_PRO_6000 * 2**20, TARGET, DRAFT, dtype="bfloat16", mem_fraction=0.88, max_running=64,
                         max_context=131072).pool_tokens < c.pool_tokens - 48 * 150e6 / c.token_bytes


def test_zlabs_layout_keeps_its_sliding_layers_at_the_window():
    """z-lab's Qwen3.6 drafter layout (four sliding layers of window 4,096, then a full one): a token costs
    the target's KV and the one full layer's; each running row keeps every sliding layer's K and V at
    4,096 + 2 blocks (rounded to 64, and a scratch slot), twice with the prefix cache (a snapshot ring).
    On the 96 GB card at 0.9, 16 running, 131,072 context: 270,454 tokens with five full layers, 302,760."""
    zlab = {**DRAFT, "use_sliding_window": True, "sliding_window": 4096,
            "layer_types": ["sliding_attention"] * 4 + ["full_attention"]}
    shape = Shape.from_config(zlab)
    assert (shape.full_layers, shape.window_layers, shape.window) == (1, 4, 4096)
    assert shape.drafter_parameters() == Shape.from_config(DRAFT).drafter_parameters()
    ring = 2 * 4 * 8 * 128 * 2 * (4160 + 1)
    assert shape.ring_bytes(2, 16) == ring and shape.ring_bytes(2, 16, snapshots=True) == 2 * ring
    settings = dict(dtype="bfloat16", mem_fraction=0.9, max_running=16, max_context=131072)
    full, windowed = (pool_capacity(RTX_PRO_6000 * 2**20, TARGET, d, **settings) for d in (DRAFT, zlab))
    assert windowed.token_bytes == full.token_bytes - 4 * 2 * 8 * 128 * 2
    assert windowed.request_bytes == full.request_bytes + 2 * ring
    assert (full.pool_tokens, windowed.pool_tokens) == (270_454, 302_760)
    off = {**settings, "prefix_cache": False}  # no snapshot ring (nor the hybrid's state snapshot)
    assert (pool_capacity(RTX_PRO_6000 * 2**20, TARGET, DRAFT, **off).pool_tokens,
            pool_capacity(RTX_PRO_6000 * 2**20, TARGET, zlab, **off).pool_tokens) == (299_089, 353_798)


def test_a_plain_transformer_keeps_no_state_and_ar_no_drafter():
    qwen3 = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
             "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "max_position_embeddings": 40960}
    c = pool_capacity(80 * GIB, qwen3, None, dtype="bfloat16", mem_fraction=0.9, max_running=16)
    assert c.request_bytes == 0 and c.token_bytes == 2 * 36 * 8 * 128 * 2 and c.max_context == 40960
    assert c.weights_bytes == 8_190_735_360 * 2  # the target alone (Qwen3-8B's parameters)


def test_the_plan_line_comes_from_the_hosts_gpu_and_the_models_configs(zlab):
    pool = capacity.estimate(zlab, host(), TREES)
    assert pool.gpu.index == 0 and pool.capacity.memory_bytes == RTX_PRO_6000 * 2**20
    assert pool.line == (f"KV pool of {pool.capacity.pool_tokens:,} tokens: 16 request(s) of 8K at once, 1 of "
                         "max_context 131,072 (max_running 16) on GPU 0 (NVIDIA RTX PRO 6000 Blackwell Server "
                         "Edition, 97,887 MiB)")
    assert pool.as_json()["requests_8k"] == 16 and capacity.check_fits(zlab, pool) == []
    # where no estimate can be made, the line says why; SGLang and a CPU device have no pool of ours
    assert capacity.estimate(zlab, host(error="nvidia-smi: command not found"), TREES).line == (
        "KV pool not estimated: ct200's GPUs could not be read (nvidia-smi: command not found)")
    assert "config.json is not readable" in capacity.estimate(zlab, host(), {"target": Tree(exists=False)}).line
    assert capacity.estimate(replace(zlab, device="cpu"), host(), TREES) is None


@pytest.mark.parametrize("device, gpus, expected", [("cuda", None, [0]), ("cuda:1", None, [1]),
                                                     ("cuda", "2,3", [2]), ("cuda:1", "2,3", [3])])
def test_the_gpu_is_the_one_the_runtime_runs_on(zlab, device, gpus, expected):
    assert capacity.serving_gpus(replace(zlab, device=device, gpus=gpus)) == expected


def test_replicas_are_estimated_on_their_smallest_gpu():
    profile = load_profile(resolve_profile("lab-replicas", REPO / "playbooks"), repo_root=REPO)
    profile = replace(profile, device="cuda", dtype="bfloat16")
    assert capacity.serving_gpus(profile) == [0, 1]
    facts = HostFacts.from_json({"hostname": "h", "training": None, "gpus": {"error": None, "list": [
        {"index": 0, "name": "A", "memory_total_mib": 97887}, {"index": 1, "name": "B", "memory_total_mib": 81559}]}})
    assert capacity.estimate(profile, facts, TREES).gpu.index == 1


def test_preflight_refuses_a_max_context_that_cannot_fit_in_one_line(zlab):
    small = capacity.estimate(zlab, host(memory_mib=81559), TREES)   # an 80 GB card: weights and a 128K prefill
    problem, = capacity.check_fits(zlab, small)
    assert problem.startswith("one request of serve.max_context 131072 (") and "zlab-ddtree16.yaml:" in problem
    assert "needs 131,104 tokens of KV pool, and on ct200's GPU 0 (" in problem
    assert "81,559 MiB) the pool holds 84,739 (" in problem  # each row keeps a prompt snapshot of its state too
    assert "79.6 GiB less weights 53.3 GiB, x mem_fraction 0.88, less workspaces 10.9 GiB and 16 x 0.34 GiB of " \
           "request state" in problem
    # the longest context that fits is measured with its own (smaller) prefill workspace
    longest = small.longest_context
    at = {n: pool_capacity(81559 * 2**20, TARGET, DRAFT, dtype="bfloat16", mem_fraction=0.88, max_running=16,
                           max_context=n).requests(n) for n in (longest, longest + 1)}
    assert at == {longest: 1, longest + 1: 0} and longest > small.capacity.pool_tokens
    assert problem.endswith(f"lower serve.max_context to {longest} or less, raise serve.mem_fraction, lower "
                            "serve.max_running, or serve on a larger GPU or over more of them (serve.tensor_parallel)")
    assert "\n" not in problem
    # without a max_context the runtime shortens the context to what fits: nothing to refuse
    unset = replace(zlab, serve=replace(zlab.serve, max_context=None))
    assert capacity.check_fits(unset, capacity.estimate(unset, host(memory_mib=81559), TREES)) == []


def test_the_dry_run_plan_shows_the_pool(monkeypatch, zlab):
    facts = PivotFacts(serving="ct200", hosts={"ct200": host()}, inspections={"ct200": Inspection()},
                       pool=capacity.estimate(zlab, host(), TREES))
    monkeypatch.setattr(pivot_module, "preflight", lambda *a, **k: (facts, "1 host(s) ok"))
    out = io.StringIO()
    flow = pivot_module.Pivot(zlab, load_inventory(REPO / "inventories" / "fleet.yaml"), None,
                              Console(file=out, width=200, force_terminal=False),
                              options=pivot_module.PivotOptions(dry_run=True), steps=[], gates=[])
    report = flow.execute().as_json()
    assert report["outcome"] == "dry-run" and report["pool"]["requests_8k"] == 16
    assert "capacity: KV pool of " in out.getvalue() and "16 request(s) of 8K at once" in out.getvalue()


def health(running=3, max_running=16, pool=None) -> dict:
    h = {"url": "http://127.0.0.1:8000/health", "healthy": True,
         "detail": {"status": "ok", "mode": "ddtree", "tree_budget": 16, "model": "Qwen3.6-27B",
                    "running": running, "max_running": max_running}}
    return {**h, "pool": pool} if pool is not None else h


def test_status_shows_running_over_capacity_and_pages_where_reported():
    cell = _runtime_cell({"services": [], "runtime": [health()]}).plain
    assert cell == "http://127.0.0.1:8000/health: healthy Qwen3.6-27B ddtree@16; running 3/16\n"
    paged = health(pool={"ddtree_kv_pages_used": 120, "ddtree_kv_pages_free": 880})
    assert _runtime_cell({"services": [], "runtime": [paged]}).plain.endswith("running 3/16, pages 120/1000 used\n")
    deployment = {"template": "ddtree@.service", "profile": "p", "balancer": {
        "unit": "haproxy.service", "port": 8200, "state": {"ActiveState": "active"},
        "health": {"healthy": True, "detail": {"status": "ok"}}}, "replicas": [
        {"unit": "ddtree@1.service", "port": 8201, "gpus": [0], "state": {"ActiveState": "active"},
         "health": health(running=16), "balancer": {"status": "UP"}},
        {"unit": "ddtree@2.service", "port": 8202, "gpus": [1], "state": {"ActiveState": "active"},
         "health": {"healthy": True, "detail": {"status": "ok", "mode": "ddtree", "block_size": 16}},
         "balancer": {"status": "UP"}}]}
    out = io.StringIO()
    Console(file=out, width=200, force_terminal=False).print(replicas_table("ct200", deployment))
    rows = [line for line in out.getvalue().splitlines() if "ddtree@" in line and "service" in line][1:]
    assert "16/16" in rows[0] and " - " in rows[1]   # behind an API key /health does not show the load


def test_a_draft_vocabulary_in_extra_args_counts_its_head_rows(zlab):
    """`--draft-vocab N` in serve.extra_args: the drafter's copy of N rows of the 27B's head (5,120 wide,
    bf16) is weights the pool does not get; a map file's count is unknown here and not counted."""
    whole = capacity.estimate(zlab, host(), TREES).capacity
    for args in (("--draft-vocab", "32768"), ("--draft-vocab=32768",)):
        cut = capacity.estimate(replace(zlab, serve=replace(zlab.serve, extra_args=args)), host(), TREES).capacity
        assert cut.weights_bytes - whole.weights_bytes == 32768 * 5120 * 2 and cut.pool_tokens < whole.pool_tokens
    assert capacity.draft_vocab_rows(("--draft-vocab", "/srv/map.json")) == 0
    assert capacity.draft_vocab_rows(("--max-queue", "8")) == 0
