"""Guards: checks on a request's input, its output stream and its whole output
(docs/guards.md). The server builds one ``GuardSet`` per tenant from the tenants file
(``config.build_guard_sets``) and calls ``GuardSet.run`` / ``GuardSet.check_stream``."""
from kvserve.guards.base import (Action, ContentPolicyViolation, Guard, GuardContext, GuardPoint, Span, Verdict,
                                 apply_spans, join_segments, redact_segments)
from kvserve.guards.config import build_guard_sets, build_guard_spec
from kvserve.guards.model_guard import Classifier, ModelGuard, PromptTemplate
from kvserve.guards.rules import PII_DETECTORS, RulesGuard
from kvserve.guards.runner import GuardOutcome, GuardResult, GuardSet, GuardSpec
from kvserve.guards.stream import Release, StreamGuard

__all__ = [
    "Action", "Classifier", "ContentPolicyViolation", "Guard", "GuardContext", "GuardOutcome", "GuardPoint",
    "GuardResult", "GuardSet", "GuardSpec", "ModelGuard", "PII_DETECTORS", "PromptTemplate", "Release", "RulesGuard",
    "Span", "StreamGuard", "Verdict", "apply_spans", "build_guard_sets", "build_guard_spec", "join_segments",
    "redact_segments",
]
