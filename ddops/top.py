"""`ddops top`: the fleet over time, from the status probe read again every refresh.

Each host is polled on its own thread (one facts probe per refresh, with every runtime's /metrics read
in the same round trip), so a host that stops answering is shown as such while the others refresh.
A target's figures are windows between its last two readings: rates from counter deltas, p50/p95 from
histogram bucket deltas (as Prometheus's histogram_quantile does), never lifetime averages. Alarms
(`ddops.alarms`) look at a host's last few samples. Nothing here prints: `topview` renders a frame.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import DdopsError, HostUnreachable
from .executor import Executor
from .facts import check_identity, gather, tensor_parallel
from .gpuhealth import summary as gpu_summary
from .inventory import Host

HISTORY = 4   # samples kept per host: a queue "growing for three refreshes" needs four


@dataclass(frozen=True)
class ServerMetrics:
    """Where one kind of server keeps the figures top shows (sample names in its /metrics)."""

    kind: str
    tokens: str
    running: str
    waiting: str
    ttft_buckets: str
    capacity: str | None = None
    acceptance_sum: str | None = None     # a histogram's sum and count: mean over the window
    acceptance_count: str | None = None
    acceptance_gauge: str | None = None   # or the server's own recent mean (SGLang)
    round_buckets: str | None = None
    requests: str | None = None           # a counter labelled by `status`

    def names(self) -> list[str]:
        return [v for k, v in vars(self).items() if k != "kind" and v]


DDTREE = ServerMetrics(
    kind="ddtree", tokens="ddtree_generated_tokens_total", running="ddtree_running_requests",
    waiting="ddtree_queue_depth", capacity="ddtree_max_running_requests",
    ttft_buckets="ddtree_prefill_duration_seconds_bucket", acceptance_sum="ddtree_acceptance_length_sum",
    acceptance_count="ddtree_acceptance_length_count", round_buckets="ddtree_round_duration_seconds_bucket",
    requests="ddtree_requests_total")
SGLANG = ServerMetrics(
    kind="sglang", tokens="sglang:generation_tokens_total", running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs", ttft_buckets="sglang:time_to_first_token_seconds_bucket",
    acceptance_gauge="sglang:spec_accept_length")
SERVERS = (DDTREE, SGLANG)
WANTED = sorted({name for s in SERVERS for name in s.names()})
# Requests to these are the watchers' own (a probe, a scrape), not the service's errors.
UNCOUNTED_ENDPOINTS = ("/health", "/metrics")


# -- one reading of one target's /metrics ---------------------------------------------------------

@dataclass(frozen=True)
class Reading:
    """A target's counters and gauges at one moment (`at`: the host's clock when it was read)."""

    kind: str
    at: float
    tokens: float
    running: float | None
    waiting: float | None
    capacity: float | None
    acceptance_sum: float
    acceptance_count: float
    acceptance_gauge: float | None
    ttft: dict[float, float]      # bucket upper bound -> cumulative count (math.inf for +Inf)
    rounds: dict[float, float]
    errors_4xx: float
    errors_5xx: float


def read_metrics(scraped: dict[str, Any]) -> Reading | None:
    """The probe's scrape of one target as a Reading; None when it failed or the server is unknown."""
    if scraped.get("error") or not scraped.get("samples"):
        return None
    samples = scraped["samples"]
    names = {s[0] for s in samples}
    server = next((s for s in SERVERS if s.tokens in names or s.running in names), None)
    if server is None:
        return None

    def total(name: str | None, keep: Callable[[dict], bool] = lambda labels: True) -> float:
        return sum(v for n, labels, v in samples if n == name and keep(labels))

    def gauge(name: str | None) -> float | None:
        values = [v for n, _, v in samples if n == name]
        return sum(values) if values else None

    def buckets(name: str | None) -> dict[float, float]:
        out: dict[float, float] = {}
        for n, labels, v in samples:
            if n == name and "le" in labels:
                bound = float(labels["le"])
                out[bound] = out.get(bound, 0.0) + v
        return out

    def errors(first_digit: str) -> float:
        return total(server.requests, lambda labels: labels.get("status", "").startswith(first_digit)
                     and labels.get("endpoint") not in UNCOUNTED_ENDPOINTS)

    return Reading(kind=server.kind, at=float(scraped["at"]), tokens=total(server.tokens),
                   running=gauge(server.running), waiting=gauge(server.waiting), capacity=gauge(server.capacity),
                   acceptance_sum=total(server.acceptance_sum), acceptance_count=total(server.acceptance_count),
                   acceptance_gauge=gauge(server.acceptance_gauge), ttft=buckets(server.ttft_buckets),
                   rounds=buckets(server.round_buckets), errors_4xx=errors("4"), errors_5xx=errors("5"))


# -- windows: what happened between two readings ---------------------------------------------------

def increase(before: float, after: float) -> float:
    """A counter's increase; a counter that went down restarted from zero (Prometheus's rule)."""
    return after - before if after >= before else after


def quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """The q-quantile of what was observed between two readings of a cumulative histogram, linearly
    interpolated inside its bucket; None when nothing was observed. Past the last finite bound the
    answer is that bound."""
    bounds = sorted(after)
    if not bounds or math.inf not in after:
        return None
    restarted = any(after[b] < before.get(b, 0.0) for b in bounds)   # then the window is all it has now
    delta = {b: after[b] - (0.0 if restarted else before.get(b, 0.0)) for b in bounds}
    count = delta[math.inf]
    if count <= 0:
        return None
    rank = q * count
    lower, below = 0.0, 0.0
    for bound in bounds:
        if delta[bound] >= rank:
            if math.isinf(bound):
                return lower
            inside = delta[bound] - below
            return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = bound, delta[bound]
    return lower


@dataclass(frozen=True)
class Window:
    seconds: float
    tokens_per_s: float | None
    acceptance: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    round_p50_s: float | None
    round_p95_s: float | None
    errors_4xx: int
    errors_5xx: int


def window(before: Reading, after: Reading) -> Window:
    seconds = after.at - before.at
    tokens = increase(before.tokens, after.tokens)
    if after.acceptance_gauge is not None:
        acceptance = after.acceptance_gauge
    else:
        rounds = increase(before.acceptance_count, after.acceptance_count)
        acceptance = increase(before.acceptance_sum, after.acceptance_sum) / rounds if rounds > 0 else None
    return Window(seconds=round(seconds, 3), tokens_per_s=tokens / seconds if seconds > 0 else None,
                  acceptance=acceptance,
                  ttft_p50_s=quantile(0.5, before.ttft, after.ttft), ttft_p95_s=quantile(0.95, before.ttft, after.ttft),
                  round_p50_s=quantile(0.5, before.rounds, after.rounds),
                  round_p95_s=quantile(0.95, before.rounds, after.rounds),
                  errors_4xx=int(increase(before.errors_4xx, after.errors_4xx)),
                  errors_5xx=int(increase(before.errors_5xx, after.errors_5xx)))


# -- a host's sample: its facts, and each serving target in them -----------------------------------

@dataclass(frozen=True)
class Target:
    """One serving endpoint on a host: a unit with a port, or a replica behind the balancer."""

    unit: str
    port: int
    active: str | None            # systemd's ActiveState (None: not installed)
    restarts: int | None
    main_pid: int | None
    since: str | None
    healthy: bool
    health: str
    balancer: str | None          # how HAProxy sees a replica (UP, DRAIN, DOWN, MAINT...); None: no balancer
    reading: Reading | None
    scrape_error: str | None
    tensor_parallel: int | None   # the GPUs its server spans (None: not a server ddops knows)


def _port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


def _health_word(h: dict[str, Any]) -> str:
    detail = h.get("detail")
    if isinstance(detail, dict):
        return str(detail.get("status") or detail.get("detail") or "")
    return str(detail or "")[:60]


RUNNING = ("active", "activating", "reloading")


def targets(facts: dict[str, Any]) -> list[Target]:
    units = {s["unit"]: s for s in facts.get("services", [])}
    out = []

    def target(unit: str, state: dict | None, health: dict, port: int, balancer: str | None,
               scraped: dict | None) -> Target:
        state = state or {}
        installed = state.get("LoadState") not in ("not-found", None)
        return Target(unit=unit, port=port, active=state.get("ActiveState") if installed else None,
                      restarts=state.get("NRestarts"), main_pid=state.get("MainPID"), since=state.get("since"),
                      healthy=bool(health.get("healthy")), health=_health_word(health), balancer=balancer,
                      reading=read_metrics(scraped) if scraped else None,
                      scrape_error=(scraped or {}).get("error"), tensor_parallel=tensor_parallel(state, health))

    runtime = facts.get("runtime", [])
    live = {_port_of(h["url"]) for h in runtime if units.get(h["unit"], {}).get("ActiveState") in RUNNING}
    for h in runtime:
        if units.get(h["unit"], {}).get("LoadState") == "not-found":
            continue   # never deployed here (or its port is a balancer's now): the replicas below say it
        if _port_of(h["url"]) in live and units.get(h["unit"], {}).get("ActiveState") not in RUNNING:
            continue   # another unit serves its port now (llm-two: SGLang's, or the DDTree runtime in its place)
        out.append(target(h["unit"], units.get(h["unit"]), h, _port_of(h["url"]), None, h.get("metrics")))
    for deployment in facts.get("replicas") or []:
        for rep in deployment["replicas"]:
            seen = (rep.get("balancer") or {}).get("status") or "absent"
            out.append(target(rep["unit"], rep.get("state"), rep["health"], rep["port"], seen, rep.get("metrics")))
    return out


@dataclass(frozen=True)
class Sample:
    """What one refresh learnt of a host: its facts, or why it did not answer."""

    host: str
    taken_at: float                      # the control machine's monotonic clock, when the answer came
    facts: dict[str, Any] | None = None
    error: str | None = None
    unreachable: bool = False
    probe_s: float | None = None         # the round trip, seen from here

    @property
    def targets(self) -> list[Target]:
        return targets(self.facts) if self.facts else []


# -- polling ------------------------------------------------------------------------------------

@dataclass
class HostWatch:
    """One host's recent samples and the probe in flight, shared by its poller and the view."""

    host: Host
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    in_flight_since: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, sample: Sample) -> None:
        with self.lock:
            self.history.append(sample)
            self.in_flight_since = None

    def snapshot(self) -> tuple[list[Sample], float | None]:
        with self.lock:
            return list(self.history), self.in_flight_since


def sample_host(executor: Executor, host: Host, api_keys: dict[int, str], timeout: float) -> Sample:
    started = time.monotonic()
    try:
        facts = gather(executor, host, metrics=WANTED, api_keys=api_keys, timeout=timeout)
    except DdopsError as exc:
        return Sample(host.name, time.monotonic(), error=exc.line(), unreachable=isinstance(exc, HostUnreachable))
    now = time.monotonic()
    return Sample(host.name, now, facts=facts, probe_s=round(now - started, 3))


class Poller:
    """A thread per host, each probing once per `interval` (a slow host delays only itself)."""

    def __init__(self, executor: Executor, hosts: list[Host], *, interval: float,
                 api_keys: dict[str, dict[int, str]] | None = None, timeout: float | None = None) -> None:
        self.executor, self.interval = executor, interval
        self.api_keys = api_keys or {}
        self.timeout = timeout if timeout is not None else max(10.0, 3 * interval)
        self.watches = {h.name: HostWatch(h) for h in hosts}
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._poll, args=(w,), name=f"top-{w.host.name}", daemon=True)
                        for w in self.watches.values()]

    def start(self) -> "Poller":
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stopping.set()

    def _poll(self, watch: HostWatch) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            with watch.lock:
                watch.in_flight_since = started
            watch.add(sample_host(self.executor, watch.host, self.api_keys.get(watch.host.name, {}), self.timeout))
            self.stopping.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def samples_at_least(self, n: int) -> bool:
        """Whether every host has answered (or failed) n times."""
        return all(len(w.snapshot()[0]) >= min(n, HISTORY) for w in self.watches.values())


@dataclass(frozen=True)
class Thresholds:
    """What the alarms compare with; min acceptance per (host, port), from the deploy profiles given."""

    min_acceptance: dict[tuple[str, int], float] = field(default_factory=dict)
    gpu_memory_fraction: float = 0.95
    queue_growth_refreshes: int = 3


def host_view(host: Host, history: list[Sample], in_flight_since: float | None, now: float,
              interval: float) -> dict[str, Any]:
    """One host as the view and --json show it: the newest sample's facts, each target's window over
    the last two readings, and whether the host still answers."""
    view: dict[str, Any] = {"host": host.name, "state": "waiting", "error": None, "age_s": None, "probe_s": None,
                            "identity": None, "gpus": [], "driver": None, "gpu_health": [], "kernel_log": None,
                            "training": None, "targets": []}
    last_ok = next((s for s in reversed(history) if s.facts is not None), None)
    newest = history[-1] if history else None
    if newest is not None and newest.facts is None:
        view.update(state="unreachable" if newest.unreachable else "error", error=newest.error)
    elif in_flight_since is not None and now - in_flight_since > max(2 * interval, interval + 2):
        view.update(state="not answering", error=f"no answer for {now - in_flight_since:.0f}s")
    elif newest is not None:
        view["state"] = "ok"
    if last_ok is None:
        return view
    facts = last_ok.facts
    view.update(age_s=round(now - last_ok.taken_at, 1), probe_s=last_ok.probe_s,
                identity=check_identity(host.expect, facts).ok, gpus=facts["gpus"]["list"],
                training=_training(facts.get("training")), **gpu_summary(facts))
    before = next((s for s in reversed(history[:-1]) if s.facts is not None and s is not last_ok), None)
    earlier = {(t.unit, t.port): t for t in before.targets} if before else {}
    for t in last_ok.targets:
        prev = earlier.get((t.unit, t.port))
        w = window(prev.reading, t.reading) if prev and prev.reading and t.reading else None
        r = t.reading
        view["targets"].append({
            "unit": t.unit, "port": t.port, "tensor_parallel": t.tensor_parallel, "kind": r.kind if r else None,
            "active": t.active,
            "restarts": t.restarts, "healthy": t.healthy, "health": t.health, "balancer": t.balancer,
            "running": r.running if r else None, "capacity": r.capacity if r else None,
            "waiting": r.waiting if r else None, "scrape_error": t.scrape_error,
            "window": vars(w) if w else None})
    return view


def _training(t: dict[str, Any] | None) -> dict[str, Any] | None:
    if not t:
        return None
    newest = t.get("newest_checkpoint") or {}
    return {"running": t["running"], "step": t.get("last_step"), "loss": t.get("last_loss"),
            "checkpoint_step": newest.get("step")}


def settings_from_profiles(profiles: list, inventory) -> tuple[Thresholds, dict[str, dict[int, str]]]:
    """The alarms' acceptance floor and the API keys /metrics needs, by host and port, from the
    deploy profiles given: every port a profile serves on each of its hosts (its unit's, its replicas')."""
    from .credentials import read_secrets

    floors: dict[tuple[str, int], float] = {}
    keys: dict[str, dict[int, str]] = {}
    for profile in profiles:
        ports = [profile.port] + ([r.port for r in profile.replicas.members] if profile.replicas else [])
        secret = next((v for k, v in read_secrets(profile).items() if k.endswith("API_KEY")), None)
        for host in inventory.groups.get(profile.host, [profile.host]):
            for port in ports:
                floors[(host, port)] = profile.smoke.min_acceptance
                if secret:
                    keys.setdefault(host, {})[port] = secret
    return Thresholds(min_acceptance=floors), keys
