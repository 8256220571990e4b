"""Shared pytest fixtures: one LocalGroup per world size for the whole session, rebuilt only if a case broke it."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from utils import LocalGroup  # noqa: E402


@pytest.fixture(scope="session")
def local_group():
    """``local_group(n)`` gives a live N-process gloo group; the same one across tests and parametrized cases."""
    groups: dict[int, LocalGroup] = {}

    def get(world_size: int) -> LocalGroup:
        group = groups.get(world_size)
        if group is None or group.closed:
            group = groups[world_size] = LocalGroup(world_size)
        return group

    yield get
    for group in groups.values():
        group.close()
