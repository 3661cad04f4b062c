"""scripts/probes/ab_steps.py on two gloo ranks: both layouts' trainers in one process, their blocks alternated."""

import json
import os
from pathlib import Path

import pytest

from tests.assets.scripts import load_probe
from tests.dist_utils import run_distributed

# benchmark.py's llama-1b preset and a local config, every width tiny (the later flags win)
TINY = (
    "--num-layers 2 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --num-query-groups 2"
    " --seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 --vocab-size 63"
)


def _load():
    return load_probe("ab_steps")


def _body(rank, world_size, capture):
    ab_steps = _load()
    os.environ["LOCAL_RANK"] = str(rank)  # as under torchrun: no relaunch
    layouts = ["mfsdp2_optim_grads", "mfsdp2_optim_grads_bf16comm_b100m", "dp2_distopt"]
    runs = ab_steps.build_trainers("llama-1b", "local-bf16", layouts, TINY, 20, "cpu")
    trainers = [trainer for trainer, _ in runs]
    assert [t.cfg.sharding.flat_shards for t in trainers] == [True, True, False]  # each its own layout
    assert trainers[1].cfg.parallel.ddp_bucket_size == 100_000_000
    calls = []  # which trainer stepped when

    def recorded(i, step):
        def train_step(*args):
            calls.append(i)
            return step(*args)

        return train_step

    for i, trainer in enumerate(trainers):
        trainer.train_step = recorded(i, trainer.train_step)
    # a counter read before and after each turn: its growth over a turn is the steps taken in it
    times, grew = ab_steps.alternate(
        [step for _, step in runs], blocks=3, block_steps=2, warmup=1, counts=lambda: {"steps": len(calls)}
    )
    # warm-up, then A B C, C B A, A B C
    assert calls == [0, 1, 2] + [0, 0, 1, 1, 2, 2] + [2, 2, 1, 1, 0, 0] + [0, 0, 1, 1, 2, 2]
    assert len(times) == 3 and all(len(row) == 3 and min(row) > 0 for row in times)
    assert grew == [{"steps": 6}] * 3  # three turns of two steps each
    if rank == 0:
        lines, summary = ab_steps.report(layouts, times, grew)
        Path(capture).write_text(json.dumps({"lines": lines, "summary": summary}))


def test_both_layouts_alternate_in_blocks_and_the_gaps_are_paired(tmp_path):
    capture = tmp_path / "report.json"
    run_distributed(_body, world_size=2, args=(str(capture),))
    got = json.loads(capture.read_text())
    times, gaps = got["summary"]["blocks"], got["summary"]["gaps_percent"]
    assert gaps["mfsdp2_optim_grads"] == pytest.approx([100 * (a / c - 1) for a, _, c in times])
    assert gaps["mfsdp2_optim_grads_bf16comm_b100m"] == pytest.approx([100 * (b / c - 1) for _, b, c in times])
    assert got["lines"][-5].startswith("mfsdp2_optim_grads against dp2_distopt: median ")
    assert got["lines"][-4].startswith("mfsdp2_optim_grads_bf16comm_b100m against dp2_distopt: median ")
    assert got["lines"][-4].endswith("over 3 blocks")
    assert got["lines"][-1] == "dp2_distopt during its turns: steps 6"
    assert got["summary"]["dp2_distopt"]["during_turns"] == {"steps": 6}


def test_report_of_known_blocks():
    lines, summary = _load().report(["a", "b"], [[110.0, 100.0], [95.0, 100.0], [120.0, 100.0]])
    assert summary["a"]["gap_median"] == pytest.approx(10.0) and summary["a"]["gap_mean"] == pytest.approx(25 / 3)
    assert "| 2 | 95.0 | 100.0 | -5.0% |" in lines
    assert summary["a"]["median_ms"] == 110.0 and summary["a"]["mean_ms"] == pytest.approx(325 / 3)
    assert summary["b"] == {"median_ms": 100.0, "mean_ms": 100.0}  # the reference: no gap of its own
    lines, summary = _load().report(["a", "b", "c"], [[110.0, 90.0, 100.0], [80.0, 120.0, 100.0]])
    assert "| 1 | 110.0 | 90.0 | 100.0 | +10.0% | -10.0% |" in lines
    assert summary["gaps_percent"] == {"a": pytest.approx([10.0, -20.0]), "b": pytest.approx([-10.0, 20.0])}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--layouts", "dp2_distopt", "1gpu"], "run on different numbers of GPUs"),
        (["--layouts", "dp2_distopt", "nope"], "layout 'nope': unknown part 'nope'"),
        (["--blocks", "0"], "--blocks and --block-steps must be at least 1"),
        (["--layouts", "dp2_distopt"], "--layouts takes at least two"),
    ],
)
def test_bad_flags_are_one_line_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _load().main(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]
