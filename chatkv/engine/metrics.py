"""Prometheus metrics of one engine, named and shaped like vLLM's (``vllm:`` names under a
``chatkv:`` prefix), each with a ``model_name`` label.

``EngineMetrics(engine, model_name)`` keeps its collectors in a registry of its own (never
prometheus_client's global one, so one process can hold several engines or servers, and tests
can run several), and ``render()`` gives the text exposition format for ``/metrics``.

- Per request, from the engine's finish listener (``engine.add_finish_listener``): the
  listener only appends ``(usage, finish_reason, preemptions, times)`` to a deque on the engine
  thread; the counters and histograms are updated from it at the next scrape (or ``drain()``),
  off the engine thread.
  Counters: ``prompt_tokens_total``, ``generation_tokens_total``, ``prompt_tokens_cached_total``
  (device prefix hits), ``prompt_tokens_host_total`` (copied back from the host tier),
  ``prompt_tokens_restored_total`` (loaded from a snapshot on disk),
  ``prompt_tokens_computed_total``, ``prefix_cache_queries_total`` / ``prefix_cache_hits_total``
  (tokens looked up / found in any tier, as vLLM counts them), ``num_preemptions_total``,
  ``request_success_total{finished_reason}``; speculative decoding as vLLM counts it:
  ``spec_decode_num_drafts_total`` (verification steps), ``spec_decode_num_draft_tokens_total``
  (proposed tokens), ``spec_decode_num_accepted_tokens_total`` and
  ``spec_decode_num_accepted_tokens_per_pos_total{position}`` (0 = a draft's first token).
  Histograms: ``time_to_first_token_seconds``, ``inter_token_latency_seconds`` (a request's
  mean gap between tokens, observed once per gap: the engine does not time every token),
  ``e2e_request_latency_seconds``, ``request_prompt_tokens``, ``request_generation_tokens``.
- At scrape time, from ``engine.stats()``: gauges ``kv_cache_usage_perc`` (0..1, as vLLM),
  ``num_requests_running`` / ``num_requests_waiting``, ``sessions_in_memory`` /
  ``sessions_on_disk``, host-tier blocks, and counters of spills and restores and their bytes.
  A field the engine's stats lack is left out rather than reported as 0.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "chatkv:"
# vLLM's buckets
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

# engine.stats() field -> (metric, kind, help). Gauges are levels; counters are lifetime totals.
STATS = {
    "kv_cache_usage": (
        "kv_cache_usage_perc",
        "gauge",
        "KV-cache usage: 1 means 100 percent of the device blocks in use",
    ),
    "num_running": ("num_requests_running", "gauge", "Requests in the running batch"),
    "num_waiting": ("num_requests_waiting", "gauge", "Requests waiting to be admitted"),
    "sessions_in_memory": ("sessions_in_memory", "gauge", "Open sessions whose KV is held in memory"),
    "sessions_on_disk": ("sessions_on_disk", "gauge", "Conversations with a KV snapshot on disk"),
    "sessions_open": ("sessions_open", "gauge", "Open sessions"),
    "blocks_total": ("kv_cache_blocks_total", "gauge", "Device KV blocks"),
    "blocks_free": ("kv_cache_blocks_free", "gauge", "Free device KV blocks"),
    "blocks_cached": ("kv_cache_blocks_cached", "gauge", "Device KV blocks held by the prefix cache"),
    "host_blocks_total": ("host_cache_blocks_total", "gauge", "Host-memory tier KV blocks"),
    "host_blocks_used": ("host_cache_blocks_used", "gauge", "Host-memory tier KV blocks in use"),
    "evicted_to_host": ("host_offloaded_blocks", "counter", "Device KV blocks copied to the host tier"),
    "host_hits": ("host_loaded_blocks", "counter", "Host-tier KV blocks copied back to the device"),
    "spills": ("kv_spills", "counter", "Session KV snapshots spilled to disk"),
    "spill_bytes": ("kv_spill_bytes", "counter", "Bytes of KV written to disk"),
    "restores": ("kv_restores", "counter", "Session KV snapshots restored from disk"),
    "restore_bytes": ("kv_restore_bytes", "counter", "Bytes of KV read back from disk"),
}


def engine_stats(engine) -> dict:
    """``engine.stats()`` as a dict (a dataclass's fields, with nested dataclasses flattened)."""
    if hasattr(engine, "stats"):
        stats = engine.stats()
        out = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(stats)
    else:  # an engine without stats(): its KV counts and queue lengths
        out = dict(engine.kv_stats())
        out.update(num_running=len(engine.scheduler.running), num_waiting=len(engine.scheduler.waiting))
    flat = {}
    for k, v in out.items():
        if isinstance(v, dict):
            flat.update({kk: vv for kk, vv in v.items() if kk not in out})
        else:
            flat[k] = v
    if "kv_cache_usage" not in flat and flat.get("blocks_total"):
        flat["kv_cache_usage"] = 1 - flat.get("blocks_free", 0) / flat["blocks_total"]
    return flat


class _StatsCollector:
    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        try:
            stats = engine_stats(self.engine)
        except Exception:  # noqa: BLE001 - a closed engine: no gauges, the rest still scrapes
            return
        for key, (name, kind, doc) in STATS.items():
            value = stats.get(key)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                P + name, doc, labels=["model_name"]
            )
            family.add_metric([self.model_name], float(value))
            yield family


class EngineMetrics:
    def __init__(self, engine, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r, lab = self.registry, ["model_name"]

        def counter(name, doc, labels=lab):
            return Counter(P + name, doc, labels, registry=r)

        def hist(name, doc, buckets):
            return Histogram(P + name, doc, lab, buckets=buckets, registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.cached_tokens = counter("prompt_tokens_cached", "Prompt tokens found in device memory (prefix-cache hits)")
        self.host_tokens = counter("prompt_tokens_host", "Prompt tokens copied back from the host-memory tier")
        self.restored_tokens = counter("prompt_tokens_restored", "Prompt tokens loaded from a KV snapshot on disk")
        self.computed_tokens = counter("prompt_tokens_computed", "Prompt tokens computed by prefill")
        self.reused_tokens = counter("prompt_tokens_reused", "RAG sources' tokens placed from chunk KV (rag_kv_reuse)")
        self.recomputed_tokens = counter(
            "prompt_tokens_recomputed", "RAG sources' tokens recomputed over placed chunk KV"
        )
        self.queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (any tier)")
        self.preemptions = counter("num_preemptions", "Preemptions of running requests")
        self.success = counter("request_success", "Finished requests by finish reason", lab + ["finished_reason"])
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative verification steps (drafts verified)")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative tokens proposed")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Speculative tokens accepted")
        self.spec_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Speculative tokens accepted, by position in the draft",
            lab + ["position"],
        )
        self.ttft = hist("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between generated tokens", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Request latency from arrival to finish", E2E_BUCKETS)
        self.prompt_hist = hist("request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.gen_hist = hist("request_generation_tokens", "Generated tokens per request", TOKEN_BUCKETS)
        self.registry.register(_StatsCollector(engine, model_name))
        self._pending: deque = deque()
        self._drain_lock = threading.Lock()
        engine.add_finish_listener(self._on_finish)

    def _on_finish(self, result, seq) -> None:
        """On the engine thread: keep what the counters need, nothing more."""
        spec = getattr(seq, "spec", None)
        drafts = (spec.drafts, tuple(spec.accepted_per_pos)) if spec is not None else (0, ())
        self._pending.append(
            (
                result.usage,
                result.finish_reason,
                result.preemptions,
                seq.arrival,
                seq.first_token_time,
                seq.finish_time,
                drafts,
            )
        )

    @property
    def pending(self) -> int:
        """Finished requests not yet folded into the counters (``drain`` folds them; a scrape drains)."""
        return len(self._pending)

    def drain(self) -> int:
        """Fold the finished requests into the counters and histograms; how many."""
        n = 0
        m = self.model_name
        with self._drain_lock:
            while self._pending:
                usage, reason, preemptions, arrival, first, finish, (drafts, per_pos) = self._pending.popleft()
                n += 1
                hit = usage.cached_tokens + usage.host_tokens + usage.restored_tokens
                for c, v in (
                    (self.prompt_tokens, usage.prompt_tokens),
                    (self.generation_tokens, usage.generated_tokens),
                    (self.cached_tokens, usage.cached_tokens),
                    (self.host_tokens, usage.host_tokens),
                    (self.restored_tokens, usage.restored_tokens),
                    (self.computed_tokens, usage.computed_tokens),
                    (self.queries, usage.prompt_tokens),
                    (self.hits, hit),
                    (self.preemptions, preemptions),
                    (self.spec_drafts, drafts),
                    (self.spec_draft_tokens, usage.proposed_tokens),
                    (self.spec_accepted, usage.accepted_tokens),
                    (self.reused_tokens, usage.reused_tokens),
                    (self.recomputed_tokens, usage.recomputed_tokens),
                ):
                    if v:
                        c.labels(m).inc(v)
                for pos, v in enumerate(per_pos):
                    self.spec_per_pos.labels(m, str(pos)).inc(v)
                self.success.labels(m, reason).inc()
                self.prompt_hist.labels(m).observe(usage.prompt_tokens)
                self.gen_hist.labels(m).observe(usage.generated_tokens)
                if first is not None:
                    self.ttft.labels(m).observe(usage.ttft_s)
                    if finish is not None and usage.generated_tokens > 1:
                        gap = (finish - first) / (usage.generated_tokens - 1)
                        itl = self.itl.labels(m)
                        for _ in range(usage.generated_tokens - 1):
                            itl.observe(gap)
                if finish is not None:
                    self.e2e.labels(m).observe(max(finish - arrival, 0.0))
        return n

    def render(self) -> bytes:
        """The text exposition of every metric (call off the event loop: it asks the engine thread)."""
        self.drain()
        return generate_latest(self.registry)
