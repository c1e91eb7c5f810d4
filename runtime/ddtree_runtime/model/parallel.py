"""Tensor parallelism for the target, Megatron-style: one process per GPU, each holding a shard of every
layer, in lockstep (engine/distributed.py keeps their engines so).

- Column-parallel: q/k/v (by heads), gate/up (by intermediate rows), a Gated DeltaNet layer's input
  projections and conv (by key and value heads): each rank computes its own heads end to end, so its KV
  cache pages hold only its KV heads and its recurrent and conv state only its heads.
- Row-parallel: o_proj, down_proj and a Gated DeltaNet's out_proj take those heads' outputs; each rank's
  partial product is summed by one all-reduce (rank 0 adds the residual into its part, so the sum is
  the layer's output as one device would give it, up to the order of the additions).
- The LM head is split by vocabulary (padded to a multiple of the ranks); its logits are all-gathered,
  so top-K, the tree and sampling see the whole vocabulary, the same on every rank.
- The embeddings, the norms and the drafter are replicated: the drafter is small, and each of its
  layers split would cost two all-reduces of its own.

A rank's model is built from its `local_config` (the per-rank head and row counts), so every size the
engine derives from the config (KV page bytes, a hybrid's state slots, the capacity) is the rank's own.
Weights are cut from the full checkpoint at load (`shard_state`): each rank keeps only its shard."""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import Qwen35Config, Qwen3Config
from .fp8 import BLOCK
from .kernels import residual_linear

# Rendezvous and the compute group's collectives: a rank may wait this long for the others (loading a
# 27B shard from a cold disk takes minutes).
COMPUTE_TIMEOUT = datetime.timedelta(minutes=30)
# The control group: a follower waits for rank 0's next call for as long as the server is idle.
CONTROL_TIMEOUT = datetime.timedelta(days=365)

# Projections split by output rows (their heads or intermediate rows), and those split by input columns
# (whose outputs are all-reduced); everything else is replicated.
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "in_proj_z", "in_proj_b", "in_proj_a")
ROW_PARALLEL = ("o_proj", "down_proj", "out_proj")
PER_HEAD = ("dt_bias", "A_log")           # a Gated DeltaNet's per-value-head parameters
QKV_CHANNELS = ("in_proj_qkv", "conv1d")  # a Gated DeltaNet's [q | k | v] channels


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among the ranks of one server."""
    rank: int
    world: int
    group: dist.ProcessGroup    # the model's collectives: NCCL on CUDA, gloo on the CPU
    control: dist.ProcessGroup  # gloo: rank 0's engine calls and the figures every rank must agree on


_current: TensorParallel | None = None
# all_gather_into_tensor's new name (torch 2.13 warns at the old one; the runtime takes torch >= 2.4)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def init(rank: int, world: int, port: int, device: torch.device) -> TensorParallel:
    """Join the server's ranks (rendezvous on 127.0.0.1:port, rank 0 hosting it) and make this process's
    TensorParallel current. On CUDA the NCCL communicator is set up here, before any CUDA graph is
    captured (a collective's first call cannot be captured)."""
    global _current
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=COMPUTE_TIMEOUT, **({"device_id": device} if device.type == "cuda" else {}))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    tp = TensorParallel(rank, world, dist.group.WORLD, control)
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe, group=tp.group)
    if int(probe.item()) != world:
        raise RuntimeError(f"tensor parallel: an all-reduce over {world} ranks gave {probe.item()}")
    _current = tp
    return tp


def current() -> TensorParallel | None:
    """This process's TensorParallel, or None when it serves alone."""
    return _current


def agreed_minimum(value: int) -> int:
    """The smallest of every rank's `value` (free memory: every rank must size the same pool); the value
    itself when serving alone. Every rank must call it at the same point."""
    if _current is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_current.control)
    return int(t.item())


# ---- the layers' collectives -------------------------------------------------------------------------

def reduced(t: torch.Tensor, tp: TensorParallel | None) -> torch.Tensor:
    """A row-parallel projection's output summed over the ranks, in place (as is without TP)."""
    if tp is not None:
        dist.all_reduce(t, group=tp.group)
    return t


def add_reduced(x: torch.Tensor, y: torch.Tensor, linear: nn.Module, tp: TensorParallel | None) -> torch.Tensor:
    """x + linear(y) for a row-parallel linear: rank 0's GEMM adds the residual (kernels.residual_linear),
    the others' give their partial products alone, and one all-reduce sums them."""
    if tp is None:
        return residual_linear(x, y, linear)
    return reduced(residual_linear(x, y, linear) if tp.rank == 0 else linear(y), tp)


class VocabParallelHead(nn.Linear):
    """The LM head's rows of this rank (vocab padded to a multiple of the ranks); its forward returns the
    logits of the whole vocabulary, gathered from every rank. The state dict key stays `lm_head.weight`."""

    def __init__(self, hidden: int, vocab: int, tp: TensorParallel) -> None:
        super().__init__(hidden, -(-vocab // tp.world), bias=False)
        self.vocab, self.tp = vocab, tp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # h: [M, H] -> [M, V]: each rank's [M, V/world] side by side
        part = F.linear(h.reshape(-1, h.shape[-1]), self.weight)
        whole = part.new_empty(self.tp.world * part.shape[0], part.shape[1])  # rank r's rows r*M..
        _all_gather(whole, part, group=self.tp.group)
        logits = whole.view(self.tp.world, *part.shape).permute(1, 0, 2).reshape(part.shape[0], -1)
        if logits.shape[1] != self.vocab:  # the padding rows' columns
            logits = logits[:, :self.vocab].contiguous()
        return logits.view(*h.shape[:-1], self.vocab)


def head_rows(head: nn.Linear, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [N] of the LM head, whole on every rank ([N, H], a copy): a vocab-parallel head's rank
    fills its own rows and one all-reduce adds the others' (each row is one rank's, the rest zeros)."""
    if not isinstance(head, VocabParallelHead):
        return head.weight.index_select(0, ids)
    own = head.weight.shape[0]
    local = ids - head.tp.rank * own
    mine = (local >= 0) & (local < own)
    rows = head.weight.new_zeros(ids.shape[0], head.weight.shape[1])
    rows[mine] = head.weight[local[mine]]
    dist.all_reduce(rows, group=head.tp.group)
    return rows


# ---- splitting a model --------------------------------------------------------------------------------

def split_problem(cfg: Qwen3Config, world: int) -> str | None:
    """Why the target cannot be split over `world` ranks (a count that does not divide), in one line."""
    counts = [("attention heads", cfg.num_attention_heads), ("KV heads", cfg.num_key_value_heads),
              ("MLP intermediate size", cfg.intermediate_size)]
    if isinstance(cfg, Qwen35Config):
        counts += [("linear-attention key heads", cfg.linear_num_key_heads),
                   ("linear-attention value heads", cfg.linear_num_value_heads)]
    for what, n in counts:
        if n % world:
            return (f"--tensor-parallel {world}: the target's {what} ({n}) do not split evenly over {world} "
                    f"ranks; use a tensor-parallel size that divides {n}")
    return None


def local_config(cfg: Qwen3Config, world: int) -> Qwen3Config:
    """The config of one rank's shard: its heads and intermediate rows (the vocabulary stays whole: the
    logits are gathered). ValueError when the target does not split over `world`."""
    problem = split_problem(cfg, world)
    if problem:
        raise ValueError(problem)
    changes = {"num_attention_heads": cfg.num_attention_heads // world,
               "num_key_value_heads": cfg.num_key_value_heads // world,
               "intermediate_size": cfg.intermediate_size // world}
    if isinstance(cfg, Qwen35Config):
        changes.update(linear_num_key_heads=cfg.linear_num_key_heads // world,
                       linear_num_value_heads=cfg.linear_num_value_heads // world)
    return dataclasses.replace(cfg, **changes)


def shard_model(model: nn.Module, tp: TensorParallel) -> None:
    """Make a model built from local_config a rank's shard: the vocab-parallel LM head, and every module
    with a `tp` slot (the row-parallel projections' owners) reducing over the ranks."""
    cfg = model.config
    model.lm_head = VocabParallelHead(cfg.hidden_size, cfg.vocab_size, tp)
    for m in model.modules():
        if hasattr(m, "tp") and m is not model.lm_head:
            m.tp = tp


def splits(key: str) -> bool:
    """Whether a target key is cut between the ranks (the others are whole on each): the loader reads
    only the shard of such a key (loading.CheckpointSlice)."""
    owner, _, param = key.rpartition(".")
    return key == "lm_head.weight" or (".layers." in key and _dim_of(owner.rpartition(".")[2], param) is not None)


def shard_state(state: dict[str, torch.Tensor], cfg: Qwen3Config, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This rank's shard of a full target state dict (ours: loading.py's names), cut by `cfg`'s (the full
    model's) shapes; a value may be a loading.CheckpointSlice, read only where it is cut. Only the
    language model's layers and head are cut (a multimodal checkpoint's other weights stay as they are,
    and are never loaded). An FP8 checkpoint's block scales are cut with their weights, which needs every
    shard to be whole 128-blocks (ValueError otherwise)."""
    out = {}
    for key, value in state.items():
        owner, _, param = key.rpartition(".")
        owner = owner.rpartition(".")[2]
        dim = _dim_of(owner, param) if key.startswith("model.layers.") else None
        if key == "lm_head.weight":  # rows r*S.. of the vocabulary padded to world*S
            rows = -(-cfg.vocab_size // tp.world)
            lo, hi = tp.rank * rows, min((tp.rank + 1) * rows, value.shape[0])
            part = value.narrow(0, lo, max(hi - lo, 0))
            out[key] = torch.cat([part, part.new_zeros(rows - part.shape[0], part.shape[1])])
        elif owner in ROW_PARALLEL and param == "bias":  # added once, after the sum
            whole = _whole(value)
            out[key] = whole if tp.rank == 0 else torch.zeros_like(whole)
        elif dim is None:
            out[key] = _whole(value)
        elif param == "weight_scale_inv":  # in blocks: the weight's segments must be whole blocks per rank
            weight = state[key.removesuffix("_scale_inv")]
            out[key] = _cut(key, value, dim, _blocks(key, _segments(owner, weight, dim, cfg), dim, tp.world), tp)
        else:
            out[key] = _cut(key, value, dim, _segments(owner, value, dim, cfg), tp)
    return out


def _dim_of(owner: str, param: str) -> int | None:
    """The dimension a layer parameter is cut along (None: replicated)."""
    if owner in COLUMN_PARALLEL and param in ("weight", "bias", "weight_scale_inv"):
        return 0
    if owner in ROW_PARALLEL and param in ("weight", "weight_scale_inv"):
        return 1
    if param in PER_HEAD or (owner in QKV_CHANNELS and param in ("weight", "weight_scale_inv")):
        return 0
    return None


def _segments(owner: str, value, dim: int, cfg: Qwen3Config) -> list[int]:
    """The consecutive parts along `dim` that are each cut in `world` shares: a Gated DeltaNet's q, k and
    v channels, else the whole dimension."""
    if owner in QKV_CHANNELS:
        keys = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        return [keys, keys, cfg.linear_num_value_heads * cfg.linear_value_head_dim]
    return [value.shape[dim]]


def _whole(value) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else value.whole()


def _blocks(key: str, sizes: list[int], dim: int, world: int) -> list[int]:
    if any(size % (BLOCK * world) for size in sizes):
        raise ValueError(f"{key}: this fp8 checkpoint's {BLOCK}-blocks do not split over {world} ranks "
                         f"(dim {dim} of {sizes}); serve the 16-bit checkpoint with --quantize fp8")
    return [size // BLOCK for size in sizes]


def _cut(key: str, value, dim: int, sizes: list[int], tp: TensorParallel) -> torch.Tensor:
    """This rank's share of each consecutive segment of `sizes` along `dim`, side by side (never a view:
    the whole tensor is freed)."""
    pieces, start = [], 0
    for size in sizes:
        if size % tp.world:
            raise ValueError(f"{key}: {size} along dim {dim} does not split over {tp.world} ranks")
        share = size // tp.world
        pieces.append(value.narrow(dim, start + tp.rank * share, share))
        start += size
    if len(pieces) > 1:
        return torch.cat(pieces, dim)
    return pieces[0].clone() if isinstance(value, torch.Tensor) else pieces[0]  # not a view of the whole
