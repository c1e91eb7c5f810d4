"""Tensor parallelism on the CPU: two gloo ranks, both tiny pairs.

- The engine: greedy and seeded output over TP=2 is token-identical to TP=1 (which the other runtime
  tests pin to transformers and to the target's distribution) in ar, dflash and ddtree, alone and
  batched, with prefix reuse on (the cases repeat prompts); each rank's KV cache holds half the KV heads. One launch of two processes runs every case
  (tp_ranks.py), since each process start imports torch.
- The server: `ddtree-serve --tensor-parallel 2` answers as TP=1 does; a follower killed mid-request
  takes the whole server down, non-zero, with one line naming the rank, and so does one that stalls past
  --rank-timeout; nothing is left behind.
- What is refused before anything starts: a target that does not split, a --device cuda:N, fewer GPUs
  than ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from ddtree_runtime.capacity import Shape
from ddtree_runtime.engine.kv_cache import target_cache_bytes
from ddtree_runtime.model import load_target, parallel, read_safetensors_dir
from ddtree_runtime.model.config import Qwen35Config, target_config
from ddtree_runtime.server import ranks
from ddtree_runtime.server.cli import main as serve_main
from ddtree_devtools.server_process import ServerProcess, free_port

RANKS = Path(__file__).with_name("tp_ranks.py")


@pytest.fixture(scope="module")
def both_ranks(tiny_models, tiny_hybrid_models, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp") / "results.json"
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, str(RANKS), str(rank), str(port), str(out), str(tiny_models),
                               str(tiny_hybrid_models)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in (1, 0)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    return json.loads(out.read_text())


@pytest.mark.parametrize("pair", ["tiny-models-seed0", "tiny-hybrid-seed0"])
def test_two_ranks_give_the_tokens_of_one(both_ranks, pair):
    result = both_ranks[pair]
    assert result["kv_heads"] == [2, 1]  # each rank's KV pages hold its own KV heads
    assert result["prefix_hits"] > 0  # prefix reuse ran over both ranks too
    assert set(result["tp2"]) == set(result["tp1"])
    for case, tokens in result["tp1"].items():
        assert result["tp2"][case] == tokens, case
        assert tokens and all(tokens) if isinstance(tokens[0], list) else tokens, case
    # --quantize fp8: each rank quantizes its shard; where a shard splits a 128-block (the tiny o_proj's
    # 64 columns a rank) its scales are finer than TP=1's, so the FP8 models agree closely, not exactly
    one, two = result["fp8"]
    assert result["fp8_engine"] == "fp8" and len(two) > 10 and two[:10] == one[:10]
    # --draft-vocab: each rank's drafter holds the rows of the whole head, half of them from the other rank
    # (the whole vocabulary's text on one rank, then the draft vocabulary's on one and on two)
    whole, *drafted = result["vocab"]
    assert result["vocab_head_whole"] and len(whole) > 10 and drafted == [whole, whole]


def test_split_refuses_counts_that_do_not_divide(tiny_hybrid_models):
    cfg = target_config(json.loads((tiny_hybrid_models / "target" / "config.json").read_text()))
    assert isinstance(cfg, Qwen35Config)
    assert parallel.split_problem(cfg, 2) is None
    assert "KV heads (2)" in parallel.split_problem(cfg, 4)
    local = parallel.local_config(cfg, 2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size,
            local.linear_num_key_heads, local.linear_num_value_heads, local.vocab_size) == (2, 1, 128, 1, 2, cfg.vocab_size)
    assert local.linear_state_bytes * 2 == cfg.linear_state_bytes  # a rank's recurrent state: its heads'


@pytest.mark.parametrize("fixture", ["tiny_models", "tiny_hybrid_models"])
def test_a_rank_reads_only_its_shard_of_what_is_cut(request, fixture):
    """The cut keys are read as slices (a rank's shard only), the rest whole; the shard is the same as
    one cut from the whole checkpoint."""
    path = request.getfixturevalue(fixture) / "target"
    cfg = target_config(json.loads((path / "config.json").read_text()))
    whole, lazy = read_safetensors_dir(path), read_safetensors_dir(path, parallel.splits)
    kinds = {key: type(value).__name__ for key, value in lazy.items()}
    assert kinds["model.layers.0.mlp.down_proj.weight"] == "CheckpointSlice"
    assert kinds["model.layers.0.input_layernorm.weight"] == kinds["model.embed_tokens.weight"] == "Tensor"
    tp = parallel.TensorParallel(1, 2, None, None)
    cut, read = parallel.shard_state(whole, cfg, tp), parallel.shard_state(lazy, cfg, tp)
    assert cut.keys() == read.keys() and all(torch.equal(cut[k], read[k]) for k in cut)


@pytest.mark.parametrize("fixture", ["tiny_models", "tiny_hybrid_models"])
def test_a_ranks_shard_is_what_ddops_capacity_counts(request, fixture):
    """ddops sizes a TP server by one GPU's share (capacity.Shape.split): the loaded shard's parameters
    and its caches' bytes are that share's."""
    path = request.getfixturevalue(fixture) / "target"
    config = json.loads((path / "config.json").read_text())
    share = Shape.from_config(config).split(2)
    target = load_target(path, tp=parallel.TensorParallel(1, 2, None, None))
    assert sum(p.numel() for p in target.parameters()) == share.target_parameters()
    for elem in (2, 4):
        assert target_cache_bytes(target.config, 1024, 17, elem) == (
            1024 * share.token_bytes(elem) + share.state_bytes(elem) + share.tree_scratch_bytes(17, elem))


def test_fp8_scales_are_cut_with_their_blocks(tiny_models):
    """An FP8 checkpoint's scales split with their weights when the shards are whole 128-blocks, and are
    refused in one line when not."""
    cfg = target_config(json.loads((tiny_models / "target" / "config.json").read_text()))
    tp = parallel.TensorParallel(1, 2, None, None)
    state = {"model.layers.0.mlp.gate_proj.weight": torch.arange(512 * 4.0).view(512, 4),
             "model.layers.0.mlp.gate_proj.weight_scale_inv": torch.arange(4.0).view(4, 1),
             "model.layers.0.mlp.down_proj.weight": torch.zeros(4, 256),
             "model.layers.0.mlp.down_proj.weight_scale_inv": torch.zeros(1, 2)}
    shard = parallel.shard_state(state, cfg, tp)
    assert shard["model.layers.0.mlp.gate_proj.weight"][0, 0] == 256 * 4
    assert shard["model.layers.0.mlp.gate_proj.weight_scale_inv"].flatten().tolist() == [2.0, 3.0]
    assert shard["model.layers.0.mlp.down_proj.weight"].shape == (4, 128)
    assert shard["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 1)
    state["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(384, 4)
    state["model.layers.0.mlp.gate_proj.weight_scale_inv"] = torch.zeros(3, 1)
    with pytest.raises(ValueError, match="--quantize fp8"):
        parallel.shard_state(state, cfg, tp)


@pytest.mark.parametrize("extra,message", [
    (["--tensor-parallel", "4"], "KV heads (2) do not split evenly over 4 ranks"),
    (["--tensor-parallel", "2", "--device", "cuda:1"], "give --device cuda, not cuda:1"),
    (["--tensor-parallel", "9"], "--tensor-parallel 9: must be <= 8"),
    pytest.param(["--tensor-parallel", "2", "--device", "cuda"], "--tensor-parallel 2 needs 2 GPUs",
                 marks=pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 GPUs")),
])
def test_bad_tensor_parallel_is_one_line_and_exit_2(tiny_models, capsys, extra, message):
    argv = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"), *extra]
    assert serve_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def _args(models: Path, *extra: str) -> list[str]:
    return ["--target", str(models / "target"), "--draft", str(models / "draft"), "--device", "cpu",
            "--max-running", "2", *extra]


def _complete(srv: ServerProcess, max_tokens: int, timeout: float = 60) -> httpx.Response:
    body = {"prompt": "The cat", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=timeout)


def _followers(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """The process exited (an orphan may linger as a zombie until its new parent reaps it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if "State:\tZ" in Path(f"/proc/{pid}/status").read_text():
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_server_over_two_ranks_answers_as_one_and_stops_with_its_follower(tiny_hybrid_models):
    with ServerProcess(_args(tiny_hybrid_models)) as one:
        one.wait_ready()
        expected = _complete(one, 12).json()["choices"][0]["text"]
    with ServerProcess(_args(tiny_hybrid_models, "--tensor-parallel", "2")) as srv:
        srv.wait_ready()
        (follower,) = _followers(srv.proc.pid)
        assert httpx.get(srv.url + "/health").json()["tensor_parallel"] == 2
        assert _complete(srv, 12).json()["choices"][0]["text"] == expected
        srv.signal(signal.SIGTERM)  # drains, then ends its follower
        assert srv.wait_exit(timeout=30) == 0
        assert _gone(follower)


def test_a_follower_killed_mid_request_takes_the_server_down(tiny_models):
    with ServerProcess(_args(tiny_models, "--tensor-parallel", "2")) as srv:
        srv.wait_ready()
        (follower,) = _followers(srv.proc.pid)
        answer: list = []
        waiting = threading.Thread(target=lambda: answer.append(_safe(lambda: _complete(srv, 1500, timeout=30))))
        waiting.start()
        time.sleep(1.0)  # the long request is being decoded
        os.kill(follower, signal.SIGKILL)
        assert srv.wait_exit(timeout=20) == 1
        waiting.join(30)
        assert f"tensor-parallel rank 1 (pid {follower}) exited with signal SIGKILL: stopping the server" in \
            srv.log_tail()
        assert isinstance(answer[0], httpx.HTTPError) or answer[0].status_code >= 500  # never a whole answer


def test_a_stalled_follower_is_named_and_ends_the_server(tiny_models):
    """A follower that stops (SIGSTOP) fails no collective: rank 0 just waits in one. Past --rank-timeout
    the watchdog names it and ends the server, so requests are never left hanging behind an "ok"."""
    with ServerProcess(_args(tiny_models, "--tensor-parallel", "2", "--rank-timeout", "5")) as srv:
        srv.wait_ready()
        (follower,) = _followers(srv.proc.pid)
        os.kill(follower, signal.SIGSTOP)
        try:
            answer = _safe(lambda: _complete(srv, 8, timeout=60))
            assert srv.wait_exit(timeout=30) == 1
        finally:
            _resume(follower)
        assert f"tensor-parallel rank 1 (pid {follower}) is stopped: a submit waited on the ranks for more than " \
               "5 s (--rank-timeout): stopping the server" in srv.log_tail()
        assert isinstance(answer, httpx.HTTPError) or answer.status_code >= 500  # never an answer
        assert _gone(follower)


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # killed with the server already
        pass


def test_a_follower_exits_when_rank_0_is_gone(tmp_path):
    """What a follower runs beside its engine (ranks.follow): its parent killed, it exits within a
    moment with one line, whatever its main thread is blocked in."""
    log = tmp_path / "follower.log"
    follower = ("import logging, time; from ddtree_runtime.server import ranks; logging.basicConfig(); "
                "ranks.watch_leader(1); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", "import os, subprocess, sys, time; "
                               f"env = {{**os.environ, {ranks.LEADER_ENV!r}: str(os.getpid())}}; "
                               f"p = subprocess.Popen([sys.executable, '-c', {follower!r}], env=env, "
                               f"stderr=open({str(log)!r}, 'w')); print(p.pid, flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    assert _gone(pid)
    assert f"tensor-parallel rank 1: rank 0 (pid {parent.pid}) is gone: exiting" in log.read_text()


def _safe(call):
    try:
        return call()
    except httpx.HTTPError as exc:  # the server went away mid-answer
        return exc
