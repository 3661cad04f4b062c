"""Fixtures of the unit tests."""

import pytest

from tests.dist_utils import one_rank_world as _one_rank_world


@pytest.fixture
def one_rank_world(tmp_path):
    """torch.distributed started in this process alone (gloo, rank 0 of 1) for the test."""
    with _one_rank_world(str(tmp_path)):
        yield
