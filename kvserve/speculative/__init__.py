"""Speculative decoding: proposers (n-gram, draft model, self-draft), verification
inside the target's batched forward, rejection sampling, and adaptive control.

Import submodules directly (``kvserve.speculative.ngram`` …): the engine's runner imports
``kvserve.speculative.verify`` and ``kvserve.speculative.draft`` imports the runner.
"""
