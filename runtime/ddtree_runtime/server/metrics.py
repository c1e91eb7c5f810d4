"""The server's /metrics, through prometheus_client.

Two kinds of metric, each declared in one place:

- updated as things happen (requests, prefill, rounds): a prometheus_client object built in
  ``Metrics.__init__`` and fed by an ``observe_*`` method; a new one goes beside them;
- read when scraped (queue depth, engine totals kept elsewhere): ``add_gauge``/``add_counter`` with a
  callable, from wherever the value lives (the app wires them in ``create_app``).

Each ``Metrics`` has its own registry, so two servers in one process (tests) never share a series. The
client's ``*_created`` series are off: the exposition keeps the names and labels it had before this
module used the library.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ddtree_runtime.server.timeline import Timeline

PREFIX = "ddtree"
# The text format 0.0.4 that generate_latest writes (the library's CONTENT_TYPE_LATEST names a newer one).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

ROUND_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REQUEST_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

prometheus_client.disable_created_metrics()


@dataclass(frozen=True)
class _ReadAtScrape:
    name: str
    help_text: str
    read: Callable[[], float | dict[str, float]]
    family: type[GaugeMetricFamily] | type[CounterMetricFamily]
    label: str | None = None  # read() gives one value per value of this label


class _ScrapeTimeValues:
    """A collector for the values kept elsewhere: each is read once per scrape."""

    def __init__(self) -> None:
        self.values: list[_ReadAtScrape] = []

    def collect(self) -> Iterator[Metric]:
        for v in self.values:
            if v.label is None:
                yield v.family(f"{PREFIX}_{v.name}", v.help_text, value=float(v.read()))
                continue
            family = v.family(f"{PREFIX}_{v.name}", v.help_text, labels=[v.label])
            for key, value in sorted(v.read().items()):
                family.add_metric([key], float(value))
            yield family


def _acceptance_buckets(max_length: int) -> tuple[float, ...]:
    return tuple(float(i) for i in range(1, max(max_length, 1) + 1))


class Metrics:
    def __init__(self, max_acceptance_length: int = 16) -> None:
        self.registry = CollectorRegistry()
        own = {"namespace": PREFIX, "registry": self.registry}
        # --- updated as things happen ---
        self.requests = Counter("requests", "HTTP requests answered, by endpoint and status code.",
                                ["endpoint", "status"], **own)
        self.request_duration = Histogram("request_duration_seconds",
                                          "Time from request to last byte of the response.", ["endpoint"],
                                          buckets=REQUEST_LATENCY_BUCKETS, **own)
        self.generated_tokens = Counter("generated_tokens", "Tokens committed by the engine.", **own)
        self.prefill_duration = Histogram("prefill_duration_seconds",
                                          "Wall time of a prompt's prefill (to the first token).",
                                          buckets=REQUEST_LATENCY_BUCKETS, **own)
        self.rounds = Counter("rounds", "Engine decoding rounds after prefill (draft, verify, commit).", **own)
        self._acceptance_lock = threading.Lock()  # the histogram is swapped once, on the worker thread
        self._acceptance_seen = False
        self.acceptance = self._acceptance_histogram(max_acceptance_length)
        self.round_duration = Histogram("round_duration_seconds", "Wall time of one decoding round.",
                                        buckets=ROUND_LATENCY_BUCKETS, **own)
        # a finished request's way to its first round (server/timeline.py): which stage a slow start is in
        lat, fine = REQUEST_LATENCY_BUCKETS, ROUND_LATENCY_BUCKETS
        self.prep_duration = Histogram("request_prep_seconds", "From a request's arrival to its hand-off to "
                                       "the engine thread: reading, parsing, tokenizing.", buckets=fine, **own)
        self.queue_wait = Histogram("queue_wait_seconds", "From a request's hand-off to the engine thread to "
                                    "the start of the step that admitted it.", buckets=lat, **own)
        self.time_to_first_token = Histogram("time_to_first_token_seconds", "From a request's arrival to its "
                                             "prefill's token out of the engine.", buckets=lat, **own)
        self.time_to_first_round = Histogram("time_to_first_round_seconds", "From a request's arrival to its "
                                             "first decoding round out of the engine.", buckets=lat, **own)
        # --- read when scraped ---
        self._scrape_time = _ScrapeTimeValues()
        self.registry.register(self._scrape_time)

    def _acceptance_histogram(self, max_length: int) -> Histogram:
        return Histogram("acceptance_length", "Tokens committed per decoding round (accepted draft tokens + 1).",
                         namespace=PREFIX, registry=self.registry, buckets=_acceptance_buckets(max_length))

    def set_max_acceptance_length(self, n: int) -> None:
        """The engine's block size is only known once it loads; rebuild the (still empty) buckets."""
        with self._acceptance_lock:
            if not self._acceptance_seen:
                self.registry.unregister(self.acceptance)
                self.acceptance = self._acceptance_histogram(n)

    def add_gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self._scrape_time.values.append(_ReadAtScrape(name, help_text, read, GaugeMetricFamily))

    def add_counter(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """A counter kept elsewhere (the engine's own totals), read at scrape time; ``name`` ends in _total."""
        self._scrape_time.values.append(_ReadAtScrape(name, help_text, read, CounterMetricFamily))

    def add_counters(self, name: str, help_text: str, label: str, read: Callable[[], dict[str, float]]) -> None:
        """Counters kept elsewhere, one per value of `label` (read() maps each to its count), read at scrape time."""
        self._scrape_time.values.append(_ReadAtScrape(name, help_text, read, CounterMetricFamily, label))

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.request_duration.labels(endpoint).observe(seconds)

    def observe_prefill(self, seconds: float, new_tokens: int) -> None:
        self.generated_tokens.inc(new_tokens)
        self.prefill_duration.observe(seconds)

    def observe_round(self, seconds: float, acceptance_length: int, new_tokens: int) -> None:
        self.rounds.inc()
        self.generated_tokens.inc(new_tokens)
        self.round_duration.observe(seconds)
        with self._acceptance_lock:
            self._acceptance_seen = True
            self.acceptance.observe(acceptance_length)

    def observe_timeline(self, timeline: Timeline) -> None:
        """A request that ran to its end: the stages it reached, from its arrival."""
        t = timeline
        for histogram, start, end in ((self.prep_duration, t.arrived, t.handed),
                                      (self.queue_wait, t.handed, t.admitted),
                                      (self.time_to_first_token, t.arrived, t.first_token),
                                      (self.time_to_first_round, t.arrived, t.first_round)):
            if end is not None and start is not None:
                histogram.observe(end - start)

    def render(self) -> str:
        return generate_latest(self.registry).decode()
