"""Run a function on N gloo ranks (CPU processes), or N NCCL ranks with one GPU each. Several checks per run: each
run costs a process group's start and every rank's first-use setup.

    def _body(rank, world_size, tmp):   # runs in every rank, torch.distributed already initialized
        ...
    run_distributed(_body, world_size=2, args=(tmp,))

The rendezvous is a FileStore in a fresh temporary directory, so parallel test runs never clash on a port.
An exception in any rank fails the test with that rank's traceback.

Gloo ranks are forked from multiprocessing's fork server, which imports PRELOAD once per test session (at the first
run): a spawned rank spent 2-3 s of CPU importing torch and the project, close to half of tests/distributed's CPU
time. Each rank still starts from freshly imported modules (nothing the test process did reaches it),
with the test's environment, stdout and stderr, as a spawned rank does. NCCL ranks are spawned.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import multiprocessing
import os
import tempfile
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing import reduction

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What a rank's first run imports anyway (torch._dynamo: FSDP2's first call; pytest: the test modules), then the
# freeze of what they loaded (tests/assets/frozen_preload.py)
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "pytest",
    "megatron.training",
    "tests.assets.frozen_preload",
]
multiprocessing.set_forkserver_preload(PRELOAD)


class _Inherited:
    """A file descriptor of the test process, handed to a rank as it starts: a forked rank would otherwise write to
    the fork server's stdout and stderr (those of the test that started it), not to this test's captured ones."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)  # pickled while the rank starts: sent with it


def _detach(dup) -> int:
    return dup.detach()


def _entry(
    rank: int,
    fn: Callable,
    world_size: int,
    store_path: str,
    error_dir: str,
    args: tuple,
    backend: str,
    env: dict[str, str],
    outputs: tuple[int, int],
) -> None:
    os.environ.clear()  # the test's environment at this run, not the fork server's at its start
    os.environ.update(env)
    for fd, target in zip(outputs, (1, 2)):
        if fd != target:  # a spawned rank has the test's own descriptors
            os.dup2(fd, target)
            os.close(fd)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    device = None
    if backend == "nccl":  # the trainer picks its GPU from LOCAL_RANK; NCCL needs it set before the group starts
        # A hang outside a collective (those time out below) would otherwise end silently at the caller's timeout:
        # print every rank's stack and exit after this long (seconds; the environment may shorten it).
        faulthandler.dump_traceback_later(float(os.environ.get("DIST_TEST_HANG_DUMP_S", 480)), exit=True)
        os.environ["LOCAL_RANK"] = str(rank)
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    # A rank that fails leaves the others waiting in a collective: time out in minutes, not NCCL's default ten.
    timeout = timedelta(minutes=2)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, device_id=device, timeout=timeout)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        with open(os.path.join(error_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        # CUDA graphs that captured NCCL collectives (--cuda-graph-impl) hold their communicators: NCCL's destroy
        # waits for those graphs, which reference cycles (layer -> graphed forward -> layer) would keep alive.
        gc.collect()
        dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, args: tuple = (), backend: str = "gloo") -> None:
    """Spawn `world_size` processes running fn(rank, world_size, *args) under a gloo (or NCCL: rank r on GPU r)
    process group."""
    with tempfile.TemporaryDirectory() as tmp:
        store_path, error_dir = os.path.join(tmp, "store"), os.path.join(tmp, "errors")
        os.makedirs(error_dir)
        try:
            outputs = (_Inherited(1), _Inherited(2))
            mp.start_processes(
                _entry,
                args=(fn, world_size, store_path, error_dir, args, backend, dict(os.environ), outputs),
                nprocs=world_size,
                start_method="forkserver" if backend == "gloo" else "spawn",
            )
        except Exception as exc:
            reports = [open(os.path.join(error_dir, f)).read() for f in sorted(os.listdir(error_dir))]
            raise AssertionError("distributed test failed:\n" + "\n".join(reports)) from exc


@contextlib.contextmanager
def one_rank_world(store_dir: str, backend: str = "gloo", device: torch.device | None = None) -> Iterator[None]:
    """A world of this process alone (rank 0 of 1) for the block; destroyed after it unless the block did."""
    store = dist.FileStore(os.path.join(store_dir, "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, device_id=device, timeout=timedelta(minutes=2))
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
