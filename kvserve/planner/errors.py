"""Typed planner errors: every input the planner refuses is one of these."""
from __future__ import annotations

from kvserve.errors import InvalidRequestError


class PlannerInputError(InvalidRequestError):
    """An input the planner cannot use: unknown name, bad number, unreadable file."""

    code = "invalid_planner_input"


class ImpossibleInputError(PlannerInputError):
    """An input that breaks physics or arithmetic: a claimed throughput above the
    bandwidth roofline, an efficiency above 1, a model that fits on no allowed TP."""

    code = "physically_impossible"
