"""The autoscaling policies' typed error (an input they cannot use)."""
from __future__ import annotations

from kvserve.errors import InvalidRequestError


class AutoscaleInputError(InvalidRequestError):
    """A bound, window, rate or time the policies cannot use: a negative window, a minimum above
    the maximum, a capacity of zero, time that runs backwards."""

    code = "invalid_autoscale_input"
