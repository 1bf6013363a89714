"""Tensor / expert parallelism and mixture-of-experts load as Prometheus series, mirrored from
the engine's ``ParallelCounters``; rendered once the engine runs more than one rank or a
mixture-of-experts model (docs/parallelism.md)."""
from __future__ import annotations

from kvserve.server.metrics import Counter, Gauge


class ParallelMetrics:
    """``kvserve_tensor_parallel_size``, ``kvserve_collective_seconds_total``,
    ``kvserve_expert_tokens_total{expert}``, ``kvserve_expert_load_imbalance`` and
    ``kvserve_sparse_layer_collective_seconds{quantile}``."""

    def __init__(self):
        self.ranks = Gauge("kvserve_tensor_parallel_size", "Ranks the model is split over.", additive=False)
        self.collective = Counter("kvserve_collective_seconds_total",
                                  "Rank 0's seconds inside collectives (all-reduce, all-gather, all-to-all).")
        self.expert_tokens = Counter("kvserve_expert_tokens_total",
                                     "Rows routed to each expert since start, summed over the sparse layers.")
        self.imbalance = Gauge("kvserve_expert_load_imbalance", "Max / mean rows per expert in the last forward "
                               "(averaged over the sparse layers).", additive=False)
        self.sparse_collective = Gauge("kvserve_sparse_layer_collective_seconds",
                                       "A sparse layer's collectives per forward (dispatch and combine "
                                       "all-to-all, all-gather), by quantile over the last forwards.",
                                       additive=False)
        self.all = [self.ranks, self.collective, self.expert_tokens, self.imbalance, self.sparse_collective]
        self.enabled = False

    def update(self, counters) -> None:
        """Mirror a ``ParallelCounters``."""
        self.enabled = self.enabled or counters.tensor_parallel_size > 1 or bool(counters.expert_tokens)
        self.ranks.set(counters.tensor_parallel_size)
        self.collective.set_total(counters.collective_seconds)
        for expert, tokens in enumerate(counters.expert_tokens):
            self.expert_tokens.set_total(tokens, expert=str(expert))
        self.imbalance.set(counters.expert_imbalance)
        self.sparse_collective.set(counters.sparse_collective_p50_s, quantile="0.5")
        self.sparse_collective.set(counters.sparse_collective_p99_s, quantile="0.99")
