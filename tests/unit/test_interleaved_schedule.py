"""The interleaved schedule's pieces without processes: Megatron-LM's compute order and layer assignment, the tick
plan (every pass after its input, at most one send per rank and tick), the flags' rules (one-line errors), the
bubble line, and a model split into chunks computing what the whole model computes."""

import pytest
import torch

from megatron.config import ConfigError, parse_args
from megatron.config.pipeline_split import (
    accounted_layout,
    chunk_layer_numbers,
    layout_line,
    layout_stage_counts,
    stage_layer_numbers,
)
from megatron.model import GPTModel, Stage
from megatron.parallel.interleaved import Pass, compute_order, tick_plan
from megatron.parallel.pipeline import schedule_line

BASE = "--mock-data --vocab-size 128 --num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16"
BASE += " --micro-batch-size 1 --transformer-impl local"


def _table(order: list[Pass], forward: bool) -> list[tuple[int, int]]:
    return [(p.micro, p.chunk) for p in order if p.forward == forward]


def test_compute_order_is_megatrons():
    # Megatron-LM's example for PP=2, VP=2, 4 micro-batches: micro-batches 0 1 0 1 2 3 2 3 on chunks 0 0 1 1 0 0 1 1
    order = compute_order(pp=2, rank=0, vpp=2, num_micro=4)
    assert _table(order, True) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert _table(order, False) == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]
    # warm-up: (pp - rank - 1) * 2 + (vpp - 1) * pp forward passes, then the steady state's forward, backward
    for pp, vpp, rank, m, warmup in ((2, 2, 0, 4, 4), (2, 2, 1, 4, 2), (4, 2, 0, 8, 10), (4, 3, 3, 8, 8)):
        order = compute_order(pp, rank, vpp, m)
        assert [p.forward for p in order].index(False) == warmup + 1
        assert [p.forward for p in order[warmup : warmup + 6]] == [True, False] * 3
    assert all(p.forward for p in compute_order(2, 0, 2, 4, forward_only=True))
    # --microbatch-group-size-per-virtual-pipeline-stage 3, 5 micro-batches (Megatron-LM's example; warm-up
    # (pp - rank - 1) * 2 + (vpp - 1) * group)
    order = compute_order(pp=2, rank=0, vpp=2, num_micro=5, group=3)
    assert [m for m, _ in _table(order, True)] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in _table(order, True)] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert [p.forward for p in order].index(False) == 5 + 1


@pytest.mark.parametrize(
    "pp, vpp, m, group",
    [(2, 2, 4, None), (2, 3, 2, None), (3, 2, 6, None), (4, 2, 8, None), (4, 4, 4, None), (2, 2, 1, None)]
    + [(2, 2, 5, 3), (4, 3, 10, 5), (4, 2, 12, 6)],
)
def test_tick_plan_runs_each_pass_after_its_input(pp, vpp, m, group):
    plan = tick_plan(pp, vpp, m, group=group)
    when = {(r, p): t for r in range(pp) for t, p in enumerate(plan[r]) if p is not None}
    assert len(when) == pp * vpp * m * 2
    for (r, p), t in when.items():
        stage = p.chunk * pp + r + (-1 if p.forward else 1)
        if 0 <= stage < pp * vpp:  # fed by the neighbouring virtual stage at an earlier tick
            assert when[(stage % pp, Pass(p.forward, p.micro, stage // pp))] < t
        if not p.forward:
            assert when[(r, Pass(True, p.micro, p.chunk))] < t
    if (
        m >= pp and group is None
    ):  # interleaving shortens the step: vpp times smaller passes, no more idle ticks than 1F1B's
        assert len(plan[0]) < vpp * len(tick_plan(pp, 1, m)[0])


def test_layer_assignment_is_megatrons():
    assert chunk_layer_numbers(8, 2, 0, 2) == ((1, 2), (5, 6))
    assert chunk_layer_numbers(8, 2, 1, 2) == ((3, 4), (7, 8))
    assert chunk_layer_numbers(8, 2, 1, 4) == ((2,), (4,), (6,), (8,))
    # uneven: 2 layers on the first stage, 4 on the last: virtual stages of 1, 2, 1, 2 layers
    assert chunk_layer_numbers(6, 2, 0, 2, first=2) == ((1,), (4,))
    assert chunk_layer_numbers(6, 2, 1, 2, first=2) == ((2, 3), (5, 6))
    assert stage_layer_numbers(6, 2, 1, first=2) == (3, 4, 5, 6)
    with pytest.raises(ConfigError, match="multiple of --num-virtual-stages-per-pipeline-rank"):
        chunk_layer_numbers(6, 2, 0, 2, first=1)


def test_pipeline_layout_places_the_layers_megatrons_way():
    # Llama-3-8B on two ranks, the last virtual stage one layer short (it also holds the output layer)
    layout = "Et*4|t*4|t*5|t*4|t*4|t*4|t*4|t*3L"
    assert chunk_layer_numbers(32, 2, 0, 4, layout=layout) == (
        (1, 2, 3, 4),
        (9, 10, 11, 12, 13),
        (18, 19, 20, 21),
        (26, 27, 28, 29),
    )
    assert stage_layer_numbers(32, 2, 1, layout=layout) == (5, 6, 7, 8, 14, 15, 16, 17, 22, 23, 24, 25, 30, 31, 32)
    # groups, repeats and cosmetic commas: the even split of test_layer_assignment_is_megatrons
    assert chunk_layer_numbers(8, 2, 1, 2, layout="E(tt|)*3,ttL") == ((3, 4), (7, 8))
    assert layout_stage_counts("Et*3|(tt|)*2,t*3L", 2, 10) == (3, 2, 2, 3)
    assert layout_stage_counts("E|t*4L", 1, 4) == (0, 4)  # a stage of the embedding alone
    # Megatron-LM's functional test: 6 layers, PP=4 x VPP=2, the embedding and the loss each a stage of their own
    assert accounted_layout(6, 4, 2, embedding=True, loss=True) == "E|t|t|t|t|t|t|L"
    assert accounted_layout(7, 2, 2, embedding=False, loss=True) == "Ett|tt|tt|tL"
    assert layout_line("Et*4|t*4|t*5|t*3L", 2, 16) == (
        "pipeline layout Et*4|t*4|t*5|t*3L: rank 0: embedding + 4, 5 layers; rank 1: 4, 3 layers + loss"
    )
    with pytest.raises(ConfigError, match=r"\(7\) must divide evenly over the 4 x 1 pipeline x virtual stages"):
        accounted_layout(6, 4, 1, embedding=True, loss=False)
    for bad, why in [
        ("Et*3|t*3", r"the loss \(L\) must close the last stage"),
        ("tE|tL", r"the embedding \(E\) must open the first stage"),
        ("Et|t|tL", "3 stages do not divide over --pipeline-model-parallel-size 2"),
        ("Et*2||t|tL", "stage 1 is empty"),
        ("Et*2|t*2mL", r"multi-token-prediction layers \('m'\) are not supported"),
        ("Et*2|t*3L", r"5 transformer layers \(t\), but --num-layers is 4"),
    ]:
        with pytest.raises(ConfigError, match=why):
            layout_stage_counts(bad, 2, 4)


def _parse(flags: str, world_size: int = 2):
    return parse_args(f"{BASE} {flags}".split(), world_size=world_size)


def test_virtual_pipeline_size_from_either_flag():
    assert _parse("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 --global-batch-size 2")
    cfg = _parse("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --global-batch-size 4")
    assert cfg.virtual_pipeline_size == 4
    cfg = _parse("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 2")
    assert cfg.virtual_pipeline_size == 2
    assert _parse("--num-layers-per-virtual-pipeline-stage 8", 1).virtual_pipeline_size == 1  # the whole stage
    assert _parse("--pipeline-model-parallel-size 2 --global-batch-size 3").virtual_pipeline_size == 1
    group = "--microbatch-group-size-per-virtual-pipeline-stage 3 --global-batch-size 8"  # groups of 3, 3 and 2
    assert _parse(f"--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 {group}")


@pytest.mark.parametrize(
    "flags, world_size, message",
    [
        ("--num-virtual-stages-per-pipeline-rank 2", 1, "need --pipeline-model-parallel-size > 1"),
        ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3", 2, "must be a multiple of it"),
        (
            "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1"
            " --num-virtual-stages-per-pipeline-rank 2",
            2,
            "give one of them",
        ),
        (
            "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2"
            " --decoder-first-pipeline-num-layers 2",
            2,
            "--num-virtual-stages-per-pipeline-rank instead",
        ),
        (
            "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2"
            " --decoder-first-pipeline-num-layers 3",
            2,
            "cannot be divided into 2 virtual stages",
        ),
        (
            "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 3",
            2,
            "makes 3",
        ),
        (
            "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 4"
            " --rampup-batch-size 1 1 8",
            2,
            "global batch size 1 makes 1",
        ),
        ("--num-virtual-stages-per-pipeline-rank 0", 1, "must be >= 1"),
        (
            "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 4"
            " --microbatch-group-size-per-virtual-pipeline-stage 5",
            2,
            "groups of --microbatch-group-size-per-virtual-pipeline-stage (default --pipeline-model-parallel-size), 5",
        ),
        (
            "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 7"
            " --microbatch-group-size-per-virtual-pipeline-stage 3",
            2,
            "or to leave a last group of at least 2: global batch size 7 makes 7 micro-batches",
        ),
        (
            "--pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split"
            " --account-for-loss-in-pipeline-split --decoder-last-pipeline-num-layers 3",
            2,
            "--account-for-embedding-in-pipeline-split, --account-for-loss-in-pipeline-split with"
            " --decoder-last-pipeline-num-layers: give one",
        ),
        (
            "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*4|t*4L"
            " --num-virtual-stages-per-pipeline-rank 2",
            2,
            "--pipeline-model-parallel-layout places every layer itself: drop --num-virtual-stages-per-pipeline-rank",
        ),
        ("--pipeline-model-parallel-layout Et*4|t*4L", 1, "--pipeline-model-parallel-layout: 2 virtual pipeline"),
    ],
)
def test_unsupported_combinations_are_one_line_errors(flags, world_size, message):
    with pytest.raises(ConfigError) as info:
        _parse(flags, world_size)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_schedule_line():
    assert schedule_line(4, 1, 8).endswith("bubble fraction (p - 1) / m = 3 / 8 = 0.375")
    line = schedule_line(4, 2, 8)
    assert "interleaved 1F1B, 2 virtual stages per rank over 4 stages" in line and line.endswith("3 / 16 = 0.188")


def test_chunks_of_one_stage_compute_the_whole_model():
    cfg = _parse("", 1)
    torch.manual_seed(0)
    whole = GPTModel(cfg.model, 128)
    torch.manual_seed(0)
    chunked = GPTModel(cfg.model, 128, stage=Stage.of_chunks(((1, 2, 3), (4, 5, 6, 7, 8)), True, True))
    assert chunked.stage.num_chunks == 2 and not chunked.stage.computes_loss(0) and chunked.stage.computes_loss(1)
    assert whole.state_dict().keys() == chunked.state_dict().keys()
    whole.eval(), chunked.eval()  # no dropout
    tokens = torch.randint(0, 128, (2, 16))
    hidden = chunked(tokens, chunk=0)
    assert hidden.shape == (16, 2, 32)
    assert torch.equal(chunked(tokens, hidden=hidden, chunk=1), whole(tokens))
