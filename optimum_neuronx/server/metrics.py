"""The server's Prometheus metrics (GET /metrics), in a registry of their own per app."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        prefix = "optimum_neuronx_"
        self.requests = Counter(f"{prefix}requests", "HTTP generation requests answered, by status code",
                                ["status"], registry=registry)
        self.prompt_tokens = Counter(f"{prefix}prompt_tokens", "Prompt tokens of finished requests",
                                     registry=registry)
        self.generation_tokens = Counter(f"{prefix}generation_tokens", "Tokens generated", registry=registry)
        self.requests_in_flight = Gauge(f"{prefix}requests_in_flight", "Requests admitted and not finished",
                                        registry=registry)
        self.running = Gauge(f"{prefix}requests_running", "Requests holding a slot", registry=registry)
        self.waiting = Gauge(f"{prefix}requests_waiting", "Requests queued for a slot (queue depth)",
                             registry=registry)
        self.time_to_first_token = Histogram(f"{prefix}time_to_first_token_seconds",
                                             "From arrival to the first generated token", registry=registry,
                                             buckets=_LATENCY_BUCKETS)
        self.inter_token_latency = Histogram(f"{prefix}inter_token_latency_seconds",
                                             "Between one generated token and the next of a request",
                                             registry=registry, buckets=_LATENCY_BUCKETS)
        self.e2e_latency = Histogram(f"{prefix}e2e_request_latency_seconds", "From arrival to the last token",
                                     registry=registry, buckets=_LATENCY_BUCKETS)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
