"""Checkpoints written before safe loading (tests/assets/old_checkpoints, made at 1d946b9) still resume here, weights
only, and reproduce the old run's losses exactly."""

import json
import shutil
from pathlib import Path

import pytest

from megatron.config import parse_args
from megatron.training import Trainer
from tests.unit.ckpt_files import tree_digest

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "old_checkpoints"
EXPECTED = json.loads((ASSETS / "expected.json").read_text())


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_checkpoint_of_the_previous_version_resumes_exactly(tmp_path, fmt, monkeypatch):
    monkeypatch.delenv("MEGATRON_TRUST_CHECKPOINT", raising=False)  # the weights-only path, not the opt-in
    load = tmp_path / fmt
    shutil.copytree(ASSETS / fmt, load)
    before = tree_digest(load)
    cfg = parse_args(f"{EXPECTED['flags']} --train-iters 6 --ckpt-format {fmt} --load {load}".split(), world_size=1)
    state = Trainer(cfg).train()
    assert {str(i): state.losses[i] for i in (5, 6)} == EXPECTED["losses"][fmt]
    assert set(state.losses) == {5, 6}  # resumed at iteration 4, not from scratch
    assert tree_digest(load) == before
