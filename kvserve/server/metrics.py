"""Prometheus metrics for the server, rendered in the text exposition format.

A small self-contained implementation (counters, gauges, fixed-bucket histograms,
optional labels) owned by one ServerMetrics object per server: no global registry.
"""
from __future__ import annotations

import math
import time
from bisect import bisect_left

from kvserve.engine.service_class import ServiceClass
from kvserve.engine.stats import AdapterCounters, EngineStats

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                     0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


class Counter:
    """A monotonically increasing count, per label set."""

    kind = "counter"

    def __init__(self, name: str, help_text: str):
        self.name, self.help = name, help_text
        self.values: dict[tuple, float] = {}

    def inc(self, amount: float = 1, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0) + amount

    def set_total(self, total: float, **labels: str) -> None:
        """Mirror a counter kept elsewhere (the engine's)."""
        self.values[tuple(sorted(labels.items()))] = total

    def render(self) -> list[str]:
        values = self.values or {(): 0}
        return [f"{self.name}{_labels(dict(k))} {_number(v)}" for k, v in values.items()]


class Gauge(Counter):
    """A value that goes up and down. ``additive``: whether summing it over replicas means
    something (a count or a size: yes; a rate, a ratio, a fitted constant, a time stamp: no);
    the cluster's aggregate series (``kvserve/cluster/metrics.py``) sum only additive gauges."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, additive: bool = True):
        super().__init__(name, help_text)
        self.additive = additive

    def set(self, value: float, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] = value

    def replace(self, value: float, **labels: str) -> None:
        """Make this label set the gauge's only sample (an info-style gauge)."""
        self.values = {tuple(sorted(labels.items())): value}


class _HistogramSeries:
    """One label set's buckets, sum and count."""

    def __init__(self, num_buckets: int):
        self.counts = [0] * (num_buckets + 1)     # last: +Inf
        self.sum = 0.0
        self.count = 0


class Histogram:
    """Observations counted in cumulative buckets, with their sum and count, per label set.

    Without labels the one series is rendered even before any observation; a labelled
    histogram renders the label sets observed so far."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS_S):
        self.name, self.help = name, help_text
        self.buckets = tuple(buckets)
        self.series: dict[tuple, _HistogramSeries] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = _HistogramSeries(len(self.buckets))
        series.counts[bisect_left(self.buckets, value)] += 1
        series.sum += value
        series.count += 1

    def render(self) -> list[str]:
        series = self.series or {(): _HistogramSeries(len(self.buckets))}
        lines = []
        for key, one in series.items():
            lines.extend(self._render_series(dict(key), one))
        return lines

    def _render_series(self, labels: dict[str, str], series: _HistogramSeries) -> list[str]:
        lines, cumulative = [], 0
        prefix = "".join(f'{k}="{_escape(str(v))}",' for k, v in sorted(labels.items()))
        for bound, count in zip((*self.buckets, math.inf), series.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{{prefix}le="{_number(float(bound))}"}} {cumulative}')
        lines.append(f"{self.name}_sum{_labels(labels)} {_number(series.sum)}")
        lines.append(f"{self.name}_count{_labels(labels)} {series.count}")
        return lines


class ClassMetrics:
    """Latency per request class (label ``class``: the ServiceClass value), observed by the
    engine client per engine request."""

    def __init__(self):
        h = Histogram
        self.ttft = h("kvserve_class_time_to_first_token_seconds", "Arrival to first generated token, by class.")
        self.tpot = h("kvserve_class_time_per_output_token_seconds",
                      "(last token - first token) / (tokens - 1) of a finished request with at least two "
                      "tokens (its longest completion), by class.")
        self.queue = h("kvserve_class_queue_time_seconds",
                       "Arrival to the start of the first engine step that scheduled the request, by class.")
        self.finished = Counter("kvserve_class_requests_finished_total",
                                "Engine requests ended (finished, aborted or failed), by class.")
        for service_class in ServiceClass:
            self.finished.inc(0, **{"class": service_class.value})
        self.all = [self.ttft, self.tpot, self.queue, self.finished]

    def observe_queue(self, service_class: ServiceClass, seconds: float) -> None:
        self.queue.observe(seconds, **{"class": service_class.value})

    def observe_ttft(self, service_class: ServiceClass, seconds: float) -> None:
        self.ttft.observe(seconds, **{"class": service_class.value})

    def observe_end(self, service_class: ServiceClass, tpot_s: float | None) -> None:
        """A request ended; ``tpot_s`` is its time per output token (None: fewer than two tokens)."""
        self.finished.inc(**{"class": service_class.value})
        if tpot_s is not None:
            self.tpot.observe(tpot_s, **{"class": service_class.value})


GUARD_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)


class TenantMetrics:
    """Per tenant: generation requests by how they ended and their tokens; per guard: its
    latency and decisions (``/metrics`` is an admin route when admin keys are set)."""

    def __init__(self):
        self.requests = Counter("kvserve_tenant_requests_total",
                                "Generation requests ended, by tenant, HTTP status and error code.")
        self.tokens = Counter("kvserve_tenant_tokens_total",
                              "Prompt and generated tokens of ended requests, by tenant and kind.")
        self.guard_latency = Histogram("kvserve_guard_latency_seconds",
                                       "Time one guard took on one text, by guard and point.", GUARD_BUCKETS_S)
        self.guard_decisions = Counter("kvserve_guard_decisions_total",
                                       "Guard decisions by guard, point and decision.")
        self.served = Counter("kvserve_tenant_served_tokens_total",
                              "Tokens the engine computed per tenant (prompt and generated; fair sharing on).")
        self.all = [self.requests, self.tokens, self.guard_latency, self.guard_decisions, self.served]

    def observe_request(self, tenant: str | None, status: int, code: str | None, prompt_tokens: int,
                        completion_tokens: int) -> None:
        name = tenant if tenant is not None else ""
        self.requests.inc(tenant=name, status=str(status), code=code or "")
        self.tokens.inc(prompt_tokens, tenant=name, kind="prompt")
        self.tokens.inc(completion_tokens, tenant=name, kind="completion")

    def observe_guard(self, guard: str, point: str, decision: str, seconds: float) -> None:
        self.guard_latency.observe(seconds, guard=guard, point=point)
        self.guard_decisions.inc(guard=guard, point=point, decision=decision)


class LoRAMetrics:
    """LoRA adapters: the engine's tiers and loads (``EngineStats.adapters``), vLLM's
    ``lora_requests_info`` convention, and per-adapter counters kept by the HTTP process
    (it knows each request's adapter). Rendered once the engine reports LoRA on."""

    def __init__(self):
        g, c = Gauge, Counter
        self.loaded = g("kvserve_lora_adapters_loaded", "Adapter names requests may select.")
        self.resident = g("kvserve_lora_adapters_resident", "Adapters in resident slots (the forward reads them).")
        self.host = g("kvserve_lora_adapters_host", "Adapters whose weights are in host memory.")
        self.max_resident = g("kvserve_lora_max_resident", "Resident adapter slots (--max-loras).")
        self.max_host = g("kvserve_lora_max_host", "Adapters host memory holds (--max-cpu-loras).")
        self.waiting_for_slot = g("kvserve_lora_num_waiting_for_slot",
                                  "Sequences held back because no adapter slot was free.")
        self.disk_loads = c("kvserve_lora_disk_loads_total", "Adapter reads from disk into host memory.")
        self.slot_loads = c("kvserve_lora_slot_loads_total", "Adapter copies from host memory into a slot.")
        self.slot_evictions = c("kvserve_lora_slot_evictions_total", "Resident adapters replaced by another.")
        self.host_evictions = c("kvserve_lora_host_evictions_total", "Adapters dropped from host memory (LRU).")
        self.load_seconds = c("kvserve_lora_load_seconds_total", "Time spent loading adapters, by tier "
                              "(disk: disk -> host memory; slot: host memory -> resident slot).")
        self.info = g("kvserve_lora_requests_info", "vLLM's lora_requests_info: the labels name the adapters "
                      "with running and with waiting sequences; the value is the Unix time of the update.",
                      additive=False)
        self.requests = c("kvserve_lora_requests_total", "HTTP generation requests admitted, by adapter.")
        self.generation_tokens = c("kvserve_lora_generation_tokens_total", "Tokens generated, by adapter.")
        self.all = [self.loaded, self.resident, self.host, self.max_resident, self.max_host, self.waiting_for_slot,
                    self.disk_loads, self.slot_loads, self.slot_evictions, self.host_evictions,
                    self.load_seconds, self.info, self.requests, self.generation_tokens]

    def update(self, counters: AdapterCounters, now: float) -> None:
        """Mirror the engine's adapter gauges and counters."""
        self.loaded.set(counters.num_registered)
        self.resident.set(counters.num_resident)
        self.host.set(counters.num_host)
        self.max_resident.set(counters.max_resident)
        self.max_host.set(counters.max_host)
        self.waiting_for_slot.set(counters.num_waiting_for_slot)
        self.disk_loads.set_total(counters.num_disk_loads)
        self.slot_loads.set_total(counters.num_slot_loads)
        self.slot_evictions.set_total(counters.num_slot_evictions)
        self.host_evictions.set_total(counters.num_host_evictions)
        self.load_seconds.set_total(counters.disk_load_seconds, tier="disk")
        self.load_seconds.set_total(counters.slot_load_seconds, tier="slot")
        self.info.replace(now, max_lora=str(counters.max_resident),
                          running_lora_adapters=",".join(counters.running_adapters),
                          waiting_lora_adapters=",".join(counters.waiting_adapters))


class DisaggMetrics:
    """The prefill/decode driver's counters (``kvserve serve --disaggregate``), mirrored from
    ``DisaggCounters``; rendered only once ``enable`` was called."""

    def __init__(self):
        c, g = Counter, Gauge
        self.requests = c("kvserve_disagg_requests_total", "Requests routed by the disaggregation rule, by route "
                          "(unified: the decode engine prefills; disaggregated: the prefill engine does, KV moves).")
        self.aborted = c("kvserve_disagg_requests_aborted_total", "Requests aborted in the driver (any stage).")
        self.blocks_sent = c("kvserve_disagg_kv_blocks_sent_total", "KV blocks the prefill engine exported.")
        self.blocks_received = c("kvserve_disagg_kv_blocks_received_total",
                                 "KV blocks imported into the decode engine's prefix cache.")
        self.blocks_skipped = c("kvserve_disagg_kv_blocks_skipped_total",
                                "Prompt blocks of disaggregated requests the decode engine cached already (not moved).")
        self.blocks_present = c("kvserve_disagg_kv_blocks_present_on_import_total",
                                "Blocks sent that the decode engine had cached by the time they arrived.")
        self.blocks_dropped = c("kvserve_disagg_kv_blocks_dropped_total",
                                "Blocks sent that the decode engine refused (no room, another namespace).")
        self.in_stage = g("kvserve_disagg_requests_in_stage", "Requests the driver holds, by stage.")
        self.threshold = g("kvserve_disagg_threshold_tokens", "Uncached prompt tokens from which a request is "
                           "prefilled on the prefill engine.", additive=False)
        self.all = [self.requests, self.aborted, self.blocks_sent, self.blocks_received, self.blocks_skipped,
                    self.blocks_present, self.blocks_dropped, self.in_stage, self.threshold]
        self.enabled = False

    def enable(self, threshold_tokens: int) -> None:
        self.enabled = True
        self.threshold.set(threshold_tokens)
        for route in ("unified", "disaggregated"):
            self.requests.set_total(0, route=route)

    def update(self, counters, stages: dict[str, int]) -> None:
        """Mirror a ``DisaggCounters`` and the live requests per stage."""
        self.requests.set_total(counters.num_unified, route="unified")
        self.requests.set_total(counters.num_disaggregated, route="disaggregated")
        self.aborted.set_total(counters.num_aborted)
        self.blocks_sent.set_total(counters.blocks_sent)
        self.blocks_received.set_total(counters.blocks_received)
        self.blocks_skipped.set_total(counters.blocks_skipped)
        self.blocks_present.set_total(counters.blocks_present_on_import)
        self.blocks_dropped.set_total(counters.blocks_dropped)
        for stage, count in stages.items():
            self.in_stage.set(count, stage=stage)


class StartMetrics:
    """This server's start, set once when its engine is ready (docs/coldstart.md)."""

    def __init__(self):
        self.layers = Gauge("kvserve_cold_start_seconds", "This replica's start by layer: runtime (engine process "
                            "start, imports, model build), weights (checkpoint or host-cache read, onto the "
                            "device), warmup (bandwidth probe, KV allocation, warm-up pass).", additive=False)
        self.phases = Gauge("kvserve_start_phase_seconds", "The engine's start-up phases (EngineCore.start_timings).",
                            additive=False)
        self.ready_at = Gauge("kvserve_start_ready_time_seconds", "Unix time this replica's engine became ready "
                              "(less the layers' sum: when its process was spawned).", additive=False)
        self.all = [self.layers, self.phases, self.ready_at]

    def record(self, phases: dict, process_s: float, ready_at: float | None = None) -> None:
        """The engine process's start (spawn to ready, seconds), its phases and the Unix time it
        became ready (None: now)."""
        from kvserve.coldstart.layers import split_layers
        self.ready_at.set(round(time.time() if ready_at is None else ready_at, 3))
        for layer, seconds in split_layers(phases, process_s).items():
            self.layers.set(round(seconds, 4), layer=layer.removesuffix("_s"))
        for phase, seconds in phases.items():
            self.phases.set(round(seconds, 4), phase=phase.removesuffix("_s"))


class ServerMetrics:
    """Every metric the server exports; ``render()`` is the /metrics body."""

    def __init__(self):
        h, g, c = Histogram, Gauge, Counter
        self.ttft = h("kvserve_time_to_first_token_seconds", "Arrival to first generated token.")
        self.itl = h("kvserve_inter_token_latency_seconds", "Time between consecutive tokens of a sequence.")
        self.e2e = h("kvserve_e2e_request_latency_seconds", "Arrival to the last token of a request.")
        self.queue = h("kvserve_request_queue_time_seconds",
                       "Arrival to the end of the first engine step that scheduled the request.")
        self.running = g("kvserve_num_requests_running", "Sequences the engine is running.")
        self.waiting = g("kvserve_num_requests_waiting", "Sequences waiting in the engine's queue.")
        self.in_flight = g("kvserve_num_requests_in_flight", "HTTP requests admitted and not finished.")
        self.queued = g("kvserve_num_requests_queued", "Admitted requests not yet scheduled by the engine.")
        self.queued_prompt_tokens = g("kvserve_num_queued_prompt_tokens",
                                      "Prompt tokens past the prefix cache of the requests not yet scheduled.")
        self.kv_used = g("kvserve_kv_blocks_used", "KV cache blocks in use.")
        self.kv_total = g("kvserve_kv_blocks_total", "KV cache blocks in the pool.")
        self.kv_cached = g("kvserve_kv_blocks_cached", "KV blocks held only by the prefix cache (reclaimable).")
        self._init_prefix_cache_and_speculation()
        self.step_fixed = g("kvserve_step_time_fixed_seconds", "Measured step time t = a + b x tokens: a.",
                            additive=False)
        self.step_per_token = g("kvserve_step_time_per_token_seconds", "Measured step time t = a + b x tokens: b.",
                                additive=False)
        self.ready = g("kvserve_ready", "1 when /ready answers 200.")
        self.integrity = g("kvserve_kv_integrity_ok", "0 once an idle-time block pool integrity check failed.")
        self.preemptions = c("kvserve_preemptions_total", "Sequences preempted (recomputed later).")
        self.engine_steps = c("kvserve_engine_steps_total", "Engine steps run.")
        self.step_seconds = c("kvserve_engine_step_seconds_total", "Wall seconds the engine's steps took.")
        self.step_cpu_seconds = c("kvserve_engine_step_cpu_seconds_total",
                                  "CPU seconds of the engine process during its steps (over wall: the host's share).")
        self.prompt_tokens = c("kvserve_prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generation_tokens = c("kvserve_generation_tokens_total", "Tokens generated.")
        self.finished = c("kvserve_requests_finished_total", "Finished requests by finish reason.")
        self.rejected = c("kvserve_requests_rejected_total", "Requests refused, by HTTP status and code.")
        self.start = StartMetrics()
        self.classes = ClassMetrics()
        self.tenants = TenantMetrics()
        self.lora = LoRAMetrics()
        self.lora_enabled = False                 # set once the engine's stats say LoRA is on
        self.disagg = DisaggMetrics()             # rendered with --disaggregate only
        from kvserve.server.parallel_metrics import ParallelMetrics     # (it imports this module's types)
        self.parallel = ParallelMetrics()         # rendered once the engine has ranks or experts
        self._all = [self.ttft, self.itl, self.e2e, self.queue, self.running, self.waiting, self.in_flight,
                     self.queued, self.queued_prompt_tokens, self.kv_used, self.kv_total, self.kv_cached,
                     self.prefix_hit_rate, self.prefix_hit_tokens, self.prefix_queries, self.prefix_evicted,
                     self.prefix_blocks,
                     self.spec_proposed, self.spec_accepted, self.spec_accepted_pos, self.spec_verifications,
                     self.spec_mean_len, self.spec_steps_off, self.step_fixed, self.step_per_token, self.ready,
                     self.integrity, self.preemptions, self.engine_steps, self.step_seconds, self.step_cpu_seconds,
                     self.prompt_tokens, self.generation_tokens, self.finished, self.rejected, *self.start.all,
                     *self.classes.all, *self.tenants.all]

    def _init_prefix_cache_and_speculation(self) -> None:
        """The prefix cache's and speculative decoding's series."""
        g, c = Gauge, Counter
        self.prefix_hit_rate = g("kvserve_prefix_cache_hit_rate", "Prompt tokens served by the prefix cache / "
                                 "prompt tokens looked up, since start.", additive=False)
        self.prefix_hit_tokens = c("kvserve_prefix_cache_hit_tokens_total", "Prompt tokens served by the prefix cache.")
        self.prefix_queries = c("kvserve_prefix_cache_queries_total", "Prefix cache lookups (one per admitted "
                                "request that uses the cache).")
        self.prefix_evicted = c("kvserve_prefix_cache_evicted_blocks_total",
                                "Cached blocks evicted (reused for other requests or dropped by a reset).")
        self.prefix_blocks = g("kvserve_prefix_cache_blocks", "Blocks the prefix cache indexes.")
        self.spec_proposed = c("kvserve_spec_draft_tokens_total", "Speculative draft tokens verified.")
        self.spec_accepted = c("kvserve_spec_accepted_tokens_total", "Speculative draft tokens accepted.")
        self.spec_accepted_pos = c("kvserve_spec_accepted_tokens_per_position_total",
                                   "Verifications that accepted the draft at this position (0 = first).")
        self.spec_verifications = c("kvserve_spec_verifications_total",
                                    "Sequence-steps that verified at least one draft.")
        self.spec_mean_len = g("kvserve_spec_mean_accepted_length",
                               "Draft tokens accepted per verification, since start.", additive=False)
        self.spec_steps_off = c("kvserve_spec_steps_off_total",
                                "Decode steps where speculation was switched off because it would not pay.")

    def update_engine(self, stats: EngineStats) -> None:
        """Mirror the engine's gauges and counters (EngineCore.stats)."""
        self.running.set(stats.num_running_seqs)
        self.waiting.set(stats.num_waiting_seqs)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_total.set(stats.kv_blocks_total)
        self.kv_cached.set(stats.kv_blocks_cached)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        self.prefix_hit_tokens.set_total(stats.prefix_cache_hit_tokens)
        self.prefix_queries.set_total(stats.prefix_cache_queries)
        self.prefix_evicted.set_total(stats.prefix_cache_evicted_blocks)
        self.prefix_blocks.set(stats.prefix_cache_blocks)
        self.preemptions.set_total(stats.num_preemptions)
        self.engine_steps.set_total(stats.num_steps)
        self.step_seconds.set_total(stats.step_seconds)
        self.step_cpu_seconds.set_total(stats.step_cpu_seconds)
        self.integrity.set(1 if stats.integrity_ok else 0)
        self.step_fixed.set(stats.step_time_fixed_s)
        self.step_per_token.set(stats.step_time_per_token_s)
        spec = stats.speculation
        if spec.enabled:
            self.spec_proposed.set_total(spec.num_proposed)
            self.spec_accepted.set_total(spec.num_accepted)
            self.spec_verifications.set_total(spec.num_verifications)
            self.spec_steps_off.set_total(spec.num_steps_off)
            self.spec_mean_len.set(spec.mean_accepted_length)
            for position, count in enumerate(spec.accepted_per_position):
                self.spec_accepted_pos.set_total(count, position=str(position))
        if stats.adapters.enabled:
            self.lora_enabled = True
            self.lora.update(stats.adapters, time.time())
        for tenant, tokens in stats.tenant_served_tokens.items():
            self.tenants.served.set_total(tokens, tenant=tenant)
        self.parallel.update(stats.parallel)

    def all_metrics(self) -> list:
        """Every metric object ``render()`` may write (the LoRA ones included)."""
        return (self._all + self.lora.all + (self.disagg.all if self.disagg.enabled else [])
                + (self.parallel.all if self.parallel.enabled else []))

    def render(self) -> str:
        extra = ((self.lora.all if self.lora_enabled else []) + (self.disagg.all if self.disagg.enabled else [])
                 + (self.parallel.all if self.parallel.enabled else []))
        return render_metrics(self._all + extra)


def render_metrics(metrics) -> str:
    """The exposition text of ``metrics`` (Counter, Gauge, Histogram objects), as ``render()``
    writes the server's."""
    lines = []
    for metric in metrics:
        lines.append(f"# HELP {metric.name} {metric.help}")
        lines.append(f"# TYPE {metric.name} {metric.kind}")
        lines.extend(metric.render())
    return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name (with labels) -> value, from a /metrics body (for tests and the bench)."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
