"""Server metrics in the Prometheus text exposition format (version 0.0.4), thread-safe, no dependencies."""
from __future__ import annotations

import math
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TAU_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)

Labels = Tuple[Tuple[str, str], ...]


def _fmt_labels(labels: Labels, extra: Optional[Tuple[str, str]] = None) -> str:
    items = list(labels) + ([extra] if extra else [])
    if not items:
        return ""
    esc = [(k, v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')) for k, v in items]
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc) + "}"


def _fmt_value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


class _Metric:
    def __init__(self, name: str, help: str, kind: str) -> None:
        self.name, self.help, self.kind = name, help, kind
        self._lock = threading.Lock()

    def header(self) -> List[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A monotonically increasing counter with labels."""

    def __init__(self, name: str, help: str) -> None:
        super().__init__(name, help, "counter")
        self._values: Dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Add ``amount`` (>= 0) to the labelled series."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        """Current value of one series (0 if unseen)."""
        return self._values.get(tuple(sorted(labels.items())), 0.0)

    def total(self) -> float:
        """Sum over all label sets."""
        with self._lock:
            return sum(self._values.values())

    def render(self) -> List[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_fmt_labels(k)} {_fmt_value(v)}" for k, v in items]


class Gauge(_Metric):
    """A gauge whose value is set directly or read from a callback per label set."""

    def __init__(self, name: str, help: str) -> None:
        super().__init__(name, help, "gauge")
        self._values: Dict[Labels, float] = {}
        self._callbacks: List[Callable[[], Dict[Labels, float]]] = []

    def set(self, value: float, **labels: str) -> None:
        """Set the labelled series."""
        with self._lock:
            self._values[tuple(sorted(labels.items()))] = float(value)

    def add_callback(self, fn: Callable[[], Dict[Labels, float]]) -> None:
        """Register a function returning {labels: value} evaluated at scrape time."""
        self._callbacks.append(fn)

    def render(self) -> List[str]:
        with self._lock:
            vals = dict(self._values)
        for fn in self._callbacks:
            vals.update(fn())
        return self.header() + [f"{self.name}{_fmt_labels(k)} {_fmt_value(v)}" for k, v in sorted(vals.items())]


class Histogram(_Metric):
    """A cumulative histogram with fixed buckets, per label set."""

    def __init__(self, name: str, help: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help, "histogram")
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._series: Dict[Labels, Tuple[List[int], List[float]]] = {}

    def observe(self, value: float, **labels: str) -> None:
        """Record one observation."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            counts, sc = self._series.setdefault(key, ([0] * len(self.buckets), [0.0, 0.0]))
            for i, b in enumerate(self.buckets):
                if value <= b:
                    counts[i] += 1
            sc[0] += value
            sc[1] += 1

    def count(self, **labels: str) -> int:
        """Number of observations in one series."""
        s = self._series.get(tuple(sorted(labels.items())))
        return int(s[1][1]) if s else 0

    def render(self) -> List[str]:
        lines = self.header()
        with self._lock:
            items = sorted((k, (list(c), list(s))) for k, (c, s) in self._series.items())
        for key, (counts, (total, n)) in items:
            for b, c in zip(self.buckets, counts):
                lines.append(f"{self.name}_bucket{_fmt_labels(key, ('le', _fmt_value(b)))} {c}")
            lines.append(f"{self.name}_sum{_fmt_labels(key)} {_fmt_value(total)}")
            lines.append(f"{self.name}_count{_fmt_labels(key)} {_fmt_value(n)}")
        return lines


class ServerMetrics:
    """All metrics the server exports on GET /metrics."""

    def __init__(self) -> None:
        self.requests = Counter("nemo_spec_requests_total", "HTTP API requests by endpoint and status code.")
        self.prompt_tokens = Counter("nemo_spec_prompt_tokens_total", "Prompt tokens processed.")
        self.completion_tokens = Counter("nemo_spec_completion_tokens_total", "Completion tokens generated.")
        self.latency = Histogram("nemo_spec_request_latency_seconds",
                                 "End-to-end latency of generation requests.", LATENCY_BUCKETS)
        self.ttft = Histogram("nemo_spec_time_to_first_token_seconds",
                              "Time from request arrival to the first generated token.", LATENCY_BUCKETS)
        self.queue_time = Histogram("nemo_spec_queue_time_seconds",
                                    "Time a request waited in the queue before its batch started.", LATENCY_BUCKETS)
        self.tau = Histogram("nemo_spec_acceptance_length",
                             "Acceptance length tau of each generated sequence: tokens per decoding step, prefill excluded.",
                             TAU_BUCKETS)
        self.batch_size = Histogram("nemo_spec_batch_size", "Rows per engine batch.", BATCH_BUCKETS)
        self.queue_depth = Gauge("nemo_spec_queue_depth", "Requests waiting in the queue.")
        self.running = Gauge("nemo_spec_running_rows", "Sequences being generated right now.")
        self.cancelled = Counter("nemo_spec_cancelled_total", "Sequences cancelled (client disconnect).")
        self.rejected = Counter("nemo_spec_rejected_total", "Requests rejected because the queue was full.")

    def render(self) -> str:
        """The full exposition text."""
        lines: List[str] = []
        for m in (self.requests, self.prompt_tokens, self.completion_tokens, self.latency, self.ttft,
                  self.queue_time, self.tau, self.batch_size, self.queue_depth, self.running, self.cancelled,
                  self.rejected):
            lines.extend(m.render())
        return "\n".join(lines) + "\n"
