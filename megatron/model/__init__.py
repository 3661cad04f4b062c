"""GPT model and its layers."""

from .gpt import GPTModel, Stage, count_parameters

__all__ = ["GPTModel", "Stage", "count_parameters"]
