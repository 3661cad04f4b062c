"""GPT model and its layers."""

from .gpt import GPTModel, count_parameters

__all__ = ["GPTModel", "count_parameters"]
