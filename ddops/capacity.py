"""What the runtime's KV pool will hold on the serving host's GPU, before anything is deployed: the
runtime's own arithmetic (runtime/ddtree_runtime/capacity.py) over the host's GPU memory (the facts
probe) and the models' config.json (read where they sync from). The plan shows it; preflight refuses
a profile in which one request of its max_context cannot fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .bundled import CAPACITY
from .facts import Gpu, HostFacts, Tree
from .profile import Profile


@dataclass(frozen=True)
class PoolEstimate:
    """The pool on one GPU the runtime will use (the smallest, when replicas use several), or why
    there is no estimate (`reason`)."""

    gpu: Gpu | None = None
    capacity: Any = None              # ddtree_runtime.capacity.Capacity
    reason: str | None = None
    longest_context: int | None = None    # where one request of max_context does not fit: what would

    @property
    def line(self) -> str:
        if self.capacity is None:
            return f"KV pool not estimated: {self.reason}"
        ranks = self.capacity.tensor_parallel
        split = (f", one of the {ranks} tensor-parallel GPUs of a server (each holds 1/{ranks} of the target's "
                 "layers and KV, and the whole drafter)") if ranks > 1 else ""
        return f"{self.capacity.summary()} on {self.gpu.label}{split}"

    def as_json(self) -> dict[str, Any]:
        if self.capacity is None:
            return {"estimated": False, "reason": self.reason}
        c = self.capacity
        return {"estimated": True, "gpu": self.gpu.label, "gpu_index": self.gpu.index, "pool_tokens": c.pool_tokens,
                "requests_8k": c.running(min(CAPACITY.SHORT_REQUEST, c.max_context)),
                "requests_max_context": c.running(c.max_context), "max_context": c.max_context,
                "max_running": c.max_running, "token_bytes": c.token_bytes, "weights_bytes": c.weights_bytes,
                "workspace_bytes": c.workspace_bytes, "request_state_bytes": c.request_bytes,
                "memory_bytes": c.memory_bytes, "mem_fraction": c.mem_fraction, "tensor_parallel": c.tensor_parallel}


def serving_gpus(profile: Profile) -> list[int]:
    """The host GPU indexes the runtime runs on: with serve.tensor_parallel N, all N GPUs the unit (or each
    replica) is given; else the `cuda:N` its device names among them."""
    n, ranks = int(profile.device.partition(":")[2] or 0), profile.serve.tensor_parallel
    given = ([r.gpus for r in profile.replicas.members] if profile.replicated else
             [tuple(int(g) for g in profile.gpus.split(",")) if profile.gpus is not None else ()])
    if ranks > 1:
        return sorted({g for gpus in given for g in (gpus or range(ranks))})
    return sorted({gpus[n] if n < len(gpus) else n for gpus in given})


def draft_vocab_rows(extra_args: tuple[str, ...]) -> int:
    """The head rows `--draft-vocab N` in serve.extra_args has the drafter copy (0 without it; a map file's
    count is the host's to know, as ddops does not sync it)."""
    value = None
    for i, arg in enumerate(extra_args):
        if arg == "--draft-vocab" and i + 1 < len(extra_args):
            value = extra_args[i + 1]
        elif arg.startswith("--draft-vocab="):
            value = arg.partition("=")[2]
    return int(value) if value is not None and value.isdigit() else 0


def estimate(profile: Profile, host: HostFacts, trees: dict[str, Tree]) -> PoolEstimate | None:
    """The pool on the serving GPU; None where the runtime does not use one (SGLang, a CPU device)."""
    if profile.engine != "ddtree" or not profile.device.startswith("cuda"):
        return None
    if host.gpu_error:
        return PoolEstimate(reason=f"{profile.host}'s GPUs could not be read ({host.gpu_error})")
    gpus = {g.index: g for g in host.gpus}
    wanted = [gpus.get(i) for i in serving_gpus(profile)]
    if any(g is None or g.memory_total_mib is None for g in wanted):
        return PoolEstimate(reason=f"{profile.host} reports no memory for GPU {serving_gpus(profile)}")
    roles = ("target",) if profile.serve.mode == "ar" else ("target", "draft")
    if any(trees.get(role) is None or trees[role].config is None for role in roles):
        return PoolEstimate(reason="a model's config.json is not readable yet")
    target, draft = trees["target"], trees["draft"] if "draft" in roles else None
    serve = profile.serve
    models = (target.config, draft.config if draft is not None else None)
    settings = dict(dtype=profile.dtype, mem_fraction=serve.mem_fraction, max_running=serve.max_running,
                    tree_budget=serve.tree_budget, block_size=serve.block_size, tensor_parallel=serve.tensor_parallel,
                    prefix_cache=serve.prefix_cache, draft_vocab=draft_vocab_rows(serve.extra_args) if draft else 0)
    try:
        pools = [(g, CAPACITY.pool_capacity(g.memory_total_mib * 2**20, *models, max_context=serve.max_context,
                                            **settings)) for g in wanted]
        gpu, pool = min(pools, key=lambda p: p[1].pool_tokens)
        longest = (CAPACITY.longest_context(gpu.memory_total_mib * 2**20, *models, **settings)
                   if pool.requests(pool.max_context) < 1 else None)
    except (KeyError, TypeError, ValueError) as exc:
        return PoolEstimate(reason=f"the models' config.json lacks what the arithmetic needs ({exc!r})")
    return PoolEstimate(gpu=gpu, capacity=pool, longest_context=longest)


def check_fits(profile: Profile, pool: PoolEstimate | None) -> list[str]:
    """Preflight's problem when one request of the profile's max_context cannot fit in the pool."""
    if pool is None or pool.capacity is None or profile.serve.max_context is None:
        return []
    c = pool.capacity
    if c.requests(c.max_context) >= 1:
        return []
    shorter = f"lower serve.max_context to {pool.longest_context} or less, " if pool.longest_context else ""
    ranks = f", one of serve.tensor_parallel {c.tensor_parallel}," if c.tensor_parallel > 1 else ""
    return [f"one request of serve.max_context {c.max_context} ({profile.where('serve')}) needs "
            f"{c.max_context + c.reserve_tokens:,} tokens of KV pool, and on {profile.host}'s {pool.gpu.label}{ranks} "
            f"the pool holds {c.pool_tokens:,} ({c.breakdown()}); {shorter}raise serve.mem_fraction, lower "
            f"serve.max_running, or serve on a larger GPU or over more of them (serve.tensor_parallel)"]
