"""Fleet size and dollars: replicas for the load with headroom, GPUs, $/month, $/M tokens."""
from __future__ import annotations

import math

from kvserve.planner.figures import HOURS_PER_MONTH, Figure, fmt_seconds


def usd_per_month(gpus: int, price_per_hour: float) -> Figure:
    """gpus x $/GPU-hour x 730 h."""
    value = gpus * price_per_hour * HOURS_PER_MONTH
    return Figure("usd_per_month", value, "$",
                  f"{gpus} GPUs x ${price_per_hour:g}/h x {HOURS_PER_MONTH:g} h = ${value:,.0f}")


def usd_per_million_tokens(usd_per_hour: float, tokens_per_s: float, name: str = "usd_per_million_output_tokens",
                           what: str = "output tokens/s") -> Figure:
    """$/h / (tokens/s x 3600) x 1e6."""
    if tokens_per_s <= 0:
        return Figure(name, float("inf"), "$", "no tokens served")
    value = usd_per_hour / (tokens_per_s * 3600) * 1e6
    return Figure(name, value, "$",
                  f"${usd_per_hour:,.4g}/h / ({tokens_per_s:,.1f} {what} x 3600) x 1e6 = ${value:,.4g}")


def replicas_for_concurrency(concurrency: int, max_concurrency: int) -> Figure:
    """ceil(sequences needed / sequences one replica's KV pool holds)."""
    value = math.ceil(concurrency / max_concurrency)
    return Figure("replicas", float(value), "replicas",
                  f"ceil({concurrency} concurrent seqs / {max_concurrency} per replica) = {value}")


def request_service_s(prefill_s: float, output_tokens: float, step_s: float, batch: int) -> Figure:
    """Replica-seconds one request costs: its prefill plus its share of batched decode steps."""
    value = prefill_s + output_tokens * step_s / batch
    return Figure("replica_s_per_request", value, "s",
                  f"prefill {fmt_seconds(prefill_s)} + {output_tokens:g} output tokens x "
                  f"{fmt_seconds(step_s)} / batch {batch} = {fmt_seconds(value)}")


def replicas_for_traffic(rps: float, peak_to_mean: float, service_s: float, headroom: float) -> Figure:
    """ceil(peak requests/s / (requests/s per replica x (1 - headroom)))."""
    peak = rps * peak_to_mean
    per_replica = 1.0 / service_s
    value = max(1, math.ceil(peak / (per_replica * (1 - headroom))))
    return Figure("replicas", float(value), "replicas",
                  f"peak {rps:g} x {peak_to_mean:g} = {peak:,.4g} req/s; one replica serves 1 / "
                  f"{fmt_seconds(service_s)} = {per_replica:,.4g} req/s; ceil({peak:,.4g} / ({per_replica:,.4g} x "
                  f"(1 - {headroom:g} headroom))) = {value}")


def ttft_p99(step_s: float, prefill_p99_s: float, prefill_mean_s: float, rps_per_replica: float) -> Figure:
    """First-order TTFT p99: wait for the running step, then a p99 prefill slowed by the
    prefill load already on the replica: step + prefill_p99 / (1 - rho), rho = rate x mean prefill."""
    rho = min(0.95, rps_per_replica * prefill_mean_s)
    value = step_s + prefill_p99_s / (1 - rho)
    return Figure("ttft_p99_s", value, "s",
                  f"step {fmt_seconds(step_s)} + p99 prefill {fmt_seconds(prefill_p99_s)} / (1 - rho {rho:.2f} "
                  f"= {rps_per_replica:.3g} req/s x {fmt_seconds(prefill_mean_s)}) = {fmt_seconds(value)}")
