"""Speculative decoding: proposers (n-gram, draft model, self-draft), verification
inside the target's batched forward, rejection sampling, and adaptive control.

Import submodules directly (``kvserve.spec.ngram`` …): the engine's runner imports
``kvserve.spec.verify`` and ``kvserve.spec.draft`` imports the runner.
"""
