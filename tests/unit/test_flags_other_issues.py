"""Megatron-LM flags of context parallelism and distributed checkpoints parse at their defaults and
at values that mean the plain behaviour; flags whose whole meaning is already the behaviour here are accepted."""

from megatron.config import parse_args

BASE = ["--mock-data", "--vocab-size", "128", "--num-layers", "4"]


def test_defaults_and_todays_behaviour_parse():
    cfg = parse_args(BASE)
    assert cfg.checkpoint.ckpt_format == "torch_dist" and not cfg.checkpoint.auto_detect_ckpt_format
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
        " --num-layers-per-virtual-pipeline-stage 2"
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
