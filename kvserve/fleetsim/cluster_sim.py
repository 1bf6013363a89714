"""The local cluster the cluster checks run (``benchmarks/fleet_sim_cluster.py``,
``benchmarks/fleet_sim_cluster_prefix.py``), simulated: one deployment with the cluster's
options and autoscaling settings on a profiled hardware entry slowed by the probe's fit
(``host_fit.slowed``), played by ``cluster_check.simulate_autoscaled`` (docs/fleet_simulator.md)."""
from __future__ import annotations


class ClusterSimulator:
    """The cluster of ``kvserve cluster serve`` options ``args`` (parsed; its engines' KV budget
    ``--kv-cache-gib``) and autoscaling ``settings``, simulated on the hardware entry at
    ``hw_path``. ``sim(log, slowdown, seq_extra_s=0, start_s=0, path_latency_s=0, host=None,
    prefill_slowdown=None)``: ``log`` through the simulated deployment (the cluster's settings) on
    the hardware entry slowed by ``slowdown``, ``seq_extra_s`` and ``prefill_slowdown``
    (``host_fit.slowed``) on ``host`` (``host_cpu.SharedHost``), its autoscaler reading and
    deciding on ``clock`` (``cluster_check.DecisionClock``; default: the cluster's, given at
    construction): (the filled log, the serving replica count's steps); ``windows``: a list the
    autoscaler's closed demand windows are added to (``simulate_autoscaled``)."""

    def __init__(self, hw_path: str, args, settings, clock):
        from kvserve.loader.api import default_model_path
        from kvserve.planner.hardware import load_hardware_file
        from kvserve.planner.model_io import model_from_gguf
        self.hw, self.model = load_hardware_file(hw_path), model_from_gguf(default_model_path())
        self.args, self.settings, self.clock = args, settings, clock

    def cost(self, slowdown: float, seq_extra_s: float = 0.0, prefill_slowdown: float | None = None):
        from kvserve.fleetsim.host_fit import slowed
        from kvserve.planner.dtypes import kv_dtype, weight_dtype
        from kvserve.planner.roofline import cost_model
        wdtype = dict(self.hw.calibration).get("weight_dtype", "bf16")
        return cost_model(self.model, slowed(self.hw, slowdown, seq_extra_s, prefill_slowdown), weight_dtype(wdtype),
                          kv_dtype(wdtype), 1)

    def __call__(self, log, slowdown: float, seq_extra_s: float = 0.0, start_s: float = 0.0,
                 path_latency_s: float = 0.0, host=None, prefill_slowdown: float | None = None,
                 router_stats: tuple[float, float] | None = None, lead_in=None, clock=None, windows=None):
        from kvserve.fleetsim.cluster_check import simulate_autoscaled
        from kvserve.cluster.admission import fleet_slots
        cm = self.cost(slowdown, seq_extra_s, prefill_slowdown)
        kv_tokens = int(self.args.kv_cache_gib * 2**30 / cm.kv_bytes_per_token)
        slots = fleet_slots(self.settings.max_replicas, self.args.max_num_seqs, self.args.queue_wait_s)
        return simulate_autoscaled(log, cm, self.args.max_num_seqs, self.args.max_num_batched_tokens, kv_tokens,
                                   self.settings, start_s, path_latency_s, slots, self.args.queue_wait_s, host,
                                   router_stats, lead_in, clock or self.clock, windows)
