"""astrai: exact, packed, loss-masked LLM training data, and the stages that consume it."""

__version__ = "0.1.0"
