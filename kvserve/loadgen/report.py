"""Summaries of a benchmark run, in the figures serving engineers report.

- TTFT: send -> first chunk with text.
- TPOT: (end - first token) / (output tokens - 1), per request (aiperf's "inter token latency").
- ITL: every gap between consecutive text chunks, pooled over requests.
- E2E: send -> end of stream.
- Throughput over the run's duration (first send -> last end): requests/s, output tokens/s,
  total (prompt + output) tokens/s.
- Goodput: completed requests per second that met every SLO given (TTFT, TPOT, E2E).
- Errors by kind (``http_503:server_overloaded``, ``timeout``, ...).

Token counts come from the server's ``usage``.
"""
from __future__ import annotations

import json
import math
from collections import Counter

from kvserve.loadgen.runner import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], p: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def distribution(values: list[float], scale: float = 1000.0) -> dict:
    """mean and p50/p90/p99 (scaled: seconds -> milliseconds by default)."""
    if not values:
        return {"count": 0}
    out = {"count": len(values), "mean": sum(values) / len(values) * scale}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(values, p) * scale
    return out


def meets_slos(record: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None,
               slo_e2e_ms: float | None) -> bool:
    if record.error is not None:
        return False
    if slo_ttft_ms is not None and (record.ttft_s is None or record.ttft_s * 1000 > slo_ttft_ms):
        return False
    if slo_tpot_ms is not None and record.tpot_s is not None and record.tpot_s * 1000 > slo_tpot_ms:
        return False
    return slo_e2e_ms is None or record.e2e_s * 1000 <= slo_e2e_ms


def summarize(records: list[RequestRecord], slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
              slo_e2e_ms: float | None = None) -> dict:
    """The JSON summary of one run."""
    ok = [r for r in records if r.error is None]
    errors = Counter(r.error for r in records if r.error is not None)
    duration = (max(r.end for r in records) - min(r.start for r in records)) if records else 0.0
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    good = [r for r in ok if meets_slos(r, slo_ttft_ms, slo_tpot_ms, slo_e2e_ms)]
    return {
        "num_requests": len(records),
        "num_completed": len(ok),
        "num_errors": len(records) - len(ok),
        "errors": dict(sorted(errors.items())),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "output_token_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(output_tokens + prompt_tokens),
        "ttft_ms": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": distribution([gap for r in ok for gap in r.itls_s]),
        "e2e_ms": distribution([r.e2e_s for r in ok]),
        "output_tokens_per_request": distribution([float(r.output_tokens or 0) for r in ok], scale=1.0),
        "goodput": {"slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms, "slo_e2e_ms": slo_e2e_ms,
                    "requests_per_s": per_s(len(good)), "fraction": len(good) / len(records) if records else 0.0},
    }


def format_table(results: list[dict]) -> str:
    """A short human-readable table of a sweep (one line per run)."""
    head = f"{'load':>10} {'ok':>5} {'err':>4} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>8} " \
           f"{'ITL p50':>8} {'E2E p50':>8} {'req/s':>7} {'out tok/s':>10}"
    lines = [head]
    for r in results:
        s = r["summary"]
        load = f"c={r['concurrency']}" if r.get("concurrency") else f"rate={r.get('request_rate')}"

        def g(key, p):
            v = s[key].get(p)
            return f"{v:.1f}" if v is not None else "-"
        lines.append(f"{load:>10} {s['num_completed']:>5} {s['num_errors']:>4} {g('ttft_ms', 'p50'):>9} "
                     f"{g('ttft_ms', 'p99'):>8} {g('tpot_ms', 'p50'):>9} {g('tpot_ms', 'p99'):>8} "
                     f"{g('itl_ms', 'p50'):>8} {g('e2e_ms', 'p50'):>8} {s['request_throughput']:>7.2f} "
                     f"{s['output_token_throughput']:>10.1f}")
    return "\n".join(lines)


def emit_json(report: dict, out: str | None) -> None:
    """The report as indented JSON: into the file ``out``, or on stdout when None."""
    text = json.dumps(report, indent=2)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    else:
        print(text)
