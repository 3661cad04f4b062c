"""megatron/training/shutdown.py: parts stop newest first and once each, an error skips what needs the other ranks
and loses no stop, the process groups go last and really go (no reference left to keep their threads)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch.distributed as dist

from megatron.training.shutdown import Shutdown, forget_frames


def _recorder():
    calls: list[str] = []
    lines: list[str] = []
    shutdown = Shutdown(log=lines.append)

    def part(name: str, fail: bool = False):
        def stop() -> None:
            calls.append(name)
            if fail:
                raise RuntimeError(f"{name} failed")

        return stop

    return shutdown, calls, lines, part


def test_parts_stop_newest_first_and_once():
    shutdown, calls, _, part = _recorder()
    for name in ("tensorboard", "runtime", "async save", "loader"):
        shutdown.add(name, part(name))
    shutdown.stop()
    assert calls == ["loader", "async save", "runtime", "tensorboard"]
    assert shutdown.stopped == calls
    shutdown.stop()
    shutdown.close()
    assert calls == ["loader", "async save", "runtime", "tensorboard"]  # nothing twice
    shutdown.add("later", part("later"))
    shutdown.close()
    assert calls[-1] == "later" and len(calls) == 5


def test_close_stops_training_parts_then_the_process_parts():
    shutdown, calls, _, part = _recorder()
    shutdown.add_at_exit("hooks", part("hooks"))
    shutdown.add("tensorboard", part("tensorboard"))
    shutdown.stop()
    assert calls == ["tensorboard"]  # the end of training leaves the process's parts alone
    shutdown.add_at_exit("more hooks", part("more hooks"))
    shutdown.close()
    assert calls == ["tensorboard", "more hooks", "hooks"]


def test_after_an_error_parts_that_need_the_other_ranks_are_left_and_failures_are_printed(capsys):
    shutdown, calls, lines, part = _recorder()
    shutdown.add("tensorboard", part("tensorboard"))
    shutdown.add("async save", part("async save"), needs_peers=True)
    shutdown.add("loader", part("loader", fail=True))
    shutdown.stop(ok=False)  # raises nothing: the error on its way out is the one to report
    assert calls == ["loader", "tensorboard"]
    assert shutdown.skipped == ["async save"]
    assert lines == ["> shutdown after an error: async save left as it is (it needs every rank)"]
    assert "stopping loader failed: RuntimeError('loader failed')" in capsys.readouterr().err


def test_on_an_orderly_end_a_failing_part_is_raised_after_every_part_stopped():
    shutdown, calls, _, part = _recorder()
    shutdown.add("tensorboard", part("tensorboard"))
    shutdown.add("async save", part("async save", fail=True), needs_peers=True)
    shutdown.add("loader", part("loader"))
    with pytest.raises(RuntimeError, match="async save failed"):
        shutdown.stop()
    assert calls == ["loader", "async save", "tensorboard"]
    shutdown.stop()
    assert calls == ["loader", "async save", "tensorboard"]  # the failed part is not tried again


def test_stopping_and_on_error_blocks():
    shutdown, calls, _, part = _recorder()
    with pytest.raises(ValueError):
        with shutdown.on_error():
            shutdown.add("runtime", part("runtime"))
            shutdown.add("async save", part("async save"), needs_peers=True)
            raise ValueError("a part failed to start")
    assert calls == ["runtime"] and shutdown.skipped == ["async save"]
    with shutdown.on_error():
        shutdown.add("tensorboard", part("tensorboard"))
    assert calls == ["runtime"]  # no error: nothing stopped
    with shutdown.stopping():
        shutdown.add("loader", part("loader"))
    assert calls == ["runtime", "loader", "tensorboard"]


def test_close_releases_the_groups_it_owns_after_the_parts(one_rank_world, monkeypatch):
    barriers = []
    real_barrier = dist.barrier
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: (barriers.append(1), real_barrier(*a, **k)))
    shutdown, calls, lines, _ = _recorder()
    group = dist.new_group([0])
    shutdown.own_process_groups([dist.group.WORLD, group, None], timeout_minutes=1)
    shutdown.add_at_exit("hooks", lambda: calls.append(f"hooks, groups up: {dist.is_initialized()}"))
    watched = weakref.ref(group)
    del group
    shutdown.close()
    assert calls == ["hooks, groups up: True"]
    assert not dist.is_initialized() and barriers == [1]
    assert shutdown.stopped[-1] == "process groups"
    gc.collect()
    assert watched() is None and lines == []
    shutdown.close()  # once only
    assert shutdown.stopped.count("process groups") == 1


def test_a_group_still_referenced_is_reported_and_an_error_skips_the_barrier(one_rank_world, monkeypatch):
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: pytest.fail("no barrier after an error"))
    shutdown, _, lines, _ = _recorder()
    group = dist.new_group([0])
    shutdown.own_process_groups([group], timeout_minutes=1)
    shutdown.close(ok=False)
    assert not dist.is_initialized()
    assert len(lines) == 1
    assert lines[0].startswith(
        "> WARNING: rank 0: 1 process group(s) still referenced after their release: their threads outlive the run"
        f" and may abort the process at exit: group {group.group_name} (ranks 0) held by "
    )
    del group


class _Cache:
    def __init__(self) -> None:
        self.groups: dict[str, object] = {}


_CACHE = _Cache()


def test_the_warning_names_each_group_once_and_what_holds_it(one_rank_world):
    shutdown, _, lines, _ = _recorder()
    held, released = dist.new_group([0]), dist.new_group([0])
    shutdown.own_process_groups({"world": dist.group.WORLD}, timeout_minutes=1)
    shutdown.watch({"dp_group": held, "dp_cp_group": held, "amax_group": released, "tp_group": None})
    _CACHE.groups["recipe=1,group=2"] = held
    del held, released
    try:
        shutdown.close()
    finally:
        _CACHE.groups.clear()
    assert len(lines) == 1, lines
    head, holders = lines[0].split(" at exit: ")
    assert head.startswith("> WARNING: rank 0: 1 process group(s) still referenced")  # one group, two names
    assert holders.startswith("dp_group=dp_cp_group (ranks 0) held by dict['recipe=1,group=2'] <- _Cache.groups <- ")
    assert holders.endswith("test_shutdown._CACHE")


def test_groups_the_run_did_not_start_are_left_to_their_owner(one_rank_world):
    shutdown, _, _, _ = _recorder()
    shutdown.close()
    assert dist.is_initialized()


class _Holder:
    pass


def test_forget_frames_lets_the_objects_of_a_failed_call_go():
    def run(holder: _Holder) -> None:
        inner = holder  # noqa: F841 - what a finished frame of the traceback keeps
        raise RuntimeError("boom")

    holder = _Holder()
    watched = weakref.ref(holder)
    try:
        try:
            run(holder)
        except RuntimeError as exc:
            raise ValueError("again") from exc
    except ValueError as exc:
        del holder
        gc.collect()
        assert watched() is not None  # the chained exception's frames hold it
        forget_frames(exc)
        gc.collect()
        assert watched() is None
        assert "boom" in str(exc.__cause__)
