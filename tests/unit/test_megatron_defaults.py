"""Every flag of ours that Megatron-LM also has takes Megatron-LM's default, unless listed below with a reason.

The reference is tests/unit/megatron_defaults.json, a snapshot of Megatron-LM's own `pretrain_gpt.py` parser
(tools/megatron_flag_defaults.py writes it from a checkout and records the commit)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.assets.data_helpers import ROOT

_spec = importlib.util.spec_from_file_location("tools_megatron_flag_defaults", ROOT / "tools/megatron_flag_defaults.py")
defaults = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = defaults
_spec.loader.exec_module(defaults)

# Flags whose default differs from Megatron-LM's on purpose: flag -> why. Keep it short; each entry is a decision.
DIFFERENT_ON_PURPOSE = {
    "--num-layers": "Megatron-LM has no model without it; here the default is the tiny CPU model (2 layers)",
    "--hidden-size": "Megatron-LM requires it; here the tiny CPU model's 128",
    "--num-attention-heads": "Megatron-LM requires it; here the tiny CPU model's 4",
    "--seq-length": "Megatron-LM requires it; here the tiny CPU model's 128",
    "--micro-batch-size": "Megatron-LM requires it; here the tiny CPU model's 4",
    "--lr": "Megatron-LM requires it; here 3e-4, a working rate for the tiny model",
    "--tokenizer-type": "None: GPT2BPETokenizer (Megatron-LM's) given --vocab-file, else NullTokenizer (mock data)",
    "--split": "Megatron-LM's None becomes '969, 30, 1' in validate_args; here that value directly",
    "--transformer-impl": "None picks transformer_engine where TE runs, else local with a logged note (CPU runs)",
    "--distributed-backend": "None picks nccl on CUDA and gloo on CPU (Megatron-LM has no CPU runs)",
    "--ddp-bucket-size": "Megatron-LM's None means max(40M, 1M x data-parallel size): 40M up to 40 replicas",
    "--num-workers": "0: the mmap'd dataset needs no worker processes on a 2-core CPU box",
    "--eval-interval": "1000: a validation every 1000 steps and at the end (Megatron-LM's None: only at the end);"
    " Megatron-LM's scripts pass it",
    "--eval-iters": "10: a validation costs 10 global batches here (Megatron-LM 100); its scripts pass it",
    "--log-interval": "10: short runs get a line every 10 steps (Megatron-LM 100); its scripts pass it",
    "--lr-decay-style": "cosine, the GPT-3 and Llama recipes' schedule (Megatron-LM linear); its scripts pass it",
    "--num-query-groups": "None: 1 with --group-query-attention (Megatron-LM's MQA), one per head without it",
    "--data-parallel-sharding-strategy": "None: optim_grads_params (Megatron-LM's) with --use-megatron-fsdp, so that"
    " the flag given without FSDP is an error",
    "--async-strategy": "mcore, the background writer built here; Megatron-LM's nvrx (NVIDIA Resiliency Extension)"
    " is not, so its default would make every --async-save an error",
}


def test_our_defaults_match_megatron_lm():
    snapshot = defaults.load_snapshot()["flags"]
    diff = defaults.mismatches(defaults.our_defaults(), snapshot)
    unexplained = {f: d for f, d in diff.items() if f not in DIFFERENT_ON_PURPOSE}
    assert not unexplained, (
        "defaults differ from Megatron-LM's (ours, Megatron-LM's): use Megatron-LM's default, or add the flag to"
        f" DIFFERENT_ON_PURPOSE with the reason: {unexplained}"
    )
    stale = sorted(set(DIFFERENT_ON_PURPOSE) - set(diff))
    assert not stale, f"these defaults now match Megatron-LM's (or the flag is gone): remove them from the list {stale}"


def test_snapshot_records_its_commit_and_pretrain_gpt_defaults():
    data = defaults.load_snapshot()
    assert len(data["megatron_commit"]) == 40
    assert data["args_defaults"] == {"tokenizer_type": "GPT2BPETokenizer"}
    assert data["flags"]["--tokenizer-type"]["default"] == "GPT2BPETokenizer"
    assert data["flags"]["--no-fp8-wgrad"] == {"default": True, "dest": "fp8_wgrad", "sets": False}


@pytest.mark.parametrize(
    ("ours", "theirs", "differ"),
    [
        ({"default": 10}, {"default": 10.0}, False),
        ({"default": 10}, {"default": 100}, True),
        ({"default": None}, {"default": 1}, True),
        ({"default": "auto"}, {"default": "auto"}, False),
        ({"default": [1, 2]}, {"default": (1, 2)}, False),
        ({"default": False}, {"default": 0}, True),  # a switch's False is not the number 0
        # `--no-foo` storing False into dest `foo` (True when absent) vs a store_true `no_foo` (False when absent):
        # both are off until given
        ({"default": True, "sets": False}, {"default": False, "sets": True}, False),
        ({"default": False, "sets": True}, {"default": True, "sets": True}, True),  # already on vs off
        ({"default": False, "sets": True}, {"default": None}, True),  # a switch vs a flag taking a value
    ],
)
def test_comparison_function(ours, theirs, differ):
    assert bool(defaults.mismatches({"--x": ours}, {"--x": theirs})) == differ


def test_flags_megatron_lm_lacks_are_not_compared():
    assert defaults.mismatches({"--ours-only": {"default": 1}}, {"--theirs-only": {"default": 2}}) == {}
