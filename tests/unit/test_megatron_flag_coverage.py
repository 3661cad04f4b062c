"""tools/megatron_flag_coverage.py: which configurations count, how uses are classified, nothing silently dropped."""

from __future__ import annotations

import importlib.util
import sys

from megatron.config.cli import all_flags
from tests.assets.data_helpers import ROOT

_spec = importlib.util.spec_from_file_location("tools_megatron_flag_coverage", ROOT / "tools/megatron_flag_coverage.py")
coverage = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = coverage
_spec.loader.exec_module(coverage)


def _write(root, name, text):
    path = root / "tests/functional_tests/test_cases/gpt" / name / "model_config.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(text)


def test_exclusion_rule():
    assert coverage.exclusion("gpt3_mcore_tp1_pp2", {"MODEL_ARGS": {"--num-layers": 2}}) is None
    assert coverage.exclusion("gpt_static_inference_tp1", {}) == "name contains 'inference'"
    assert coverage.exclusion("gpt3_x", {"MODE": "rl"}) == "MODE: rl"
    assert coverage.exclusion("gpt3_gdn", {"MODEL_ARGS": {"--num-experts": 8}}) == "sets --num-experts"


def test_values_become_arguments_as_the_ci_launcher_passes_them():
    assert coverage.arguments("--fp16", True) == ["--fp16"]
    assert coverage.arguments("--lr", 0.01) == ["--lr", "0.01"]
    assert coverage.arguments("--save", "${CHECKPOINT_SAVE_PATH}") == ["--save", "/ci/checkpoint_save_path"]
    assert coverage.arguments("--data-path", "$DATA_BLEND") == ["--data-path", "/ci/data/blend_text_document"]
    assert coverage.arguments("--sizes", "[2 2]") == ["--sizes", "2", "2"]
    assert coverage.arguments("--schedule", "0:384 200B:768") == ["--schedule", "0:384 200B:768"]


def test_survey_counts_classifies_and_lists_every_unknown_flag(tmp_path):
    _write(
        tmp_path,
        "gpt3_works",
        "MODEL_ARGS:\n  --num-layers: 4\n  --bf16: true\n  --save: ${CHECKPOINT_SAVE_PATH}\n  --flag-nobody-has: 3\n",
    )
    # e5m2 is no --fp8-format choice: the flag fails alone with a one-line error
    _write(tmp_path, "gpt3_sp", "MODEL_ARGS:\n  --fp8-format: e5m2\n  --wandb-project: x\n")
    # 6 layers do not split over 4 stages: --num-layers fails only in this combination
    _write(tmp_path, "gpt3_pp4", "MODEL_ARGS:\n  --num-layers: 6\n  --pipeline-model-parallel-size: 4\n")
    _write(tmp_path, "gpt3_moe_x", "MODEL_ARGS:\n  --num-layers: 2\n")
    _write(tmp_path, "gpt3_experts", "MODEL_ARGS:\n  --num-layers: 2\n  --num-experts: 8\n")
    report = coverage.survey(tmp_path)
    assert report.counted == ["gpt3_pp4", "gpt3_sp", "gpt3_works"]
    assert set(report.excluded) == {"gpt3_moe_x", "gpt3_experts"}
    assert report.uses["--num-layers"] == 2 and sum(report.uses.values()) == 8
    assert dict(report.fails_alone_uses) == {"--fp8-format": 1}
    assert dict(report.fails_combined) == {"--num-layers": 1}
    assert report.works == {"--pipeline-model-parallel-size": 1, "--num-layers": 1, "--bf16": 1, "--save": 1}
    text = coverage.markdown(report, "abc123", "2026-01-01")
    assert "configurations counted: **3**, left out: 2" in text
    assert "known flags: 6 uses = 75.0%" in text
    assert "| `--flag-nobody-has` | 1 | **not yet triaged** |" in text
    assert "| `--wandb-project` | 1 | Weights & Biases logging" in text
    assert "| `--fp8-format` | 1 | argument --fp8-format: invalid choice" in text
    assert "abc123" in text and "2026-01-01" in text


def test_reasons_name_only_flags_this_cli_does_not_have():
    """A reason for a flag that exists now is stale."""
    stale = {f for f, why in coverage.REASONS.items() if f in all_flags()}
    assert not stale, f"these flags exist now: remove them from REASONS {stale}"
