"""Megatron-LM flags whose feature belongs to another open issue parse at their defaults (and at values that mean
today's behaviour) and otherwise stop with one line naming the flag and the issue; flags whose whole meaning is
already the behaviour here are accepted."""

import pytest

from megatron.config import ConfigError, parse_args

BASE = ["--mock-data", "--vocab-size", "128", "--num-layers", "4"]

PENDING = [
    ("--context-parallel-size 2", "--context-parallel-size 2", "issue 17"),
    ("--cp-comm-type a2a", "--cp-comm-type", "issue 17"),
    ("--cp-comm-type p2p p2p a2a a2a", "--cp-comm-type", "issue 17"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1", "--num-layers-per-virtual", "17"),
    ("--num-virtual-stages-per-pipeline-rank 2", "--num-virtual-stages-per-pipeline-rank", "issue 17"),
]


@pytest.mark.parametrize("flags,flag,issue", PENDING)
def test_pending_feature_is_one_line_naming_flag_and_issue(flags, flag, issue):
    argv = BASE + flags.split()
    world = 2 if "pipeline-model-parallel-size" in flags else 1
    with pytest.raises(ConfigError) as err:
        parse_args(argv, world_size=world)
    message = str(err.value)
    assert "\n" not in message and flag in message and issue in message, message
    assert "unrecognized" not in message


def test_defaults_and_todays_behaviour_parse():
    cfg = parse_args(BASE)
    assert cfg.checkpoint.ckpt_format == "torch"
    assert not cfg.checkpoint.async_save and not cfg.checkpoint.use_persistent_ckpt_worker
    assert cfg.checkpoint.dist_ckpt_strictness == "assume_ok_unexpected"
    assert cfg.parallel.context_parallel_size == 1 and cfg.parallel.cp_comm_type == ["p2p"]
    assert cfg.parallel.num_layers_per_virtual_pipeline_stage is None
    assert cfg.parallel.num_virtual_stages_per_pipeline_rank is None
    assert cfg.model.recompute_granularity is None and not cfg.model.recompute_activations
    assert cfg.model.recompute_method is None and cfg.model.recompute_num_layers is None
    assert cfg.model.recompute_modules is None
    explicit = (
        "--ckpt-format torch --context-parallel-size 1 --cp-comm-type p2p --dist-ckpt-strictness assume_ok_unexpected"
        " --num-virtual-stages-per-pipeline-rank 1 --num-layers-per-virtual-pipeline-stage 2"
        " --pipeline-model-parallel-size 2"
    )
    cfg = parse_args(BASE + explicit.split(), world_size=2)  # 4 layers over 2 stages: 2 per stage, no interleaving
    assert cfg.parallel.num_layers_per_virtual_pipeline_stage == 2


def test_flags_whose_meaning_is_the_behaviour_here_are_accepted():
    cfg = parse_args(BASE + ["--use-mcore-models", "--no-persist-layer-norm"])
    assert cfg.training.use_mcore_models and cfg.model.no_persist_layer_norm
    assert cfg.to_dict() == parse_args(BASE).to_dict() | {
        "training": {**parse_args(BASE).to_dict()["training"], "use_mcore_models": True},
        "model": {**parse_args(BASE).to_dict()["model"], "no_persist_layer_norm": True},
    }
