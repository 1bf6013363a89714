"""The day in one PNG: the fleet's request rate, GPUs held per policy, and TTFT p99 per
30-minute bin per policy (log scale, the SLO dashed)."""
from __future__ import annotations

import numpy as np

BIN_S = 1800.0


def plot_day(result: dict, arrays: dict, path: str) -> str:
    """Write the plot of ``simulate``'s result to ``path``; return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8.5), dpi=90, sharex=True)
    first = next(iter(arrays.values()))
    edges = np.arange(0.0, result["duration_h"] * 3600 + BIN_S, BIN_S)
    hours = edges[:-1] / 3600
    counts, _ = np.histogram(first["arrival_s"], edges)
    axes[0].step(hours, counts / BIN_S, where="post", color="black")
    axes[0].set_ylabel("requests/s (fleet)")
    for name, policy in result["policies"].items():
        t = np.array([p[0] for p in policy["timeline"]]) / 3600
        gpus = [sum(p[1].values()) for p in policy["timeline"]]
        axes[1].plot(t, gpus, label=f"{name} (${policy['cost_usd_month']:,.0f}/mo)")
        arr = arrays[name]
        served = ~np.isnan(arr["ttft_s"])
        which = np.digitize(arr["arrival_s"][served], edges) - 1
        p99 = [np.percentile(arr["ttft_s"][served][which == b], 99) if (which == b).any() else np.nan
               for b in range(len(hours))]
        axes[2].step(hours, p99, where="post", label=f"{name} ({policy['slo_attainment']:.2%} within SLO)")
    axes[1].set_ylabel("GPUs held")
    axes[1].legend(fontsize=8)
    axes[2].axhline(result["ttft_slo_s"], color="black", ls="--", lw=1)
    axes[2].set_yscale("log")
    axes[2].set_ylabel("TTFT p99 per 30 min (s)")
    axes[2].set_xlabel("hour of the day")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"{result['scenario']}: {result['models']} models on {result['gpu']}, budget "
                 f"${result['budget_usd_month']:,.0f}/month")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
