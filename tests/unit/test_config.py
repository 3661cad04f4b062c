"""Configuration: flag parsing, defaults, and one-line errors for bad values and combinations."""

import json

import pytest

from megatron.config import Config, ConfigError, all_flags, build_parser, parse_args

BASE = "--mock-data --vocab-size 128"


def parse(extra: str = "", **kwargs) -> Config:
    return parse_args(f"{BASE} {extra}".split(), **kwargs)


def test_defaults_are_derived():
    cfg = parse("--hidden-size 256 --num-attention-heads 8 --seq-length 64")
    assert cfg.model.kv_channels == 32
    assert cfg.model.ffn_hidden_size == 1024
    assert cfg.model.num_query_groups == 8
    assert cfg.model.max_position_embeddings == 64
    assert cfg.training.global_batch_size == cfg.training.micro_batch_size
    assert cfg.optimizer.lr_decay_iters == cfg.training.train_iters


def test_llama_style_flags():
    cfg = parse(
        "--hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 2 --swiglu"
        " --normalization RMSNorm --position-embedding-type rope --disable-bias-linear"
        " --untie-embeddings-and-output-weights --rotary-base 500000"
    )
    m = cfg.model
    assert (m.num_query_groups, m.swiglu, m.normalization, m.position_embedding_type) == (2, True, "RMSNorm", "rope")
    assert not m.add_bias and m.untie_embeddings_and_output_weights and m.rotary_base == 500000
    assert m.ffn_hidden_size == 704  # 8/3 * 256 rounded up to a multiple of 64


@pytest.mark.parametrize(
    "extra, flag",
    [
        ("--hidden-size 100 --num-attention-heads 3", "--num-attention-heads"),
        ("--num-attention-heads 8 --group-query-attention --num-query-groups 3", "--num-query-groups"),
        ("--micro-batch-size 4 --global-batch-size 6", "--global-batch-size"),
        ("--seq-length 256 --max-position-embeddings 128", "--max-position-embeddings"),
        ("--lr 1e-4 --min-lr 1e-3", "--min-lr"),
        ("--lr-warmup-iters 50 --train-iters 10", "--lr-warmup-iters"),
        ("--hidden-dropout 1.5", "--hidden-dropout"),
        ("--normalization BatchNorm", "--normalization"),
        ("--save-interval 10", "--save"),
        ("--tensor-model-parallel-size 3", "--tensor-model-parallel-size"),
        ("--first-last-layers-bf16", "--first-last-layers-bf16"),
        ("--num-layers 0", "--num-layers"),
        ("--fp8-stats-interval 10", "--fp8-stats-interval"),
        ("--fp8-format hybrid --fp8-stats-interval -1", "--fp8-stats-interval"),
        ("--fp8-format hybrid --fp8-auto-bf16", "--fp8-stats-interval"),
        ("--fp8-format hybrid --fp8-stats-interval 5 --fp8-guard-saturation 2", "--fp8-guard-saturation"),
        ("--fp8-format hybrid --fp8-stats-interval 5 --fp8-guard-intervals 0", "--fp8-guard-intervals"),
    ],
)
def test_bad_values_fail_in_one_line_naming_the_flag(extra, flag):
    with pytest.raises(ConfigError) as info:
        parse(extra)
    message = str(info.value)
    assert flag in message and "\n" not in message


def test_global_batch_must_divide_by_data_parallel():
    with pytest.raises(ConfigError, match="data-parallel size \\(4\\)"):
        parse("--micro-batch-size 2 --global-batch-size 12", world_size=4)
    cfg = parse("--micro-batch-size 2 --global-batch-size 16", world_size=4)
    assert cfg.data_parallel_size == 4 and cfg.num_micro_batches == 2


def test_data_source_required():
    with pytest.raises(ConfigError, match="--mock-data"):
        parse_args(["--vocab-size", "128"])
    with pytest.raises(ConfigError, match="--vocab-size"):
        parse_args(["--mock-data"])


def test_unknown_flag_is_one_line_error():
    with pytest.raises(ConfigError, match="--no-such-flag"):
        parse("--no-such-flag 3")


def test_fp8_on_gpu_implies_bf16_and_says_so():
    cfg = parse("--fp8-format hybrid", device_type="cuda")
    assert cfg.precision.bf16 and any("--bf16" in n for n in cfg.notes)
    assert not parse("--fp8-format hybrid").precision.bf16  # CPU keeps fp32 (FP8 is emulated)


def test_no_fp8_wgrad_flag_sets_field_off():
    assert parse("--fp8-format e4m3 --no-fp8-wgrad").precision.fp8_wgrad is False
    assert parse("--fp8-format e4m3").precision.fp8_wgrad is True


def test_round_trip_through_dict():
    cfg = parse("--swiglu --num-layers 3")
    again = Config.from_dict(json.loads(cfg.to_json()))
    assert again.to_dict() == cfg.to_dict()


def test_every_flag_has_help_text():
    for action in build_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 10, action.option_strings


def test_help_prints():
    """`pretrain_gpt.py --help`: argparse %-formats every help text, so a percentage quoted in a field's docstring
    must reach it escaped."""
    assert "usage: pretrain_gpt.py" in build_parser().format_help()


def test_megatron_flags_exist():
    required = (
        "--num-layers --hidden-size --ffn-hidden-size --num-attention-heads --group-query-attention"
        " --num-query-groups --kv-channels --seq-length --max-position-embeddings --position-embedding-type"
        " --rotary-base --normalization --norm-epsilon --swiglu --disable-bias-linear"
        " --untie-embeddings-and-output-weights --init-method-std --hidden-dropout --attention-dropout --vocab-size"
        " --make-vocab-size-divisible-by --micro-batch-size --global-batch-size --train-iters --lr --min-lr"
        " --lr-decay-style --lr-warmup-iters --lr-decay-iters --weight-decay --adam-beta1 --adam-beta2 --adam-eps"
        " --clip-grad --bf16 --seed --save --load --save-interval --no-load-optim --no-load-rng --finetune"
        " --eval-interval --eval-iters --log-interval --tensorboard-dir --mock-data --tokenizer-type"
        " --transformer-impl"
    ).split()
    missing = set(required) - set(all_flags())
    assert not missing


def test_sequence_parallel_at_tp1_is_turned_off_with_a_note():
    """Megatron-LM's FP8 Llama script passes --sequence-parallel at TP=1: nothing to split, so it is off, and said."""
    cfg = parse_args(["--mock-data", "--vocab-size", "128", "--sequence-parallel"])
    assert not cfg.parallel.sequence_parallel
    assert any("--sequence-parallel turned off" in note for note in cfg.notes)
    assert parse_args(
        ["--mock-data", "--vocab-size", "128", "--sequence-parallel", "--tensor-model-parallel-size", "2"], world_size=2
    ).parallel.sequence_parallel


def test_fp8_optimizer_levels_expand_to_their_flags():
    o1 = parse("--bf16 --fp8-optimizer-level O1")
    assert o1.parallel.fp8_grad_reduce and not o1.optimizer.use_precision_aware_optimizer
    assert not o1.parallel.grad_reduce_in_bf16 and o1.optimizer.exp_avg_dtype == "fp32"
    o2 = parse("--bf16 --fp8-optimizer-level O2")
    opt = o2.optimizer
    assert opt.use_precision_aware_optimizer and o2.parallel.fp8_grad_reduce and o2.parallel.grad_reduce_in_bf16
    assert (opt.main_params_dtype, opt.main_grads_dtype, opt.exp_avg_dtype, opt.exp_avg_sq_dtype) == (
        "fp16",
        "bf16",
        "fp8",
        "fp16",
    )
    assert parse("--bf16 --fp8-optimizer-level O2 --main-grads-dtype bf16").optimizer == opt  # the level's own value
    with pytest.raises(ConfigError, match="O2 sets --exp-avg-dtype fp8; drop one of the two"):
        parse("--bf16 --fp8-optimizer-level O2 --exp-avg-dtype bf16")
    # O2's states with fp32 gradient buffers: the flags spelled out
    spelled = parse(
        "--bf16 --fp8-grad-reduce --use-precision-aware-optimizer --main-params-dtype fp16 --exp-avg-dtype fp8"
        " --exp-avg-sq-dtype fp16"
    )
    assert spelled.optimizer.main_grads_dtype == "fp32" and not spelled.parallel.grad_reduce_in_bf16
