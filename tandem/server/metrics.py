"""`/metrics`: the engine's counters and gauges in Prometheus' text format."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tandem.types import EngineStats

_GAUGES = [
    ("num_running_reqs", "Requests running (holding KV pages)", lambda s: s.num_running),
    ("num_queue_reqs", "Requests waiting to be scheduled", lambda s: s.num_queued),
    ("num_paused_reqs", "Requests held by a pause", lambda s: s.num_paused),
    ("cache_hit_rate", "Prefill tokens served from the prefix cache / all prefill tokens", lambda s: s.cache_hit_rate),
    ("kv_pages_total", "KV pages in the pool", lambda s: s.pages_total),
    ("kv_pages_free", "KV pages free", lambda s: s.pages_free),
    ("kv_pages_cached", "KV pages held only by the prefix cache (evictable)", lambda s: s.pages_cached),
    ("host_kv_pages_total", "KV pages in the host tier", lambda s: s.host_pages_total),
    ("host_kv_pages_free", "KV pages of the host tier free", lambda s: s.host_pages_free),
    ("cache_reuse_vs_ideal", "Prompt tokens served from the cache / those an ideal cache would serve",
     lambda s: s.reuse_vs_ideal),
    ("weight_version", "Weight version the engine holds", lambda s: s.weight_version),
]
_COUNTERS = [
    ("generation_tokens", "Tokens generated", lambda s: s.generated_tokens),
    ("prefill_tokens_computed", "Prompt tokens computed in prefill", lambda s: s.prefill_tokens_computed),
    ("prefill_tokens_cached", "Prompt tokens served from the prefix cache", lambda s: s.prefill_tokens_cached),
    ("prefill_tokens_host", "Prompt tokens loaded back from the host tier", lambda s: s.prefill_tokens_host),
    ("prompt_tokens_cached", "Prompt tokens served from the cache on first admission",
     lambda s: s.prompt_tokens_cached),
    ("prompt_tokens_ideal", "Prompt tokens an ideal cache would have served", lambda s: s.prompt_tokens_ideal),
    ("host_kv_pages_loaded", "KV pages copied from the host tier to the device", lambda s: s.host_pages_loaded),
    ("host_kv_pages_backed_up", "KV pages copied from the device to the host tier", lambda s: s.host_pages_backed_up),
    ("num_retractions", "Requests retracted (KV dropped, to be recomputed)", lambda s: s.num_retractions),
    ("num_finished_reqs", "Requests finished (any reason)", lambda s: s.num_finished),
    ("num_aborted_reqs", "Requests aborted", lambda s: s.num_aborted),
    ("num_steps", "Engine steps run", lambda s: s.num_steps),
    ("num_decode_steps", "Engine steps of one token per request (decode)", lambda s: s.decode_steps),
    ("running_request_steps", "Requests in each step, summed over steps", lambda s: s.running_request_steps),
    ("waiting_request_steps", "Requests waiting at each step, summed over steps", lambda s: s.waiting_request_steps),
    ("command_waits", "Commands that waited for the step in flight", lambda s: s.command_waits),
    ("slow_iterations", "Engine steps or commands slow enough to be logged (every request waited)",
     lambda s: s.slow_iterations),
]


# the chat sessions' store (`tandem.server.sessions.SessionStore.stats`): counters by its key
_SESSION_COUNTERS = {
    "created": "Chat sessions created", "expired": "Chat sessions expired (idle too long)",
    "evicted": "Chat sessions evicted (the store full)", "deleted": "Chat sessions deleted by their clients",
    "turns": "Session chat turns served", "reused": "Session turns served from the session's token history",
    "fallbacks": "Session turns that re-tokenized the whole conversation (it did not extend the history)",
}


class MetricsExporter:
    """A Prometheus registry of its own (so several servers in one process do not collide) exporting one
    `EngineStats` snapshot (and the chat sessions' counters, if the server keeps sessions) per scrape, under the
    `tandem:` prefix."""

    def __init__(self):
        self.stats, self.sessions = EngineStats(), None
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def render(self, stats: EngineStats, sessions: dict | None = None) -> bytes:
        self.stats, self.sessions = stats, sessions
        return generate_latest(self.registry)

    def collect(self):
        for name, doc, get in _GAUGES:
            yield GaugeMetricFamily(f"tandem:{name}", doc, value=get(self.stats))
        for name, doc, get in _COUNTERS:
            yield CounterMetricFamily(f"tandem:{name}", doc, value=get(self.stats))
        if self.sessions is not None:
            yield GaugeMetricFamily("tandem:sessions_active", "Chat sessions held", value=self.sessions["active"])
            for key, doc in _SESSION_COUNTERS.items():
                yield CounterMetricFamily(f"tandem:session_{key}", doc, value=self.sessions[key])
