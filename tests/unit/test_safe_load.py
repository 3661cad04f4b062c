"""megatron/checkpoint/safe_load.py's parts: the one-line guard, torch's refusal names, the trust flag, the DCP
index reader's shape check."""

import os
import pickle

import pytest
import torch

from megatron.checkpoint.safe_load import TRUST_ENV, SafeReader, _canonical, malformed, trust_checkpoints, trusted
from megatron.errors import UserError


def test_malformed_contents_become_one_line_and_other_failures_pass():
    with pytest.raises(UserError, match=r"^f\.pt is malformed \(KeyError: 'layout'\)") as info:
        with malformed("f.pt"):
            {}["layout"]
    assert "\n" not in str(info.value)
    with pytest.raises(torch.OutOfMemoryError):  # no fault of the file: keeps its own type (and traceback)
        with malformed("f.pt"):
            raise torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(NameError):  # a bug of ours is no malformed file
        with malformed("f.pt"):
            raise NameError("undefined")


def test_torch_refusals_are_named_as_today():
    assert _canonical("eval") == "builtins.eval"
    assert _canonical("commands.call") == "subprocess.call"
    assert _canonical("__builtin__.set") == "builtins.set"
    assert _canonical("posix.system") == "posix.system"


def test_the_trust_flag_is_a_documented_flag_that_sets_trust_for_the_process(monkeypatch):
    from megatron.config import parse_args

    monkeypatch.delenv(TRUST_ENV, raising=False)
    assert not parse_args("--mock-data --vocab-size 64".split()).checkpoint.trust_checkpoint
    trust_checkpoints(False)
    assert not trusted()
    assert parse_args("--mock-data --vocab-size 64 --trust-checkpoint".split()).checkpoint.trust_checkpoint
    trust_checkpoints(True)
    assert trusted() and os.environ[TRUST_ENV] == "1"


def test_an_index_that_is_not_dcps_is_refused(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(ValueError, match="holds a dict, not DCP's index"):
        SafeReader(str(tmp_path)).read_metadata()
