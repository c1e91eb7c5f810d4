"""Prometheus text exposition, written by hand (no client library).

Counters and histograms are updated from the event loop and from the engine worker thread, so every
update and the rendering take one lock.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable

PREFIX = "ddtree"

ROUND_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REQUEST_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in pairs)
    return "{" + inner + "}" if inner else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += 1
        self.sum += value

    def lines(self, name: str, labels: tuple[tuple[str, str], ...] = ()) -> list[str]:
        out = []
        for bound, count in zip(self.buckets, self.counts):
            out.append(f"{name}_bucket{_labels(labels + (('le', _number(bound)),))} {count}")
        out.append(f"{name}_bucket{_labels(labels + (('le', '+Inf'),))} {self.total}")
        out.append(f"{name}_sum{_labels(labels)} {_number(self.sum)}")
        out.append(f"{name}_count{_labels(labels)} {self.total}")
        return out


class Metrics:
    def __init__(self, max_acceptance_length: int = 16) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str], int] = {}
        self._request_latency: dict[str, _Histogram] = {}
        self._tokens = 0
        self._rounds = 0
        self._round_latency = _Histogram(ROUND_LATENCY_BUCKETS)
        self._prefill_latency = _Histogram(REQUEST_LATENCY_BUCKETS)
        self._acceptance = _Histogram(tuple(float(i) for i in range(1, max_acceptance_length + 1)))
        # Read at scrape time: (name, help, callable returning a number, type).
        self._gauges: list[tuple[str, str, Callable[[], float], str]] = []

    def set_max_acceptance_length(self, n: int) -> None:
        """The engine's block size is only known once it loads; rebuild the (still empty) buckets."""
        with self._lock:
            if self._acceptance.total == 0:
                self._acceptance = _Histogram(tuple(float(i) for i in range(1, max(n, 1) + 1)))

    def add_gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self._gauges.append((name, help_text, read, "gauge"))

    def add_counter(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """A counter kept elsewhere (the engine's own totals), read at scrape time."""
        self._gauges.append((name, help_text, read, "counter"))

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        with self._lock:
            key = (endpoint, str(status))
            self._requests[key] = self._requests.get(key, 0) + 1
            hist = self._request_latency.setdefault(endpoint, _Histogram(REQUEST_LATENCY_BUCKETS))
            hist.observe(seconds)

    def observe_prefill(self, seconds: float, new_tokens: int) -> None:
        with self._lock:
            self._tokens += new_tokens
            self._prefill_latency.observe(seconds)

    def observe_round(self, seconds: float, acceptance_length: int, new_tokens: int) -> None:
        with self._lock:
            self._rounds += 1
            self._tokens += new_tokens
            self._round_latency.observe(seconds)
            self._acceptance.observe(acceptance_length)

    def render(self) -> str:
        with self._lock:
            lines = [
                f"# HELP {PREFIX}_requests_total HTTP requests answered, by endpoint and status code.",
                f"# TYPE {PREFIX}_requests_total counter",
            ]
            for (endpoint, status), count in sorted(self._requests.items()):
                lines.append(f"{PREFIX}_requests_total{_labels((('endpoint', endpoint), ('status', status)))} {count}")
            lines += [
                f"# HELP {PREFIX}_request_duration_seconds Time from request to last byte of the response.",
                f"# TYPE {PREFIX}_request_duration_seconds histogram",
            ]
            for endpoint, hist in sorted(self._request_latency.items()):
                lines += hist.lines(f"{PREFIX}_request_duration_seconds", (("endpoint", endpoint),))
            lines += [
                f"# HELP {PREFIX}_generated_tokens_total Tokens committed by the engine.",
                f"# TYPE {PREFIX}_generated_tokens_total counter",
                f"{PREFIX}_generated_tokens_total {self._tokens}",
                f"# HELP {PREFIX}_prefill_duration_seconds Wall time of a prompt's prefill (to the first token).",
                f"# TYPE {PREFIX}_prefill_duration_seconds histogram",
                *self._prefill_latency.lines(f"{PREFIX}_prefill_duration_seconds"),
                f"# HELP {PREFIX}_rounds_total Engine decoding rounds after prefill (draft, verify, commit).",
                f"# TYPE {PREFIX}_rounds_total counter",
                f"{PREFIX}_rounds_total {self._rounds}",
                f"# HELP {PREFIX}_acceptance_length Tokens committed per decoding round (accepted draft tokens + 1).",
                f"# TYPE {PREFIX}_acceptance_length histogram",
                *self._acceptance.lines(f"{PREFIX}_acceptance_length"),
                f"# HELP {PREFIX}_round_duration_seconds Wall time of one decoding round.",
                f"# TYPE {PREFIX}_round_duration_seconds histogram",
                *self._round_latency.lines(f"{PREFIX}_round_duration_seconds"),
            ]
        for name, help_text, read, kind in self._gauges:
            lines += [
                f"# HELP {PREFIX}_{name} {help_text}",
                f"# TYPE {PREFIX}_{name} {kind}",
                f"{PREFIX}_{name} {_number(float(read()))}",
            ]
        return "\n".join(lines) + "\n"
