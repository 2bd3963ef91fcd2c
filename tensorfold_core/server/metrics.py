"""/metrics in Prometheus' text format: vLLM's names where vLLM has one, tensorfold's for the rest."""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .served import ServedHost

# vLLM's buckets, so dashboards made for vLLM read these histograms unchanged
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
ROUTES = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/models", "/health")


class HostCollector:
    """What the host knows at scrape time: streams, the ledger, the prompt cache, drafts and guard verdicts."""

    def __init__(self, host: ServedHost):
        self.host = host

    def collect(self):
        report = self.host.metrics()
        yield GaugeMetricFamily("vllm:num_requests_running", "Streams decoding now.", value=report["running"])
        yield GaugeMetricFamily("vllm:num_requests_waiting", "Requests queued for admission.",
                                value=report["waiting"])
        ledger = GaugeMetricFamily("tensorfold:ledger_bytes", "Bytes the memory ledger holds, by kind.",
                                   labels=["kind"])
        for kind, nbytes in sorted(report["ledger"].items()):
            ledger.add_metric([kind], nbytes)
        yield ledger
        yield GaugeMetricFamily("tensorfold:ledger_budget_bytes", "The memory ledger's budget.",
                                value=report["budget"])
        cache = report["prompt_cache"]
        yield CounterMetricFamily("tensorfold:prompt_cache_hits", "Admissions that resumed a kept prompt state.",
                                  value=cache.get("hits", 0))
        yield CounterMetricFamily("tensorfold:prompt_cache_queries", "Admissions that looked for a kept state.",
                                  value=cache.get("hits", 0) + cache.get("misses", 0))
        spec = report["spec"]
        for name, what in (("num_drafts", "Windows that carried drafts."),
                           ("num_draft_tokens", "Draft tokens verified."),
                           ("num_accepted_tokens", "Draft tokens accepted.")):
            yield CounterMetricFamily(f"vllm:spec_decode_{name}", what, value=spec[name])
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted, by position in the window.", labels=["position"])
        for position, count in enumerate(spec["accepted_per_position"]):
            per_position.add_metric([str(position)], count)
        yield per_position
        for key, name, what in (("windows", "drafted_windows", "Windows that carried drafts"),
                                ("draft_tokens", "draft_tokens", "Draft tokens verified"),
                                ("accepted_tokens", "accepted_draft_tokens", "Draft tokens accepted")):
            family = CounterMetricFamily(f"tensorfold:{name}", f"{what}, by the proposer that gave them (copy, recall, "
                                         "grammar, or the drafter's name).", labels=["source"])
            for source, counts in sorted(spec["by_source"].items()):
                family.add_metric([source], counts[key])
            yield family
        verdicts = CounterMetricFamily("tensorfold:guard_windows", "Windows that could draft, by what the "
                                       "pricing and guards let them do.", labels=["verdict"])
        for verdict, count in sorted(spec["verdicts"].items()):
            verdicts.add_metric([verdict], count)
        yield verdicts
        yield CounterMetricFamily("tensorfold:drafts_cut_by_grammar", "Drafts cut before the verify because the "
                                  "request's grammar refused them.", value=spec["cut_by_grammar"])


class Metrics:
    """One registry per app (several servers may share a process); the server side observes requests here."""

    def __init__(self, host: ServedHost):
        self.registry = CollectorRegistry()
        self.registry.register(HostCollector(host))
        self.http = Counter("tensorfold:http_requests", "HTTP requests answered, by route and status.",
                            ["route", "status"], registry=self.registry)
        self.finished = Counter("vllm:request_success", "Requests finished, by finish reason.",
                                ["finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens read.", registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to the first token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens (a round's tokens share its "
                             "wait).", buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from submit to the last token.",
                             buckets=E2E_BUCKETS, registry=self.registry)

    def tokens(self, since: float, count: int, first: bool) -> float:
        """`count` tokens of a stream arrived at once (one round), `since` the last ones (or the submit, for the
        first): the first token's wait is the TTFT; a round's tokens share its wait evenly."""
        now = time.monotonic()
        wait = now - since
        if first:
            self.ttft.observe(wait)
            wait, count = 0.0, count - 1  # the rest of the first round came with the first token
        for _ in range(count):
            self.itl.observe(wait / count)
        return now

    def done(self, submitted: float, finish_reason: str, usage: dict) -> None:
        self.e2e.observe(time.monotonic() - submitted)
        self.finished.labels(finish_reason).inc()
        self.prompt_tokens.inc(usage.get("prompt_tokens", 0))
        self.generation_tokens.inc(usage.get("completion_tokens", 0))


def install(app: FastAPI, metrics: Metrics) -> None:
    """The /metrics route, and a count of every answered request by route and status."""

    @app.get("/metrics")
    def scrape():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(CountResponses, metrics=metrics)


class CountResponses:
    """Plain ASGI (no BaseHTTPMiddleware): streams and disconnects pass through untouched."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = []

        async def sending(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if status:
                route = scope["path"] if scope["path"] in ROUTES else "other"
                self.metrics.http.labels(route, str(status[0])).inc()
