"""Prometheus metrics, named `agentserve:*` like vLLM's `vllm:*`.

Two sources. Per-request latencies (TTFT, inter-token latency, end-to-end,
queue time), per-program job completion time and the scheduler's TTL
decisions are observed as they happen, on the engine thread (`ServerMetrics`
is the engine's listener; prometheus-client is thread-safe). Engine state
(running/waiting requests, KV usage, pins) and the scheduler's cumulative
counters are read from an `EngineSnapshot` taken on the engine thread when
/metrics is scraped, so a scrape never reads a structure a step is changing.

Each server has its own CollectorRegistry, so tests can run several servers in
one process and the default registry's process metrics stay out of the way."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from agentserve.engine.llm_engine import RequestOutput
from agentserve.server.engine_snapshot import EngineSnapshot

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

P = "agentserve:"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0)
_JCT_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 900.0, 1800.0, 3600.0)
_TTL_BUCKETS = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


SHARED_KV_HELP = {  # the shared KV directory's counters (runner/shared_kv.py), and one gauge
    "shared_kv_blocks_imported": "Blocks a prompt reloaded from the shared KV directory (--disk-kv-shared) "
                                 "instead of recomputing them.",
    "shared_kv_files_rejected": "Shared KV files found and rejected (corrupt, or of another model, layout or "
                                "tenant): recomputed, never read.",
    "shared_kv_blocks_written": "Blocks of finished turns this server wrote through to the shared KV directory.",
    "shared_kv_write_failures": "Writes to the shared KV directory that failed.",
    "shared_kv_blocks_skipped": "Blocks not written through because the writes waiting were at their bound.",
    "shared_kv_files_owned": "Files in the shared KV directory this server wrote and keeps (its byte budget "
                             "counts these; it evicts only these).",
}


class _SnapshotCollector(Collector):
    """Engine state from the latest snapshot, as gauges and counters."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: EngineSnapshot | None = None

    def collect(self):
        s = self.snapshot
        if s is None:
            return
        labels, value = ["model_name"], [self.model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(P + name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(P + name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting for admission.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of device KV blocks in use (running or pinned).", s.kv_usage)
        yield gauge("kv_cache_blocks", "Device KV blocks in all.", s.num_blocks)
        yield gauge("kv_cache_free_blocks", "Device KV blocks free (empty or cached and evictable).",
                    s.num_free_blocks)
        yield gauge("pinned_blocks", "Device KV blocks held by program pins.", s.num_pinned_blocks)
        yield gauge("pinned_programs", "Programs whose KV is pinned across a tool call.", s.num_pinned_programs)
        yield gauge("protected_blocks", "Free device KV blocks of multi-turn programs between turns, evicted last "
                    "(--protected-kv-share).", s.num_protected_blocks)
        yield gauge("running_kv_share", "Share of the device KV the running requests may hold (1: no bound; the "
                    "agentserve policy keeps the rest for programs between turns where it holds one).",
                    s.running_kv_share)
        yield gauge("max_wait_seconds", "Seconds a request arriving now may wait before it goes first (0: no deadline; "
                    "the agentserve policy's wait bound with a host tier, its deadline while it keeps room).",
                    s.max_wait_s)
        yield gauge("kv_pressure", "Share of recent time (decayed over 20 s) a request was held back for KV: the "
                    "agentserve policy's cost of a pinned second, and with a host tier under 0.5 its order is the "
                    "shortest turn first.", s.kv_pressure)
        yield counter("prompt_tokens", "Prompt tokens of admitted requests.", s.admitted_prompt_tokens)
        yield counter("prefix_hit_tokens", "Prompt tokens found in the prefix cache at admission.", s.hit_tokens)
        yield counter("prefix_loaded_tokens", "Prefix-hit tokens reloaded from the host tier.", s.loaded_tokens)
        yield counter("preemptions", "Running requests preempted for lack of KV.", s.preemptions)
        yield counter("pins_created", "Pins made at the end of a turn.", s.pins_created)
        yield counter("pins_hit", "Pins still held when the program's next turn was admitted.", s.pins_hit)
        yield counter("pins_expired", "Pins released at the end of their TTL.", s.pins_expired)
        yield counter("pins_reclaimed", "Pins released early because another program needed the KV.",
                      s.pins_reclaimed)
        yield counter("pins_released_early", "Pins the policy released before their TTL.", s.pins_released_early)
        yield counter("pins_released_at_end", "Pins dropped because their program ended.", s.pins_released_at_end)
        yield counter("kv_retired_blocks", "Cached blocks only an ended program's chain held, sent to the cold "
                      "end of eviction.", s.retired_blocks)
        yield counter("prefetch_issued", "Reloads of a program's KV from the host or disk tier issued before its "
                      "predicted next turn (the agentserve policy's prefetch).", s.prefetch_issued)
        yield counter("prefetch_blocks", "KV blocks those prefetches reloaded.", s.prefetch_blocks)
        yield counter("prefetch_used", "Prefetches whose turn came after they landed and found every block on the "
                      "device.", s.prefetch_used)
        yield counter("prefetch_late", "Prefetches whose turn came while they were in flight (it waited for them).",
                      s.prefetch_late)
        yield counter("prefetch_wasted", "Prefetches whose blocks were evicted before their turn came, or whose "
                      "program ended first.", s.prefetch_wasted)
        yield counter("prefetch_wasted_blocks", "Prefetched blocks evicted (or left) unused.", s.prefetch_wasted_blocks)
        yield counter("prefetch_cancelled", "Prefetches not issued because the reload would have taken KV that "
                      "running or waiting requests needed.", s.prefetch_cancelled)
        yield counter("prefetch_staged", "Disk -> host stages of a prefetch: a program's KV read from the disk tier "
                      "into the host tier before its predicted next turn.", s.prefetch_staged)
        yield counter("prefetch_staged_blocks", "KV blocks those stages read.", s.prefetch_staged_blocks)
        yield counter("prefetch_stage_used", "Stages whose turn came after they landed and found every block in the "
                      "host tier or on the device.", s.prefetch_stage_used)
        yield counter("prefetch_stage_late", "Stages whose turn came while they were in flight (it waited for them).",
                      s.prefetch_stage_late)
        yield counter("prefetch_stage_wasted", "Stages whose host copies were evicted before their turn came, or "
                      "whose program ended first.", s.prefetch_stage_wasted)
        yield counter("prefetch_stage_wasted_blocks", "Staged blocks evicted (or left) unused.",
                      s.prefetch_stage_wasted_blocks)
        yield counter("prefetch_stage_cancelled", "Stages not issued because no host slot was free of copies under "
                      "way.", s.prefetch_stage_cancelled)
        t = s.tool_calls
        yield counter("tool_call_validated_requests", "Chat requests a streaming tool-call validator followed.",
                      t.requests)
        yield counter("tool_call_valid_calls", "Tool calls the validators saw close, naming a declared tool.", t.calls)
        yield counter("tool_call_early_stops", "Requests ended at the structural close of their tool call(s).",
                      t.early_stops)
        yield counter("tool_call_early_stop_budget_left", "max_tokens left when early stops ended requests: an "
                      "upper bound of the decode tokens they saved.", t.budget_left)
        yield counter("tool_call_grace_tokens", "Tokens decoded after the last call's close (waiting for a parallel "
                      "call) by requests that early stops then ended.", t.grace_tokens)
        yield counter("tool_call_undeclared", "Tool calls naming a tool the request did not declare (never returned "
                      "as calls).", t.undeclared)
        yield counter("tool_call_malformed", "Tool-call blocks that did not parse as a call (returned as text).",
                      t.malformed)
        yield counter("tool_call_regenerations", "Undeclared tool calls re-generated under the tools' grammar.",
                      t.regenerations)
        yield counter("tool_call_validator_fallbacks", "Requests whose validator turned off on an inconsistency "
                      "(they decoded plainly).", t.fallbacks)
        yield gauge("kv_window_parts", "Blocks' sliding-window-layer KV kept apart (the hybrid cache: "
                    "--kv-layout); each takes kv_window_part_blocks more blocks.", s.window_parts)
        yield gauge("kv_window_part_blocks", "Blocks one window part takes (0: no hybrid cache).",
                    s.window_part_blocks)
        yield gauge("kv_window_parts_unheld", "Window parts no running request or pin reads: free, evicted "
                    "by recency with the cached blocks.", s.window_parts_unheld)
        yield counter("kv_window_parts_evicted", "Window parts evicted for their blocks.", s.window_parts_evicted)
        yield gauge("host_kv_blocks", "Host-tier KV block slots in all (0: no host tier).", s.host_blocks)
        yield gauge("host_kv_blocks_used", "Host-tier slots holding a copy of a block.", s.host_blocks_used)
        yield gauge("disk_kv_blocks", "Disk-tier KV block files the byte budget allows (0: no disk tier).",
                    s.disk_blocks)
        yield gauge("disk_kv_blocks_used", "Disk-tier block files holding a block.", s.disk_blocks_used)
        yield counter("disk_kv_blocks_written", "Blocks written to the disk tier (host copies it evicted).",
                      s.disk_blocks_written)
        yield counter("kv_tier_copy_failures", "Copies between the device, host and disk tiers that failed (their "
                      "tokens are recomputed, never read).", s.tier_copy_failures)
        yield counter("kv_spill_backlog_waits", "Batches of copies held up because the spills to the disk tier "
                      "waiting in memory were at their bound: the disk writes slower than the host tier evicts.",
                      s.spill_backlog_waits)
        if s.shared_kv is not None:
            for name, doc in SHARED_KV_HELP.items():
                make = gauge if name.endswith("_owned") else counter
                yield make(name, doc, s.shared_kv[name])
        yield counter("engine_steps", "Scheduler steps.", s.steps)
        yield counter("kv_integrity_failures", "Block-accounting checks (run each time the engine goes idle) "
                      "that failed: a bug, logged with its details; should stay 0.", s.kv_integrity_failures)
        sp = s.speculation
        yield counter("spec_steps", "Steps that verified speculative draft tokens.", sp.steps)
        yield counter("spec_draft_tokens", "Prompt-lookup draft tokens verified.", sp.draft_tokens)
        yield counter("spec_accepted_tokens", "Verified draft tokens that were accepted (tokens gained without a "
                      "forward pass of their own).", sp.accepted_tokens)
        yield counter("spec_fallbacks", "Verifications found inconsistent, decoded plainly instead.", sp.fallbacks)
        yield counter("spec_capped_steps", "Steps whose draft rows stopped short at the step-time target "
                      "(--max-step-ms-with-decodes).", sp.capped_steps)
        yield counter("grouped_prefill_requests", "Requests that waited for another request's prefill of their "
                      "shared prefix instead of computing it too.", s.grouped_requests)
        yield counter("engine_executed_steps", "Steps that ran the model.", s.executed_steps)
        yield counter("engine_decode_steps", "Steps that ran the model with requests decoding (forward passes "
                      "that decoded; a request's first token comes from its prefill step).", s.decode_steps)
        r = s.render_cache
        if r is not None:
            yield counter("render_cache_hits", "Chat prompts tokenized only past a cached earlier prompt.", r.hits)
            yield counter("render_cache_misses", "Chat prompts with no cached earlier prompt: tokenized in full.",
                          r.misses)
            yield counter("render_cache_fallbacks", "Chat prompts whose cached earlier prompt could not be reused "
                          "safely: tokenized in full.", r.fallbacks)
            yield counter("render_cache_reused_tokens", "Chat prompt tokens taken from the render cache.",
                          r.reused_tokens)
            yield counter("render_cache_tokenized_tokens", "Chat prompt tokens the tokenizer produced.",
                          r.tokenized_tokens)
            yield gauge("render_cache_entries", "Prompts held by the render cache.", r.entries)
            yield gauge("render_cache_tokens", "Tokens held by the render cache's entries.", r.tokens)
        c = s.response_cache
        if c is not None:
            yield counter("response_cache_hits", "Requests answered from the response cache.", c.hits)
            yield counter("response_cache_misses", "Requests looked up in the response cache and sent to the "
                          "engine.", c.misses)
            yield counter("response_cache_stores", "Finished outputs stored in the response cache.", c.stores)
            yield counter("response_cache_bypassed", "Requests that skipped the response cache (Cache-Control).",
                          c.bypassed)
            yield gauge("response_cache_entries", "Responses held by the response cache.", c.entries)


class ServerMetrics:
    """The server's registry; also the engine's listener (see engine_snapshot.EngineListener)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.model_name = model_name
        self._ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token.", lab,
                               buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self._itl = Histogram(P + "inter_token_latency_seconds", "Time between two output tokens of a request.",
                              lab, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self._e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token of a finished request.",
                              lab, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self._queue = Histogram(P + "request_queue_time_seconds", "Time a finished request spent waiting for "
                                "admission (first admission and after preemptions).", lab,
                                buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self._jct = Histogram(P + "program_jct_seconds", "Job completion time of ended programs: first request's "
                              "arrival to the last response, tool time included.", lab, buckets=_JCT_BUCKETS,
                              registry=r).labels(model_name)
        self._ttl = Histogram(P + "pin_ttl_seconds", "TTLs the policy chose when pinning a program's KV.", lab,
                              buckets=_TTL_BUCKETS, registry=r).labels(model_name)
        self._finished = Counter(P + "request_success", "Finished requests by finish reason.",
                                 ["model_name", "finished_reason"], registry=r)
        self._gen_tokens = Counter(P + "generation_tokens", "Output tokens generated.", lab,
                                   registry=r).labels(model_name)
        self._engine = _SnapshotCollector(model_name)
        r.register(self._engine)

    # --- engine listener (engine thread) ---

    def on_request_output(self, out: RequestOutput, now: float, last_token_time: float | None) -> None:
        n = len(out.new_token_ids)
        if n:
            self._gen_tokens.inc(n)
            if last_token_time is None:
                if out.first_token_time is not None:
                    self._ttft.observe(out.first_token_time - out.arrival_time)
            else:
                gap = (now - last_token_time) / n
                for _ in range(n):
                    self._itl.observe(gap)
        if out.finished:
            self._finished.labels(self.model_name, out.finish_reason or "unknown").inc()
            if out.finish_time is not None:
                self._e2e.observe(out.finish_time - out.arrival_time)
            self._queue.observe(out.queue_time)

    def on_request_aborted(self) -> None:
        self._finished.labels(self.model_name, "abort").inc()

    def on_program_end(self, jct: float) -> None:
        self._jct.observe(max(jct, 0.0))

    def on_ttl_decisions(self, ttls: list[float]) -> None:
        for t in ttls:
            self._ttl.observe(t)

    # --- scrape ---

    def render(self, snapshot: EngineSnapshot | None) -> bytes:
        """The exposition text; engine-state metrics come from `snapshot` (None: left out)."""
        self._engine.snapshot = snapshot
        return generate_latest(self.registry)
