"""kvserve: a readable LLM inference engine and serving platform."""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredKind", "StructuredSpec", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import kvserve.planner` never pays for torch.
    if name == "LLM":
        from kvserve.frontend.llm import LLM
        return LLM
    if name == "LoRARequest":
        from kvserve.frontend.lora_request import LoRARequest
        return LoRARequest
    if name == "SamplingParams":
        from kvserve.sampling.params import SamplingParams
        return SamplingParams
    if name in ("StructuredKind", "StructuredSpec"):
        from kvserve.engine import structured_spec
        return getattr(structured_spec, name)
    raise AttributeError(name)
