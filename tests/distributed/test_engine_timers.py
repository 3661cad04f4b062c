"""scripts/probes/engine_timers.py on two gloo ranks: the engines' functions (and with --parts the torch calls in them)
timed while on, their exclusive time without their timed callees', and nothing counted while off."""

import json
import os
import time
from pathlib import Path

import pytest

from tests.assets.scripts import load_probe
from tests.dist_utils import run_distributed
from tests.distributed.test_ab_steps import TINY


def _load():
    return load_probe("engine_timers")


def test_exclusive_time_leaves_out_timed_callees():
    timers = _load().Timers()
    inner = timers.wrap("inner", lambda: time.sleep(0.02))
    outer = timers.wrap("outer", lambda: (time.sleep(0.01), inner()))
    outer()  # off: not counted
    assert timers.calls == {}
    timers.on = True
    outer()
    outer()
    assert timers.calls == {"outer": 2, "inner": 2}
    assert timers.exclusive["inner"] == pytest.approx(0.04, abs=0.015)
    assert timers.exclusive["outer"] == pytest.approx(0.02, abs=0.015)
    assert timers.inclusive["outer"] == pytest.approx(timers.exclusive["outer"] + timers.exclusive["inner"])


def _body(rank, world_size, capture):
    engine_timers = _load()
    os.environ["LOCAL_RANK"] = str(rank)  # as under torchrun: no relaunch
    layouts, extra = ["mfsdp2_optim_grads", "dp2_distopt"], f"{TINY} --ddp-bucket-size 3000"
    timers = engine_timers.Timers()
    engine_timers.install(timers, parts=True)
    try:
        runs = engine_timers.build_trainers("llama-1b", "local-bf16", layouts, extra, 8, "cpu")
        tables = engine_timers.measure(timers, [step for _, step in runs], layouts, warmup=1, steps=2)
    finally:
        engine_timers.uninstall()
    if rank == 0:
        Path(capture).write_text(json.dumps(tables))


def test_both_engines_timed_per_step(tmp_path):
    capture = tmp_path / "tables.json"
    run_distributed(_body, world_size=2, args=(str(capture),))
    flat, distopt = json.loads(capture.read_text())
    rows = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[1:] for line in flat[3:-1]}
    # 2 micro-batches a step (global batch 8, micro-batch 2, DP=2): every bucket reduce-scattered in each (the
    # distributed optimizer's in the last only)
    assert {"FlatGradShards._on_grad", "FlatGradShards._retire", "_reduce_scatter"} <= set(rows)
    distopt_rows = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[1:] for line in distopt[3:-1]}
    assert "FlatGradShards._retire" not in distopt_rows
    assert int(rows["_reduce_scatter"][0]) == 2 * int(distopt_rows["_reduce_scatter"][0])
    assert flat[0].startswith("mfsdp2_optim_grads: ") and flat[-1].startswith("| all of them |")
    # --parts: the torch calls inside them (each retire waits for its reduce-scatter; each allocation and each free
    # resizes a bucket's storage; the norm weights' gradients are copied in one call a bucket)
    assert {"Work.wait", "UntypedStorage.resize_", "_foreach_copy_"} <= set(rows)
    assert int(rows["UntypedStorage.resize_"][0]) == 2 * int(rows["FlatGradShards._free"][0])
    assert int(rows["Work.wait"][0]) >= int(rows["_reduce_scatter"][0])  # every reduce-scatter waited for
