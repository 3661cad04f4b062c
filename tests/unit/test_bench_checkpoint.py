"""scripts/bench_checkpoint.py: the runs it launches, the log lines it reads, and a CPU run of a tiny model whose
table holds the save, blocked and load seconds."""

import builtins
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron.perf import rows
from tests.assets.scripts import ROOT, load_script

SCRIPT = ROOT / "scripts" / "bench_checkpoint.py"
bench = load_script("bench_checkpoint")


def test_the_saving_run_saves_at_its_last_iteration_and_the_loading_run_trains_one_more(tmp_path):
    save, load = bench.commands("llama-1b", "te-delayed", "torch_dist_async", 3, tmp_path / "ckpt")
    assert save[save.index("--save-interval") + 1] == "3" and save[save.index("--train-iters") + 1] == "3"
    assert "--async-save" in save and "--save" not in load and load[load.index("--train-iters") + 1] == "4"
    assert load[load.index("--load") + 1] == str(tmp_path / "ckpt") and "--fp8-recipe" in load
    assert bench.PRESETS["llama-1b"] is rows.PRESETS["llama-1b"]  # the benchmark's, not a copy
    save, load = bench.commands("llama-1b", "te-delayed", "torch_dist_async", 3, tmp_path / "ckpt", saves=2)
    assert save[save.index("--save-interval") + 1] == "3" and save[save.index("--train-iters") + 1] == "6"
    assert load[load.index("--train-iters") + 1] == "7"


def test_parse_times_reads_the_checkpointer_lines():
    log = (
        "  successfully saved checkpoint at iteration       3 to /c/iter_0000003 (torch_dist) in 3.21 s\n"
        "  queued (--async-save) checkpoint at iteration       3 to /c/iter_0000003 (torch_dist): training blocked"
        " 0.41 s\n"
        "  checkpoint at iteration       3 written in the background to /c/iter_0000003 in 5.50 s\n"
        "  successfully loaded checkpoint from /c at iteration 3 (torch_dist) in 2.05 s\n"
    )
    assert bench.parse_times(log) == {"save_s": 3.21, "blocked_s": 0.41, "written_s": 5.5, "load_s": 2.05}
    log += (  # a second save that first waited for the previous background write: the wait is not the copy's
        "  queued (--async-save) checkpoint at iteration       6 to /c/iter_0000006 (torch_dist): training blocked"
        " 4.75 s (4.50 s of it waiting for the previous background write)\n"
    )
    times = bench.parse_times(log)
    assert times["first_blocked_s"] == 0.41 and times["blocked_s"] == pytest.approx(0.25)


@pytest.mark.slow
def test_a_tiny_cpu_run_fills_the_table(capsys, monkeypatch):
    # The two invocations are independent (each its own scratch folder) and each mostly waits for its
    # single-threaded pretrain_gpt.py runs: side by side on the two cores. One print at a time, so that each table's
    # lines stay whole; its rows are told apart by their format.
    lock, builtin_print = threading.Lock(), builtins.print

    def whole_lines(*args, **kwargs) -> None:
        with lock:
            builtin_print(*args, **kwargs)

    monkeypatch.setattr(builtins, "print", whole_lines)
    tiny = ["--presets", "tiny", "--configs", "local-bf16"]
    with ThreadPoolExecutor(2) as pool:
        sync = pool.submit(bench.main, [*tiny, "--iters", "2", "--formats", "torch"])
        queued = pool.submit(bench.main, [*tiny, "--iters", "1", "--saves", "2", "--formats", "torch_dist_async"])
        results = sync.result() + queued.result()
    out = capsys.readouterr().out
    assert [r.error for r in results] == [None, None], out
    rows = {line.split("|")[3].strip(): line for line in out.splitlines() if line.startswith("| tiny |")}
    assert sorted(rows) == ["torch", "torch_dist_async"], out
    number = r"\d+\.\d\d"
    sync_row = rows["torch"]
    assert re.fullmatch(rf"\| tiny \| local-bf16 \| torch \| {number} \|  \|  \| {number} \| {number} \|", sync_row)
    assert re.fullmatch(
        rf"\| tiny \| local-bf16 \| torch_dist_async \|  \| {number} \(first {number}\) \| {number} \| {number}"
        rf" \| {number} \|",
        rows["torch_dist_async"],
    )
    assert results[0].size_gib > 0 and results[1].size_gib > 0
