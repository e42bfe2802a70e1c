import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _local_world(n):
    from autoshard.launch import LocalWorld
    world = LocalWorld(n)
    yield world
    world.close()


@pytest.fixture(scope="module")
def world2():
    """A gloo group of 2 ranks, kept up for the module's tests (a module may define its own)."""
    yield from _local_world(2)


@pytest.fixture(scope="module")
def world4():
    """A gloo group of 4 ranks, kept up for the module's tests (a module may define its own)."""
    yield from _local_world(4)
