"""Pretrain a GPT model. Megatron-LM compatible flags; `--help` lists them.

python pretrain_gpt.py --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 ...
torchrun --nproc-per-node 8 pretrain_gpt.py ...
"""

from __future__ import annotations

import sys
import time

import torch

from megatron.checkpoint.safe_load import trust_checkpoints
from megatron.config import parse_args
from megatron.errors import TrainingAborted, UserError
from megatron.parallel import world_size_from_env
from megatron.parallel.launch import rank as launcher_rank
from megatron.training import pretrain

QUIET_RANK_EXIT_DELAY_S = 5.0
"""How long a rank other than 0 waits before exiting on a flag error (rank 0 prints it and exits at once)."""


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(
            sys.argv[1:] if argv is None else argv,
            world_size=world_size_from_env(),
            device_type="cuda" if torch.cuda.is_available() else "cpu",
        )
    except UserError as exc:  # every rank parses the same flags: the first one says it, the others exit alike
        if launcher_rank() == 0:
            print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr)
        else:  # torchrun stops every rank once one exits: rank 0 exits first, having said why
            time.sleep(QUIET_RANK_EXIT_DELAY_S)
        return 2
    try:
        trust_checkpoints(cfg.checkpoint.trust_checkpoint)
        pretrain(cfg)
    except UserError as exc:
        print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr)
        return 2
    except TrainingAborted as exc:  # diverged, a rank lost: nothing was saved
        print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
