"""The data pipeline's user errors: one line naming the file or flag at fault and the fix."""

from megatron.errors import UserError


class DataError(UserError, ValueError):
    """Bad data input: a missing, corrupt or mismatched dataset file, a bad tokenizer file, a split too small."""
