"""The ranks' skew at their collectives: how long a collective waits for the last rank.

A collective finishes only when every rank has arrived, so its time on one rank is the wait
for the last arrival plus the wire. The wait is no link's cost: it is the ranks' compute
between two collectives taking different times (one rank's core busy with something else,
rank 0 doing the scheduler's work and dispatching the step's work to the others). The
shared-memory collectives stamp each rank's arrival (``ShmCollectives.arrivals``) and a
``RankGroup`` adds them up here, apart for the first collective after a command (a
forward's start: the workers begin when rank 0's command reaches them) and the rest (the
layers' compute between collectives).

``spread`` is what the group as a whole loses to skew: last arrival minus the ranks' mean
arrival, summed over calls (every rank leaves together, so each call's step-time cost is
the slowest rank's compute over the mean rank's). ``wait`` is this rank's own wait.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ArrivalSkew:
    """Sums over stamped collectives (seconds): ``*_first`` for the first collective after a
    command, the others for the rest."""

    calls: int = 0
    wait_s: float = 0.0
    spread_s: float = 0.0
    calls_first: int = 0
    wait_first_s: float = 0.0
    spread_first_s: float = 0.0

    def record(self, arrivals: list[float], rank: int, first_after_command: bool) -> None:
        """Add one collective's arrivals (``perf_counter`` seconds, rank order) seen by ``rank``."""
        last = max(arrivals)
        wait, spread = last - arrivals[rank], last - sum(arrivals) / len(arrivals)
        if first_after_command:
            self.calls_first += 1
            self.wait_first_s += wait
            self.spread_first_s += spread
        else:
            self.calls += 1
            self.wait_s += wait
            self.spread_s += spread

    def snapshot(self) -> "ArrivalSkew":
        """A copy (to difference two moments of a run)."""
        return ArrivalSkew(**vars(self))

    def since(self, earlier: "ArrivalSkew") -> "ArrivalSkew":
        """What was added after ``earlier`` (a snapshot of this one)."""
        return ArrivalSkew(**{k: v - getattr(earlier, k) for k, v in vars(self).items()})
