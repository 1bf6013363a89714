"""The soak's figures (``benchmarks/soak.py``): outcomes per window, interactive latency,
RSS growth, the audit log and /metrics cross-checks, and the pass checks."""
from __future__ import annotations

import json
import math
import re
from collections import Counter

from kvserve.loadgen.outcomes import OUTCOMES, OutcomeRecord
from kvserve.loadgen.report import percentile

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def series(samples: dict[str, float], name: str) -> list[tuple[dict, float]]:
    """Every sample of metric ``name`` as (labels, value), from ``parse_metrics``' dict."""
    out = []
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name:
            out.append((dict(_LABEL.findall(rest)), value))
    return out


def counts(records: list[OutcomeRecord]) -> dict[str, int]:
    """Outcome -> count, every outcome listed (0 when none)."""
    seen = Counter(r.outcome for r in records)
    return {name: seen.get(name, 0) for name in OUTCOMES}


def _ms(values: list[float], p: float) -> float | None:
    v = percentile(values, p)
    return round(v * 1000.0, 1) if v is not None else None


def latency(records: list[OutcomeRecord]) -> dict:
    """TTFT and e2e p50/p99 (ms) of the completed records given."""
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    e2e = [r.e2e_s for r in records]
    return {"count": len(records), "ttft_ms_p50": _ms(ttft, 50), "ttft_ms_p99": _ms(ttft, 99),
            "e2e_ms_p50": _ms(e2e, 50), "e2e_ms_p99": _ms(e2e, 99)}


def admitted_interactive(records: list[OutcomeRecord]) -> list[OutcomeRecord]:
    """Interactive requests the server admitted and finished (completed, stop/length)."""
    return [r for r in records if r.kind == "interactive" and r.outcome == "completed"]


def windows(records: list[OutcomeRecord], t0: float, window_s: float, duration_s: float) -> list[dict]:
    """Per window of send times: outcome counts and admitted interactive latency."""
    num = max(1, math.ceil(duration_s / window_s - 1e-9))
    out = []
    for i in range(num):
        lo, hi = t0 + i * window_s, t0 + min((i + 1) * window_s, duration_s)
        inside = [r for r in records if lo <= r.start < hi or (i == num - 1 and r.start >= hi)]
        out.append({"window": i, "start_s": round(i * window_s, 1), "end_s": round(hi - t0, 1),
                    "sent": len(inside), "outcomes": counts(inside),
                    "interactive_completed": latency(admitted_interactive(inside))})
    return out


def by_kind(records: list[OutcomeRecord]) -> dict[str, dict[str, int]]:
    """Kind -> {outcome: count} (only outcomes that happened)."""
    table: dict[str, Counter] = {}
    for r in records:
        table.setdefault(r.kind, Counter())[r.outcome] += 1
    return {kind: dict(sorted(c.items())) for kind, c in sorted(table.items())}


def other_details(records: list[OutcomeRecord]) -> dict[str, int]:
    """What the ``other`` outcomes were (detail -> count)."""
    return dict(Counter(r.detail for r in records if r.outcome == "other"))


def refusal_headers(records: list[OutcomeRecord]) -> dict:
    """How many 429s / 503s carried Retry-After (and the 429s x-ratelimit-* headers)."""
    limited = [r for r in records if r.outcome == "rate_limited"]
    overloaded = [r for r in records if r.outcome == "overloaded"]
    return {"rate_limited": len(limited),
            "rate_limited_with_retry_after": sum(1 for r in limited if r.retry_after),
            "rate_limited_with_x_ratelimit": sum(1 for r in limited if r.ratelimit_headers),
            "overloaded": len(overloaded), "overloaded_with_retry_after": sum(1 for r in overloaded if r.retry_after)}


def overloaded_codes(records: list[OutcomeRecord]) -> dict[str, int]:
    """The error codes of the 503s (code -> count)."""
    return dict(Counter(str(r.detail) for r in records if r.outcome == "overloaded"))


# ----------------------------------------------------------------- RSS
def _slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MiB) points, in MiB per hour."""
    if len(points) < 2:
        return None
    n = len(points)
    mx, my = sum(t for t, _ in points) / n, sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    return sum((t - mx) * (v - my) for t, v in points) / var * 3600.0 if var else None


def rss(samples: list[dict], t0: float, duration_s: float, warmup_fraction: float, goal: float) -> dict:
    """RSS after warm-up (first sample at ``warmup_fraction`` of the run) and at the end of the
    load; growth = end / warm - 1 of the server's total (HTTP + engine)."""
    end_t, warm_t = t0 + duration_s, t0 + warmup_fraction * duration_s
    during = [s for s in samples if s["t"] <= end_t + 1.0]
    warm = next((s for s in during if s["t"] >= warm_t), None)
    last = during[-1] if during else None
    if warm is None or last is None or warm is last:
        return {"samples": len(samples), "growth_fraction": None, "goal_max_growth": goal,
                "note": "too few samples after the warm-up point"}
    after = [s for s in during if s["t"] >= warm["t"]]
    out = {"samples": len(samples), "warmup_at_s": round(warm["t"] - t0, 1), "end_at_s": round(last["t"] - t0, 1),
           "warm_mib": {k: v for k, v in warm.items() if k.endswith("_mib")},
           "end_mib": {k: v for k, v in last.items() if k.endswith("_mib")},
           "peak_total_mib_after_warmup": max(s["total_mib"] for s in after),
           "growth_fraction": round(last["total_mib"] / warm["total_mib"] - 1.0, 4),
           "slope_total_mib_per_hour_after_warmup": _round(_slope_per_hour(
               [(s["t"], s["total_mib"]) for s in after])),
           "goal_max_growth": goal}
    for name in ("http", "engine"):
        if warm.get(f"{name}_mib"):
            out[f"{name}_growth_fraction"] = round(last[f"{name}_mib"] / warm[f"{name}_mib"] - 1.0, 4)
    out["series"] = [{"t_s": round(s["t"] - t0, 1), "total_mib": s["total_mib"]} for s in samples]
    return out


def _round(value, digits: int = 2):
    return round(value, digits) if value is not None else None


# ----------------------------------------------------------------- audit log and /metrics
def audit_outcome(line: dict) -> str:
    """The outcome an audit line says the request had (the server's view)."""
    status, code = line.get("status", 200), line.get("error_code")
    if status == 429:
        return "rate_limited"
    if status == 503:
        return "overloaded"
    if status == 400 and code == "content_policy_violation":
        return "input_blocked"
    if status == 499 or code == "client_disconnected":
        return "client_abort"
    if status != 200:
        return "other"
    reasons = line.get("finish_reasons") or []
    if "content_filter" in reasons:
        return "content_filter"
    if reasons and all(r in ("stop", "length") for r in reasons):
        return "completed"
    if not reasons or any(r in ("abort", "") for r in reasons):
        return "client_abort"
    return "other"


def audit_summary(path: str, tenants: tuple[str, ...], skip_lines: int = 0) -> dict:
    """Lines of the audit log after the first ``skip_lines``, for ``tenants``: count and outcomes."""
    lines, outcomes, other = 0, Counter(), Counter()
    try:
        with open(path, encoding="utf-8") as f:
            raw = f.read().splitlines()
    except OSError as exc:
        return {"error": f"cannot read {path}: {exc.strerror}", "lines": None}
    for text in raw[skip_lines:]:
        entry = json.loads(text)
        if entry.get("tenant") not in tenants:
            continue
        lines += 1
        outcome = audit_outcome(entry)
        outcomes[outcome] += 1
        if outcome == "other":
            other[f"{entry.get('status')}:{entry.get('error_code')}:{entry.get('finish_reasons')}"] += 1
    return {"lines": lines, "outcomes": {k: outcomes.get(k, 0) for k in OUTCOMES}, "other": dict(other)}


def tenant_requests(before: dict, after: dict, tenants: tuple[str, ...]) -> dict:
    """kvserve_tenant_requests_total for ``tenants``: the increase between two scrapes."""
    def table(samples):
        return {(l.get("tenant"), l.get("status"), l.get("code")): v
                for l, v in series(samples, "kvserve_tenant_requests_total") if l.get("tenant") in tenants}
    start, end = table(before), table(after)
    delta = {k: v - start.get(k, 0.0) for k, v in end.items() if v - start.get(k, 0.0)}
    by_status = Counter()
    for (_tenant, status, code), v in delta.items():
        by_status[f"{status}:{code}" if code else status] += int(v)
    return {"total": int(sum(delta.values())), "by_status_code": dict(sorted(by_status.items())),
            "series_present": bool(end)}


def guard_decisions(before: dict, after: dict) -> dict:
    """kvserve_guard_decisions_total increase, as 'guard/point/decision' -> count."""
    start = {tuple(sorted(l.items())): v for l, v in series(before, "kvserve_guard_decisions_total")}
    out = {}
    for labels, v in series(after, "kvserve_guard_decisions_total"):
        d = v - start.get(tuple(sorted(labels.items())), 0.0)
        if d:
            out[f"{labels.get('guard')}/{labels.get('point')}/{labels.get('decision')}"] = int(d)
    return out


def counter_delta(before: dict, after: dict, name: str) -> float | None:
    """Increase of an unlabelled counter (None when absent)."""
    if name not in after:
        return None
    return after[name] - before.get(name, 0.0)


def compare(client: dict[str, int], server: dict[str, int]) -> dict[str, int]:
    """Outcome -> server count - client count, where they differ."""
    return {k: server.get(k, 0) - client.get(k, 0) for k in OUTCOMES if server.get(k, 0) != client.get(k, 0)}
