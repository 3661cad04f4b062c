"""Errors caused by the user's input (flags, files, checkpoints). `pretrain_gpt.py` and the tools print them as one
line naming the cause and the fix, without a traceback; anything else is a bug and keeps its traceback."""


class UserError(Exception):
    """Bad input: a wrong flag, a malformed file, a checkpoint of another shape. The message is one line."""
