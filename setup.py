"""Install the `megatron` package. CPU machines: `pip install torch==2.13.0` first (the CPU build), then
`pip install -e .[test]`; GPU machines add the `te` extra (Transformer Engine)."""

from setuptools import find_packages, setup

setup(
    name="megatron-fp8",
    version="0.1.0",
    description="FP8-first, Megatron-style GPT pretraining",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "numpy", "sentencepiece", "regex", "tensorboard"],
    extras_require={
        "test": ["pytest", "ruff", "tokenizers", "matplotlib", "tiktoken", "pyyaml", "transformers", "safetensors"],
        "tiktoken": ["tiktoken"],
        "te": ["transformer-engine[pytorch]"],
        "hf": ["tokenizers", "transformers", "safetensors"],
    },
    package_data={"megatron": ["data/assets/*"]},
)
