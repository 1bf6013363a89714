"""Speculative decoding as a plug-in beside the step: proposers (n-gram, draft model,
self-draft) behind one ``Proposer`` interface and a read-only registry, one
``Speculator`` that reserves lookahead slots and learns from verification, the
``Verifier`` the runner is given, rejection sampling, and adaptive control.

It builds on the engine's seam (``kvserve.engine.lookahead``, ``step``, ``model_runner``
for draft passes); the engine never imports this package, and nothing here imports the
scheduler: the composition root (``kvserve.builder``) wires them together.
"""
