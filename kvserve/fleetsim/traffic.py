"""The day's requests, drawn from a scenario with one seeded numpy generator (same seed, same
requests); the formulas are in ``scenario.py``'s docstring."""
from __future__ import annotations

import math

import numpy as np

from kvserve.fleetsim.conversations import add_conversations
from kvserve.fleetsim.log import RequestLog
from kvserve.fleetsim.prompt_ids import add_prefix_groups
from kvserve.fleetsim.scenario import CLASSES, HOUR, Scenario


def model_shares(scenario: Scenario) -> np.ndarray:
    """Each model's share of the requests: ``(i + 1)^-s`` normalised."""
    weights = (np.arange(len(scenario.models)) + 1.0) ** -scenario.zipf_s
    return weights / weights.sum()


def fleet_rate(scenario: Scenario, t: np.ndarray) -> np.ndarray:
    """Requests/s of the whole fleet at times ``t`` (diurnal users / think time, the doubling)."""
    phase = 2 * math.pi * (t / HOUR - scenario.peak_hour + 12.0) / 24.0
    users = scenario.peak_users * (scenario.diurnal_floor + (1 - scenario.diurnal_floor) * (1 - np.cos(phase)) / 2)
    rate = users / scenario.think_s
    d = scenario.doubling
    if d is not None:
        rate = np.where((t >= d.start_s) & (t < d.end_s), rate * d.multiplier, rate)
    return rate


def model_rates(scenario: Scenario, t: np.ndarray) -> np.ndarray:
    """Requests/s per model at times ``t``: shape [models, len(t)] (spikes on their model)."""
    rates = np.outer(model_shares(scenario), fleet_rate(scenario, t))
    for w in scenario.spikes:
        inside = (t >= w.start_s) & (t < w.end_s)
        rows = slice(None) if w.model is None else slice(w.model, w.model + 1)
        rates[rows, inside] *= w.multiplier
    return rates


def mean_rps(scenario: Scenario) -> np.ndarray:
    """Each model's mean requests/s over the scenario (the planner's sizing input)."""
    t = np.arange(0.0, scenario.duration_s, scenario.bin_s) + scenario.bin_s / 2
    return model_rates(scenario, t).mean(axis=1)


def _lengths(rng: np.random.Generator, means: np.ndarray, sigma: float, lo: int, hi: int) -> np.ndarray:
    mu = np.log(means) - sigma * sigma / 2          # the log-normal's mean is ``means``
    return np.clip(np.rint(rng.lognormal(mu, sigma)), lo, hi).astype(np.int64)


def draw_requests(scenario: Scenario) -> RequestLog:
    """Every request of the scenario, sorted by arrival time."""
    rng = np.random.default_rng(scenario.seed)
    starts = np.arange(0.0, scenario.duration_s, scenario.bin_s)
    counts = rng.poisson(model_rates(scenario, starts + scenario.bin_s / 2) * scenario.bin_s)
    model = np.repeat(np.repeat(np.arange(len(scenario.models))[:, None], len(starts), axis=1).ravel(),
                      counts.ravel())
    times = np.repeat(np.tile(starts, len(scenario.models)), counts.ravel()) + rng.random(model.size) * scenario.bin_s
    order = np.argsort(times, kind="stable")
    times, model = times[order], model[order]
    prompts = np.array([m.prompt_tokens for m in scenario.models])[model]
    outputs = np.array([m.output_tokens for m in scenario.models])[model]
    klass = np.array([CLASSES.index(m.klass) for m in scenario.models])[model]
    log = RequestLog(times, model, klass, _lengths(rng, prompts, scenario.length_sigma, 8, 8192),
                     _lengths(rng, outputs, scenario.length_sigma, 1, 4096))
    for i, m in enumerate(scenario.models):        # drawn last: a scenario without prefixes draws as before
        if m.prefix_groups > 0:
            add_prefix_groups(log, rng, m.prefix_groups, m.shared_prefix_tokens, np.flatnonzero(model == i).tolist())
    for i, m in enumerate(scenario.models):        # then conversations, likewise
        if m.turns > 1.0:
            add_conversations(log, rng, m.turns, m.turn_gap_s, np.flatnonzero(model == i).tolist())
    return log
