"""examples/pretrain_llama3_8b_2nodes.sbatch, run by bash with stand-ins for srun, scontrol and python: the script
parses, each node's torchrun gets the launch variables of a two-node job (the first node as rank 0's address, the
node's own rank), and the pretrain_gpt.py flags are valid for 16 processes and give the llama3-8b preset's model."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from megatron.config import parse_args
from megatron.perf.rows import COMMON, PRESETS
from tests.assets.scripts import ROOT

SCRIPT = ROOT / "examples" / "pretrain_llama3_8b_2nodes.sbatch"
STAND_INS = {
    "scontrol": 'printf "gpu-a\\ngpu-b\\n"',  # `scontrol show hostnames gpu-[a,b]`
    # one task per node, as `srun --ntasks-per-node=1` starts them: the options dropped, the command run per node
    "srun": 'while [[ $1 == --* ]]; do shift; done; for n in 0 1; do SLURM_NODEID=$n "$@" || exit; done',
    "python": 'printf "%s\\0" "$@" > "$LAUNCHED/node$SLURM_NODEID"',  # what torchrun would get
}


def launch(tmp_path: Path) -> dict[int, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHON=str(bin_dir / "python"),
        LAUNCHED=str(tmp_path),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="gpu-[a,b]",
        SLURM_JOB_NAME="llama3-8b-2nodes",
        SLURM_SUBMIT_DIR=str(ROOT),
    )
    subprocess.run(["bash", str(SCRIPT), "--log-interval", "1"], env=env, check=True, capture_output=True, timeout=60)
    return {n: (tmp_path / f"node{n}").read_text().split("\0")[:-1] for n in (0, 1)}


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_each_node_launches_torchrun_with_the_two_node_variables_and_valid_flags(tmp_path: Path):
    argv = launch(tmp_path)
    pretrain = str(ROOT / "pretrain_gpt.py")
    for node, args in argv.items():
        at = args.index(pretrain)
        assert args[:at] == [
            "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "8", "--node-rank", str(node),
            "--master-addr", "gpu-a", "--master-port", str(20000 + 4242),
        ]  # fmt: skip
        assert args[at + 1 :] == argv[0][argv[0].index(pretrain) + 1 :]
    flags = argv[0][argv[0].index(pretrain) + 1 :]
    assert flags[-2:] == ["--log-interval", "1"]  # the submitter's flags come last and win
    # Transformer Engine's layers parse only where TE imports (a GPU): checked with the local ones
    local = ["local" if flag == "transformer_engine" else flag for flag in flags]
    cfg = parse_args(local, world_size=16)
    assert cfg.data_parallel_size == 16 and cfg.sharding.fsdp2 and cfg.training.global_batch_size == 128
    assert cfg.logging.log_interval == 1 and cfg.precision.fp8_param_gather
    preset = parse_args(f"{COMMON} {PRESETS['llama3-8b']}".split())
    assert cfg.model == preset.model.__class__(**{**vars(preset.model), "transformer_impl": "local"})
