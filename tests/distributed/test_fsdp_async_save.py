"""--async-save under FSDP (2 gloo ranks): each rank's shards are staged to host memory at the save and written in
the background (megatron/checkpoint/dist.py, the stager of the distributed optimizer's checkpoints), and the
checkpoint resumes exactly under FSDP and, within the same tolerances as a synchronous save, under the distributed
optimizer: fp32 shards, and bf16 shards with O2's states and FP8 all-gathers (whose shards a training forward frees
until the optimizer step gives them back, before any save)."""

from tests.dist_utils import run_distributed
from tests.distributed.test_fsdp import PA, resume_across
from tests.distributed.test_parallel_layouts import FP8


def _body(rank, world_size, out_dir):
    resume_across("", f"{out_dir}/fp32", world_size, save_flags="--async-save")
    o2_fp8 = f"--bf16 {PA} {FP8} --fp8-param-gather"
    resume_across(o2_fp8, f"{out_dir}/o2_fp8", world_size, save_flags="--async-save", rel=1e-3)


def test_fsdp_async_save_resumes_exactly(tmp_path):
    run_distributed(_body, world_size=2, args=(str(tmp_path),))
