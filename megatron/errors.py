"""Errors caused by the user's input (flags, files, checkpoints). `pretrain_gpt.py` and the tools print them as one
line naming the cause and the fix, without a traceback; anything else is a bug and keeps its traceback."""


class UserError(Exception):
    """Bad input: a wrong flag, a malformed file, a checkpoint of another shape. The message is one line."""


class TrainingAborted(Exception):
    """The run cannot go on (it diverged, a rank was lost, the checkpoint to resume from is missing).
    `pretrain_gpt.py` prints the one-line message and exits with `exit_code`, without a traceback and without
    saving."""

    exit_code = 1


class MissingCheckpointError(TrainingAborted):
    """--exit-on-missing-checkpoint and --load holds no checkpoint: exit status 1, as Megatron-LM's `sys.exit(1)`
    there, so that a job script tells a mistyped path from a run that started afresh."""

    exit_code = 1


class DivergenceError(TrainingAborted):
    """Too many non-finite steps in a row (--max-consecutive-skipped-iterations)."""

    exit_code = 3


class LostRankError(TrainingAborted):
    """A collective failed because another rank died or stopped answering."""

    exit_code = 4
