"""Structured output: grammar-constrained decoding with llguidance.

``StructuredOutputsParams`` (plain data, in SamplingParams) names the constraint; the engine's
``StructuredOutputManager`` compiles it once (``GrammarCompiler``, a bounded cache), keeps one
matcher per sequence and fills the allowed-token bitmask of every constrained row each step;
the runner's sampler applies it. core/ never sees a matcher.
"""

from kvserve.structured.spec import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
