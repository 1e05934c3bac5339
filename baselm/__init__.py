"""base: a local LLM runtime on MLX."""

__version__ = "0.1.0"
