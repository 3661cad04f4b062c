"""The end of a run, on every path (the last step, --exit-interval, --exit-duration-in-mins, --exit-signal-handler, an
error): one place that knows what the run started and stops it in order, newest first, each thing once.

What a run starts, and who stops it here (the trainer registers each part as it starts it):
- the loop's data loader iterator (worker processes and, on a GPU, the pin-memory thread);
- --async-save's background write (torch DCP's thread) and rank 0's publishing thread: finished and made visible;
- the profiler window, the --exit-signal-handler handler, the garbage collector under --manual-gc (`Runtime`);
- the TensorBoard writer's thread (flushed and closed);
- what keeps a process group beyond the trainer: the gradient buffers' hooks on the parameters, and on the
  Transformer Engine path TE's module-level state (megatron/model/te_state.py), both exit parts;
- the process groups (`torch.distributed`'s default group, the groups of `ParallelDims`, the checkpointer's gloo
  group): after a barrier, every group is destroyed, the sub-groups first and the default last, and their last
  references dropped, so that their backends' destructors join the backends' threads (gloo's `pt_gloo_runloop`
  workers and `gloo_tcp_loop`, NCCL's watchdog) while the interpreter still runs. A watched group that something
  still references is named in a warning with the chain of objects holding it (holders.py).

Why that last step matters (without it, 4 of 25 DP=2 FP8 CPU runs printed their final loss and aborted with
"terminate called without an active exception"). A gloo worker thread drops its reference to a finished collective
only after the rank that waited on it has gone on; when that reference is the last one to a tensor whose Python
object the C++ side keeps alive, the drop takes the GIL to release the Python object. If the main thread has
reached `Py_FinalizeEx` by then, CPython ends the worker with `pthread_exit`, whose forced unwinding reaches the
(noexcept) destructor of the work object, and C++ calls std::terminate: SIGABRT, torchrun exit 1, a requeue under
Slurm. Destroying the groups and dropping their references before the interpreter finalizes joins those threads
while the GIL can still be taken.

After an error, the stops that need the other ranks (the barrier, waiting for a background save) are skipped: a
rank that failed alone cannot count on the others, and its exception, not a hang, is what must come out.
"""

from __future__ import annotations

import gc
import sys
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

from .guards import guard_collectives
from .holders import holder_chain
from .logger import print_rank_0


@dataclass
class _Part:
    name: str
    stop: Callable[[], None]
    needs_peers: bool


@dataclass
class _Watched:
    group: weakref.ref
    names: list[str]
    """Every name it was watched under (ParallelDims's dp_group and dp_cp_group are one group without CP)."""
    ranks: str
    """Its global ranks, read when it was watched (a destroyed group has none to read)."""

    def describe(self) -> str:
        return f"{'='.join(self.names)} ({self.ranks})"


Groups = Mapping[str, dist.ProcessGroup | None] | Iterable[dist.ProcessGroup | None]
"""Process groups to watch: by name (the warning names them), or unnamed (named by torch's group name)."""


class Shutdown:
    """What a run started and how to stop it (see the module's docstring). Two kinds of parts: those of training
    (`add`: stopped by `stop`, which `Trainer.train` calls as it ends) and those of the process (`add_at_exit`: what
    holds a process group and must outlive training, stopped by `close` before the groups are released)."""

    def __init__(self, log: Callable[[str], None] = print_rank_0):
        self.log = log
        self._parts: list[_Part] = []
        self._exit_parts: list[_Part] = []
        self._watched: list[_Watched] = []
        self._owns_process_groups, self._timeout_minutes = False, 0
        self.stopped: list[str] = []
        """Names of the parts stopped so far, in the order they were stopped."""
        self.skipped: list[str] = []
        """Names of the parts an error left running (they need the other ranks)."""

    def add(self, name: str, stop: Callable[[], None], needs_peers: bool = False) -> None:
        """Register a part of training just started; `stop` ends it. `needs_peers`: `stop` runs collectives (every
        rank calls it at the same point), so it runs only on an orderly end, not after an error."""
        self._parts.append(_Part(name, stop, needs_peers))

    def add_at_exit(self, name: str, stop: Callable[[], None]) -> None:
        """Register a part that lives until the process ends (`close`); `stop` needs no other rank."""
        self._exit_parts.append(_Part(name, stop, needs_peers=False))

    def own_process_groups(self, groups: Groups, timeout_minutes: int) -> None:
        """The run started torch.distributed: `close` destroys every group. `groups` (None entries skipped) are
        watched: a group still referenced after its release keeps its threads alive, and `close` says so, naming
        the group and what holds it. `timeout_minutes`: --distributed-timeout-minutes, named by the error of a
        final barrier a rank missed."""
        self._owns_process_groups, self._timeout_minutes = True, timeout_minutes
        self.watch(groups)

    def watch(self, groups: Groups) -> None:
        """More groups to check at their release (None entries skipped; a group watched twice is one group with
        two names)."""
        named = groups.items() if isinstance(groups, Mapping) else ((None, group) for group in groups)
        for name, group in named:
            if group is None:
                continue
            name = name or _torch_name(group)
            same = [w for w in self._watched if w.group() is group]
            if same:
                same[0].names.append(name)
            else:
                self._watched.append(_Watched(weakref.ref(group), [name], _ranks(group)))

    def stop(self, ok: bool = True) -> None:
        """Stop every part of training, the newest first, each once (a second call stops what was added since).
        `ok`: an orderly end; a part's failure is raised once all parts are stopped. Not `ok` (an exception is on its
        way out): parts that need the other ranks are skipped and a part's failure is printed, not raised."""
        self._stop(self._parts, ok)

    def _stop(self, parts: list[_Part], ok: bool) -> None:
        errors: list[BaseException] = []
        while parts:
            part = parts.pop()  # popped first: a part that fails is not stopped twice
            if part.needs_peers and not ok:
                self.skipped.append(part.name)
                self.log(f"> shutdown after an error: {part.name} left as it is (it needs every rank)")
                continue
            try:
                part.stop()
            except BaseException as exc:  # the other parts still stop
                if ok:
                    errors.append(exc)
                else:
                    print(f"shutdown: stopping {part.name} failed: {exc!r}", file=sys.stderr, flush=True)
            self.stopped.append(part.name)
        if errors:
            raise errors[0]

    @contextmanager
    def on_error(self) -> Iterator[None]:
        """Stops the parts of training if the block raises (then re-raises)."""
        try:
            yield
        except BaseException:
            self.stop(ok=False)
            raise

    @contextmanager
    def stopping(self) -> Iterator[None]:
        """Stops the parts of training when the block ends: in order when it ends normally, as after an error when
        it raises."""
        with self.on_error():
            yield
        self.stop(ok=True)

    def close(self, ok: bool = True) -> None:
        """The process's end: stop the parts of training left, then those of the process, then release the process
        groups if the run started them. Call it once the trainer and everything else that holds a group is dropped
        (`forget_frames` for an exception's traceback). After an error (not `ok`) nothing here raises: the error
        is the one to report."""
        try:
            self.stop(ok)
        finally:
            try:
                self._stop(self._exit_parts, ok)
            finally:
                if self._owns_process_groups:
                    try:
                        self._release_process_groups(ok)
                    except Exception as exc:
                        if ok:
                            raise
                        print(f"shutdown: releasing the process groups failed: {exc!r}", file=sys.stderr, flush=True)

    def _release_process_groups(self, ok: bool) -> None:
        self._owns_process_groups = False
        if not dist.is_initialized():
            return
        rank = dist.get_rank()
        try:
            if ok:  # no rank tears a group down while another still talks over it (a lost rank: LostRankError)
                guard_collectives(dist.barrier, self._timeout_minutes)
        finally:
            # First the reference cycles among the trainer's parts (a CUDA graph that captured NCCL collectives
            # holds its communicator, which NCCL's destroy waits for), then every group: sub-groups newest first,
            # the default group last (torch's order for the world). The second collection drops the groups' last
            # references, and their backends' destructors join the backends' threads, here and not at interpreter
            # exit.
            gc.collect()
            dist.destroy_process_group()
            gc.collect()
            self.stopped.append("process groups")
            self._report_alive(rank)

    def _report_alive(self, rank: int) -> None:
        """One line naming every watched group still referenced and the chain of objects that holds it."""
        groups = [watched.group() for watched in self._watched]
        alive = [(watched, index) for index, watched in enumerate(self._watched) if groups[index] is not None]
        if not alive:
            return
        described = []
        for watched, index in alive:
            try:
                holders = holder_chain(groups[index], skip=[groups])
            except Exception as exc:  # the warning still comes out
                holders = f"? ({exc!r})"
            described.append(f"{watched.describe()} held by {holders}")
        groups.clear()
        self.log(
            f"> WARNING: rank {rank}: {len(alive)} process group(s) still referenced after their release: their"
            " threads outlive the run and may abort the process at exit: " + "; ".join(described)
        )


def _torch_name(group: dist.ProcessGroup) -> str:
    if group is dist.group.WORLD:
        return "world"
    return f"group {getattr(group, 'group_name', '?')}"


def _ranks(group: dist.ProcessGroup) -> str:
    try:
        ranks = dist.get_process_group_ranks(group)
    except Exception:  # not a group of the default world: no ranks to show
        return "ranks ?"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ",".join(map(str, ranks[:8])) + (",..." if len(ranks) > 8 else "")


def forget_frames(exc: BaseException) -> None:
    """Drop the local variables of the finished frames that `exc` (and the exceptions it chains) carries in its
    traceback: they hold the trainer, and through it the process groups, until the exception is handled - after
    `Shutdown.close` wants them gone. The traceback still prints (file, line and code stay)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)  # skips the frames still running
        pending += [current.__cause__, current.__context__]
