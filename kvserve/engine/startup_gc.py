"""Keep Python's cyclic garbage collector off the serving loop's tail.

A long-lived engine process (the server's engine, each tensor- or expert-parallel rank) holds
hundreds of thousands of objects from start-up: modules, the model's ``nn.Module`` tree, the
runner. Every full collection scans them all (~50-80 ms with torch and a model loaded), and on a
rank it stalls every other rank at the next collective: it was the 47-57 ms p99 of the EP
all-to-all in ``benchmarks/parallel.py`` (docs/parallelism.md). ``freeze_startup_objects``
collects once and moves everything alive into the permanent generation (``gc.freeze``), so
later collections scan only what the serving loop allocates; garbage is still collected.
Frozen objects caught in a reference cycle are not, so whatever replaces a start-up object
wholesale (a weight swap drops the old model) calls ``refreeze_after_release``.
"""
from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Collect, then freeze every object alive now out of later collections' scans (call once,
    after the engine or the rank is built and before it serves)."""
    gc.collect()
    gc.freeze()


def refreeze_after_release() -> None:
    """After start-up objects were dropped (the old model of a weight swap): unfreeze, collect
    whatever of them sat in reference cycles, freeze again. A no-op where nothing was frozen."""
    if gc.get_freeze_count():
        gc.unfreeze()
        freeze_startup_objects()
