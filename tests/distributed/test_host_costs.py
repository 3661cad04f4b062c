"""scripts/probes/host_costs.py on two gloo ranks: every call that needs no GPU timed on the main thread and inside a
gradient hook (the autograd engine's thread), the collectives among them run by both ranks together."""

import json
import threading
from pathlib import Path

import pytest

from tests.assets.scripts import load_probe
from tests.dist_utils import run_distributed


def _load():
    return load_probe("host_costs")


def _body(rank, world_size, capture):
    host_costs = _load()
    table = host_costs.calls("cpu", 2000)
    main = host_costs.time_calls(table, repeats=5, warmup=1)
    threads = []
    spy = [(label, lambda call=call: (threads.append(threading.get_ident()), call())) for label, call in table]
    hook = host_costs.in_hook(spy, repeats=5, warmup=1, device="cpu")
    # the hook's calls ran on the autograd engine's thread (for CPU tensors: this one), all of them
    assert len(threads) == 6 * len(table)
    if rank == 0:
        Path(capture).write_text(json.dumps({"main": main, "hook": hook, "lines": host_costs.report(main, hook)}))


def test_every_call_timed_on_the_main_thread_and_in_a_hook(tmp_path):
    capture = tmp_path / "costs.json"
    run_distributed(_body, world_size=2, args=(str(capture),))
    got = json.loads(capture.read_text())
    assert set(got["main"]) == set(got["hook"])
    assert {"reduce-scatter, async_op, then wait", "_foreach_copy_ of the same 8"} <= set(got["main"])
    assert all(len(t) == 5 and min(t) > 0 for t in [*got["main"].values(), *got["hook"].values()])
    assert got["lines"][0].startswith("| call | main thread: median us |")
    assert len(got["lines"]) == 2 + len(got["main"])


@pytest.mark.parametrize("flags", [["--elements", "150"], ["--repeats", "0"]])
def test_bad_flags_are_one_line_errors(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _load().main(flags)
    assert exit_info.value.code == 2 and "--elements must be a positive multiple of 200" in capsys.readouterr().err
