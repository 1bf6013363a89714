"""Tier 1: the engine processes' garbage-collector policy (``kvserve/engine/startup_gc.py``):
start-up objects are frozen out of later scans, and a refreeze after a release still frees the
released objects' reference cycles."""
from __future__ import annotations

import gc
import weakref

import pytest


class _Cyclic:
    def __init__(self):
        self.me = self          # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def thawed():
    yield
    gc.unfreeze()               # leave the test process as it was


def test_freeze_moves_what_is_alive_out_of_later_scans(thawed):
    from kvserve.engine.startup_gc import freeze_startup_objects
    gc.unfreeze()
    freeze_startup_objects()
    assert gc.get_freeze_count() > 0


def test_a_frozen_cycle_survives_a_collection_until_the_refreeze_after_its_release(thawed):
    from kvserve.engine.startup_gc import freeze_startup_objects, refreeze_after_release
    gc.unfreeze()
    obj = _Cyclic()
    alive = weakref.ref(obj)
    freeze_startup_objects()
    del obj
    gc.collect()
    assert alive() is not None                 # frozen: the collector does not look at it
    refreeze_after_release()
    assert alive() is None and gc.get_freeze_count() > 0


def test_refreeze_is_a_no_op_when_nothing_was_frozen(thawed):
    from kvserve.engine.startup_gc import refreeze_after_release
    gc.unfreeze()
    refreeze_after_release()
    assert gc.get_freeze_count() == 0
