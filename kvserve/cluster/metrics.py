"""The cluster ingress's ``/metrics``: every replica's own series with a ``replica`` label,
their sums over the replicas, and what only the ingress knows (router decisions, prefix-hit
tokens per decision, circuit breakers, retries, the degradation rung).

Each replica's series come from its own ``/metrics`` (the single server's ``ServerMetrics``,
unchanged), scraped through the ingress's pinned route and relabelled here: the same names,
``replica="<Ray Serve replica id>"`` added. The aggregate of family ``kvserve_X`` is
``kvserve_cluster_X`` (a new name, so ``sum(kvserve_X)`` never counts a replica twice):
counters and histograms (bucket by bucket) are summed, gauges only where summing means
something (``Gauge.additive``; a hit rate or a fitted step time is not summed). The
ingress's own series use the server's ``Counter`` / ``Gauge`` / ``Histogram``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.cluster.breaker import BreakerState, ReplicaBreakers
from kvserve.server.metrics import Counter, Gauge, Histogram, ServerMetrics, _escape, _number, render_metrics

SERVER_PREFIX = "kvserve_"
CLUSTER_PREFIX = "kvserve_cluster_"
CACHED_TOKEN_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class Family:
    """One metric family of an exposition text: samples as (sample name, the labels inside
    the braces as written or "", the value as written)."""

    name: str
    help: str = ""
    kind: str = "untyped"
    samples: list[tuple[str, str, str]] = field(default_factory=list)


def parse_families(text: str) -> list[Family]:
    """The families of a Prometheus text exposition (as ``ServerMetrics.render`` writes it:
    ``# HELP`` then ``# TYPE`` then the samples), in order."""
    families: list[Family] = []
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[len("# HELP "):].partition(" ")
            families.append(Family(name, help_text))
        elif line.startswith("# TYPE "):
            name, _, kind = line[len("# TYPE "):].partition(" ")
            if not families or families[-1].name != name:
                families.append(Family(name))
            families[-1].kind = kind
        elif line and not line.startswith("#") and families:
            head, _, value = line.rpartition(" ")
            sample, brace, labels = head.partition("{")
            families[-1].samples.append((sample, labels[:-1] if brace else "", value))
    return families


def _labelled(labels: str, replica: str, deployment: str | None = None) -> str:
    own = f'replica="{_escape(replica)}"' + (f',deployment="{deployment}"' if deployment else "")
    return "{" + own + ("," + labels if labels else "") + "}"


def additive_families(metrics: ServerMetrics | None = None) -> set[str]:
    """The server's families whose sum over replicas means something: every counter and
    histogram, and the gauges marked ``additive``."""
    metrics = metrics or ServerMetrics()
    return {m.name for m in metrics.all_metrics() if getattr(m, "additive", True)}


def render_replicas(scrapes: dict[str, str], additive: set[str], fallback: dict[str, str] | None = None) -> str:
    """Each replica's series with its ``replica`` label (``scrapes``: replica id -> its
    /metrics text; ``fallback``: the fallback model's replicas, labelled
    ``deployment="fallback"`` too), then the ``kvserve_cluster_`` sums over the fleet's
    replicas of the families in ``additive`` (the fallback serves another model: not summed in)."""
    merged: dict[str, tuple[Family, list[tuple[str, str | None, Family]]]] = {}
    tagged = [(r, None, t) for r, t in sorted(scrapes.items())]
    tagged += [(r, "fallback", t) for r, t in sorted((fallback or {}).items())]
    for replica, deployment, text in tagged:
        for family in parse_families(text):
            merged.setdefault(family.name, (family, []))[1].append((replica, deployment, family))
    lines = []
    for name, (first, per_replica) in merged.items():
        lines += [f"# HELP {name} {first.help}", f"# TYPE {name} {first.kind}"]
        for replica, deployment, family in per_replica:
            lines += [f"{s}{_labelled(labels, replica, deployment)} {value}" for s, labels, value in family.samples]
    for name, (first, per_replica) in merged.items():
        fleet = [family for _, deployment, family in per_replica if deployment is None]
        if name in additive and name.startswith(SERVER_PREFIX) and fleet:
            lines += _sum_family(first, fleet)
    return "\n".join(lines) + "\n" if lines else ""


def _sum_family(first: Family, families: list[Family]) -> list[str]:
    """``kvserve_cluster_X``: the samples of ``kvserve_X`` summed over replicas, label set by label set."""
    sums: dict[tuple[str, str], float] = {}
    for family in families:
        for sample, labels, value in family.samples:
            sums[(sample, labels)] = sums.get((sample, labels), 0.0) + float(value)
    name = CLUSTER_PREFIX + first.name[len(SERVER_PREFIX):]
    lines = [f"# HELP {name} {first.help} (summed over the replicas)", f"# TYPE {name} {first.kind}"]
    for (sample, labels), total in sums.items():
        lines.append(f"{CLUSTER_PREFIX}{sample[len(SERVER_PREFIX):]}{'{' + labels + '}' if labels else ''} "
                     f"{_number(int(total) if total.is_integer() else total)}")
    return lines


class ClusterMetrics:
    """What the ingress itself counts, and the whole cluster's ``/metrics`` body."""

    def __init__(self):
        self.decisions = Counter("kvserve_router_decisions_total",
                                 "Routing decisions for forwarded requests, by policy and reason (round_robin, "
                                 "least_loaded, prefix, session, spread; fallback: no replica was routable).")
        self.cached_tokens = Histogram("kvserve_router_decision_cached_tokens",
                                       "Prompt tokens the chosen replica holds in its prefix cache as the router "
                                       "knows it, per routing decision of a generation request, by policy.",
                                       CACHED_TOKEN_BUCKETS)
        self.stats_age = Histogram("kvserve_router_stats_age_seconds",
                                   "How old each replica's routing stats (load, KV use, cached blocks) were when "
                                   "the router decided, per replica per routing decision of a generation request.")
        self.retries = Counter("kvserve_ingress_retries_total",
                               "Requests retried on another replica after a failure before the first byte.")
        self.not_routed = Counter("kvserve_ingress_not_routed_total",
                                  "Requests answered 503 because no replica took them within --cold-start-wait-s.")
        self.failures = Counter("kvserve_replica_failures_total",
                                "Replica failures the ingress saw, by replica and stage (before_first_byte, "
                                "reply_lost, status_5xx, mid_stream, probe).")
        self.breaker_state = Gauge("kvserve_replica_breaker_state",
                                   "1 for each replica's circuit breaker state (closed, half_open, open).",
                                   additive=False)
        self.breaker_opened = Counter("kvserve_replica_breaker_opened_total",
                                      "Times each replica's circuit breaker opened.")
        self.replicas = Gauge("kvserve_cluster_replicas", "Replicas the router saw, by whether this scrape "
                              "reached them (scraped: 1 or 0).")
        self.rung = Gauge("kvserve_degradation_rung", "The degradation ladder's rung (0: normal), by name.",
                          additive=False)
        self.engagements = Counter("kvserve_degradation_engagements_total",
                                   "Times each degradation rung engaged (the ladder climbed onto it), by name.")
        self.pressure = Gauge("kvserve_degradation_pressure",
                              "The ladder's pressure ratios at its last move (1.0: where each starts to hurt), "
                              "by signal (chat_queue_wait, kv_usage, rejection_rate); the ladder reads the largest.",
                              additive=False)
        self.overflowed = Counter("kvserve_degradation_overflowed_total",
                                  "Chat requests the overflow_chat rung sent to the fallback model.")
        self.queue_waiting = Gauge("kvserve_ingress_queue_waiting",
                                   "Generation requests waiting at the ingress for a fleet slot, by class.")
        self.queue_in_flight = Gauge("kvserve_ingress_fleet_slots_in_use",
                                     "Fleet slots (replicas x max_num_seqs) held by requests the ingress admitted.")
        self.queue_wait = Histogram("kvserve_ingress_queue_wait_seconds",
                                    "Time a generation request waited at the ingress for a fleet slot, by class.")
        self.queue_timeouts = Counter("kvserve_ingress_queue_timeouts_total",
                                      "Requests answered 503 + Retry-After after --queue-wait-s at the ingress, by class.")
        self.limited = Counter("kvserve_ingress_rate_limited_total",
                               "Requests the fleet-wide tenant limits refused at the ingress, by tenant and status "
                               "(429: rate or token limit).")
        self.all = [self.decisions, self.cached_tokens, self.stats_age, self.retries, self.not_routed, self.failures,
                    self.breaker_state, self.breaker_opened, self.replicas, self.rung, self.engagements, self.pressure, self.overflowed,
                    self.queue_waiting, self.queue_in_flight, self.queue_wait, self.queue_timeouts, self.limited]
        self.additive = additive_families()

    def observe_decision(self, decision: dict | None, generation: bool) -> None:
        """A routing decision the router wrote into a forwarded request's route."""
        if not decision:
            return
        self.decisions.inc(policy=decision["policy"], reason=decision["reason"])
        if generation and decision["reason"] != "fallback":
            self.cached_tokens.observe(decision["cached_tokens"], policy=decision["policy"])
        for age in decision.get("stats_age_s", ()) if generation else ():
            self.stats_age.observe(age)

    def update_breakers(self, *pools: ReplicaBreakers) -> None:
        """Mirror each known replica's breaker, of every pool (dropped replicas' series go)."""
        self.breaker_state.values.clear()
        self.breaker_opened.values.clear()
        for breakers in pools:
            for replica, state in breakers.states().items():
                for one in BreakerState:
                    self.breaker_state.set(1 if one is state else 0, replica=replica, state=one.value)
                self.breaker_opened.set_total(breakers.breakers[replica].times_opened, replica=replica)

    def update_admission(self, queue) -> None:
        """Mirror the ingress's class queue (``admission.ClassQueue``): waiting per class, slots in use."""
        for name, count in queue.waiting_by_class().items():
            self.queue_waiting.set(count, **{"class": name})
        self.queue_in_flight.set(queue.num_in_flight)

    def update_rung(self, rung) -> None:
        """The degradation ladder's current rung (a ``ladder.Rung``)."""
        self.rung.replace(int(rung), name=rung.name.lower())

    def update_ladder(self, controller) -> None:
        """Mirror a ``degrade.DegradationController``: its rung, each rung's engagements (every
        rung this configuration can use, 0 until it engaged) and its pressure ratios."""
        self.update_rung(controller.current().rung)
        for rung, times in controller.engagements.items():
            self.engagements.set_total(times, name=rung.name.lower())
        for name, ratio in controller.pressure_components().items():
            self.pressure.set(round(ratio, 6), signal=name)

    def render(self, scrapes: dict[str, str], seen: list[str], fallback: dict[str, str] | None = None,
               fallback_seen: list[str] = ()) -> str:
        """The ingress's ``/metrics``: the replicas' series (``scrapes``: replica -> its text;
        ``fallback``: the fallback model's), the fleet's sums, then the ingress's own; ``seen`` /
        ``fallback_seen``: the replicas each deployment's router knows."""
        self.replicas.values.clear()
        for replica in seen:
            self.replicas.set(1 if replica in scrapes else 0, replica=replica)
        for replica in fallback_seen:
            self.replicas.set(1 if replica in (fallback or {}) else 0, replica=replica, deployment="fallback")
        return render_replicas(scrapes, self.additive, fallback) + render_metrics(self.all)
