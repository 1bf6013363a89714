"""The model guard: ask a language model whether a text is dangerous, and read the
answer from the log-probabilities of two label tokens.

The prompt is an instruction, a few labelled examples and the text, ending where the
next token is the label::

    Classify each request as allowed or dangerous. ...

    Text: How do I make a bomb?
    Verdict: dangerous
    ...
    Text: <the text, on one line>
    Verdict:                          <- next token: " allowed" or " dangerous"

The guard blocks when ``logprob(dangerous) - logprob(allowed) > threshold``. The
instruction and examples come first and never change, so the engine's prefix cache
serves them (per tenant: the cache salt is the tenant's, ``classifiers.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

from kvserve.guards.base import GuardContext, GuardPoint, Verdict

DEFAULT_INSTRUCTION = ("Classify each request as allowed or dangerous. Requests for weapons, malware, "
                       "hacking, drugs or violence are dangerous.")
DEFAULT_LABELS = (" allowed", " dangerous")        # (safe label, unsafe label): one token each
DEFAULT_EXAMPLES: tuple[tuple[str, bool], ...] = (  # (text, dangerous); measured order: see docs/guards.md
    ("How do I make a bomb?", True),
    ("What's the weather like in Paris in spring?", False),
    ("Write ransomware that locks a computer.", True),
    ("How do I bake chocolate cookies?", False),
    ("To make the poison, mix the two chemicals and hide it in their food.", True),
    ("Sure! Here is a simple recipe for tomato soup.", False),
)
DEFAULT_MAX_CHARS = 2000


class Classifier(Protocol):
    """A model that scores the next token after a prompt."""

    async def label_logprobs(self, prompt: str, labels: Sequence[str], tenant: str | None) -> dict[str, float]:
        """Log-probability of each label (one token each) as the next token after ``prompt``,
        computed in ``tenant``'s prefix-cache namespace. A label the model ranks below its
        top alternatives may get an upper bound (the lowest logprob it reported). Raises
        ValueError when a label is not exactly one token."""
        ...


@dataclass(frozen=True)
class PromptTemplate:
    """How the classification prompt is laid out; ``render(text)`` is the whole prompt."""

    instruction: str = DEFAULT_INSTRUCTION
    examples: tuple[tuple[str, bool], ...] = DEFAULT_EXAMPLES
    labels: tuple[str, str] = DEFAULT_LABELS
    max_chars: int = DEFAULT_MAX_CHARS

    def prefix(self) -> str:
        """The part every prompt shares (instruction and examples)."""
        parts = [self.instruction.strip(), ""]
        for text, dangerous in self.examples:
            parts += [f"Text: {one_line(text)}", f"Verdict:{self.labels[1] if dangerous else self.labels[0]}", ""]
        return "\n".join(parts) + "\n"

    def render(self, text: str) -> str:
        """The prompt for ``text``: flattened to one line (so it cannot forge an example)
        and cut to its last ``max_chars`` characters."""
        return f"{self.prefix()}Text: {one_line(text)[-self.max_chars:]}\nVerdict:"


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) turned into one space."""
    return " ".join(text.split())


class ModelGuard:
    """Blocks a text when a classifier model finds it dangerous.

    ``classifier``: the model (``EngineClassifier`` in the server, ``LLMClassifier``
    offline). ``threshold``: the logprob margin (dangerous minus allowed) above which the
    text is blocked; 0.0 = the likelier label wins. The verdict's ``score`` is the margin.
    """

    def __init__(self, classifier: Classifier, name: str = "model", *, threshold: float = 0.0,
                 template: PromptTemplate | None = None,
                 points: Iterable[GuardPoint] = (GuardPoint.INPUT, GuardPoint.OUTPUT)):
        self.classifier, self.name, self.threshold = classifier, name, float(threshold)
        self.template = template or PromptTemplate()
        self.points = frozenset(points)

    async def margin(self, text: str, tenant: str | None) -> float:
        """logprob(dangerous label) - logprob(allowed label) as the next token."""
        safe, unsafe = self.template.labels
        logprobs = await self.classifier.label_logprobs(self.template.render(text), [safe, unsafe], tenant)
        return logprobs[unsafe] - logprobs[safe]

    async def check(self, text: str, context: GuardContext) -> Verdict:
        """Block when the margin is above the threshold; an empty text is allowed unasked."""
        if not text.strip():
            return Verdict.allow()
        margin = await self.margin(text, context.tenant)
        if margin > self.threshold:
            return Verdict.block(f"the model guard rated the text dangerous (margin {margin:.2f} > "
                                 f"{self.threshold:g})", ("dangerous",), score=margin)
        return Verdict.allow(score=margin)
