"""`ferrolm serve`'s /metrics: Prometheus's text format, written by ``prometheus_client``
(part of the serve extra). Without it the server runs as before and /metrics answers 501
naming the extra.

    ferrolm_requests_total{route, status}        HTTP requests answered, by route and status
    ferrolm_prompt_tokens_total                  prompt tokens of the requests admitted
    ferrolm_generation_tokens_total              tokens generated (a finished choice's completion tokens)
    ferrolm_queue_length                         sequences waiting for a batch row
    ferrolm_running_sequences                    sequences in the batch
    ferrolm_time_to_first_token_seconds          from a request's submission to the engine (its body
                                                 read, its chat rendered) to each choice's first token

Each app keeps its own registry (two servers in one process count apart). Counting happens
on the thread that has the event (the engine's for tokens and first tokens): the client's
counters take a lock and an add, nothing that holds a step back.
"""

from __future__ import annotations

from typing import Callable, Optional

__all__ = ["ServeMetrics", "MISSING"]

MISSING = 'metrics need the prometheus_client package: pip install "ferrolm[serve]"'
# Seconds: a CPU's prefill of a long prompt behind a full batch reaches tens of seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServeMetrics:
    """The server's counters; every method does nothing when prometheus_client is absent
    (``available`` False). ``counts()`` gives the engine's (running, waiting) sequences."""

    def __init__(self, counts: Callable[[], tuple[int, int]], routes: tuple[str, ...]):
        self.routes = frozenset(routes)
        try:
            import prometheus_client as prom
        except ImportError:
            self.registry = None
            return
        self.registry = reg = prom.CollectorRegistry()
        self._prom = prom
        self._requests = prom.Counter(
            "ferrolm_requests", "HTTP requests answered, by route and status", ["route", "status"], registry=reg
        )
        self._prompt = prom.Counter("ferrolm_prompt_tokens", "prompt tokens of the requests admitted", registry=reg)
        self._generated = prom.Counter("ferrolm_generation_tokens", "tokens generated", registry=reg)
        prom.Gauge("ferrolm_queue_length", "sequences waiting for a batch row", registry=reg).set_function(
            lambda: counts()[1]
        )
        prom.Gauge("ferrolm_running_sequences", "sequences in the batch", registry=reg).set_function(
            lambda: counts()[0]
        )
        self._ttft = prom.Histogram(
            "ferrolm_time_to_first_token_seconds",
            "from a request's submission to the engine to each choice's first token",
            buckets=TTFT_BUCKETS,
            registry=reg,
        )

    @property
    def available(self) -> bool:
        return self.registry is not None

    def request(self, path: str, status: int) -> None:
        if self.registry is not None:
            route = path if path in self.routes else "other"  # a bounded set of labels, whatever is asked
            self._requests.labels(route, str(status)).inc()

    def prompt_tokens(self, n: int) -> None:
        if self.registry is not None:
            self._prompt.inc(n)

    def generated(self, n: int) -> None:
        if self.registry is not None:
            self._generated.inc(n)

    def first_token(self, seconds: float) -> None:
        if self.registry is not None:
            self._ttft.observe(seconds)

    def exposition(self) -> Optional[tuple[bytes, str]]:
        """(body, content type) of the text format; None without prometheus_client."""
        if self.registry is None:
            return None
        return self._prom.generate_latest(self.registry), self._prom.CONTENT_TYPE_LATEST

    def middleware(self, app):
        """An ASGI app around ``app`` that counts each HTTP request by path and status."""

        async def counted(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            status = 500  # the app raised before answering

            async def watch(message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            try:
                await app(scope, receive, watch)
            finally:
                self.request(scope["path"], status)

        return counted
