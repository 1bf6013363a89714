"""Typed engine gauges and counters (``EngineCore.stats()``), mirrored by the server's
metrics. Pure data: plain ints, floats and lists, so the codec sends it as a map."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass(frozen=True)
class SpeculationCounters:
    """Speculative decoding since start (all zero when speculation is off)."""

    enabled: bool = False
    num_proposed: int = 0                 # lookahead tokens put up for verification
    num_accepted: int = 0                 # of those, accepted
    num_verifications: int = 0            # sequence-steps that verified >= 1 token
    num_steps_on: int = 0                 # steps where some sequence speculated
    num_steps_off: int = 0                # decode steps where speculation was switched off by cost
    accepted_per_position: list[int] = field(default_factory=list)   # [i]: verifications accepting token i

    @property
    def mean_accepted_length(self) -> float:
        """Accepted tokens per verification."""
        return self.num_accepted / self.num_verifications if self.num_verifications else 0.0


@dataclass(frozen=True)
class AdapterCounters:
    """LoRA adapters since start (all zero when LoRA is off). Tiers: resident slots (the
    forward reads them), host memory (loaded, LRU), disk."""

    enabled: bool = False
    max_resident: int = 0                 # resident slots (--max-loras)
    max_host: int = 0                     # host-tier capacity (--max-cpu-loras)
    num_registered: int = 0               # names that resolve now
    num_resident: int = 0                 # slots holding an adapter
    num_host: int = 0                     # adapters in host memory
    num_disk_loads: int = 0               # disk -> host
    num_slot_loads: int = 0               # host -> resident slot (swaps in)
    num_slot_evictions: int = 0           # a resident adapter replaced by another
    num_host_evictions: int = 0           # dropped from host memory (LRU)
    disk_load_seconds: float = 0.0        # total time of the disk loads
    slot_load_seconds: float = 0.0        # total time of the slot loads
    num_waiting_for_slot: int = 0         # sequences held back because no slot was free
    running_adapters: list[str] = field(default_factory=list)   # names with a running sequence
    waiting_adapters: list[str] = field(default_factory=list)   # names with a held-back sequence
    resident_ids: list[str] = field(default_factory=list)       # identities (digests) in the slots now


@dataclass(frozen=True)
class PrefixSubtree:
    """One top-level branch of the prefix cache: the blocks under one first block of one
    namespace, i.e. what requests starting with the same tokens share (a system prompt, a
    document). Sizes only: no token ids leave the engine this way."""

    adapter_id: str | None = None         # the namespace: LoRA adapter (None = base weights),
    cache_salt: str | None = None         # the tenant's salt ("tenant:<name>"),
    weight_epoch: int = 0                 # and the weights' epoch
    num_blocks: int = 0                   # blocks in the branch
    num_leaves: int = 0                   # distinct continuations cached (leaves)
    num_locked_blocks: int = 0            # of its blocks, held by running sequences now


@dataclass(frozen=True)
class ParallelCounters:
    """Tensor / expert parallelism and mixture-of-experts load (zeros for a dense model on
    one rank). ``expert_tokens``: rows routed to each expert since start, summed over the
    sparse layers; ``expert_imbalance``: max / mean rows per expert in the last forward
    (averaged over the sparse layers); the sparse layers' collectives (all-to-all dispatch and
    combine, all-gather) per forward, p50 and p99 over the last forwards (up to 4,096 a layer)."""

    tensor_parallel_size: int = 1
    collective_seconds: float = 0.0       # rank 0's time inside collectives since start
    expert_tokens: list[int] = field(default_factory=list)
    expert_imbalance: float = 0.0
    sparse_collective_p50_s: float = 0.0
    sparse_collective_p99_s: float = 0.0


@dataclass(frozen=True)
class EngineStats:
    """One snapshot of the engine (and, from the engine process, of its loop)."""

    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    kv_blocks_used: int = 0               # held by running sequences
    kv_blocks_cached: int = 0             # held by the prefix cache alone (reclaimable)
    kv_blocks_total: int = 0
    kv_cache_dtype: str = ""              # KV storage: "float32", ..., "int8", "fp8_e4m3", "fp8_e5m2"
    num_preemptions: int = 0
    num_steps: int = 0
    step_seconds: float = 0.0             # wall seconds of all steps (StepClock)
    step_cpu_seconds: float = 0.0         # the process's CPU seconds in them
    prefix_cache_enabled: bool = False
    prefix_cache_queries: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_evicted_blocks: int = 0
    prefix_cache_blocks: int = 0
    # the largest top-level branches of the prefix cache (refreshed at most once a second)
    prefix_cache_subtrees: list[PrefixSubtree] = field(default_factory=list)
    speculation: SpeculationCounters = field(default_factory=SpeculationCounters)
    adapters: AdapterCounters = field(default_factory=AdapterCounters)
    parallel: ParallelCounters = field(default_factory=ParallelCounters)
    # the measured step-time model t = a + b * tokens (0 until two step sizes were seen)
    step_time_fixed_s: float = 0.0        # a: seconds of a step whatever its size
    step_time_per_token_s: float = 0.0    # b: seconds per token in the step
    # fair sharing on: tokens computed per tenant since start ("" = requests without one)
    tenant_served_tokens: dict[str, int] = field(default_factory=dict)
    # set by the engine process's loop
    num_requests: int = 0                 # requests the loop tracks (added, not ended)
    num_aborted: int = 0
    integrity_ok: bool = True

    def to_dict(self) -> dict:
        """A plain map (the codec's wire form)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "EngineStats":
        """The inverse of ``to_dict``; unknown keys are an error (a version mismatch)."""
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown EngineStats fields {sorted(unknown)}")
        values = dict(raw)
        if isinstance(values.get("speculation"), dict):
            values["speculation"] = SpeculationCounters(**values["speculation"])
        values["prefix_cache_subtrees"] = [PrefixSubtree(**t) if isinstance(t, dict) else t
                                           for t in values.get("prefix_cache_subtrees", [])]
        if isinstance(values.get("adapters"), dict):
            values["adapters"] = AdapterCounters(**values["adapters"])
        if isinstance(values.get("parallel"), dict):
            values["parallel"] = ParallelCounters(**values["parallel"])
        return cls(**values)
