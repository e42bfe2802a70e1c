import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from autoshard.testing import launch  # noqa: E402

# every test plans afresh (a plan kept on disk by an earlier run would hide the planner's work);
# test_cache turns the cache on in a directory of its own. The ranks take this environment too
os.environ["AUTOSHARD_PLAN_CACHE"] = "off"

# the ranks of the suite's groups import these to run its cases: imported once, in the server
# they are forked from (launch.PRELOAD), rather than by every rank of every module's group
launch.PRELOAD += ["transformers", "models", "cases"]


def _local_world(n):
    from autoshard.testing.launch import LocalWorld
    # a collective waits up to 5 minutes: on a machine loaded several times over its cores a
    # rank can fall minutes behind its peers (the default 2 minutes ran out there, in a test that
    # takes 40 s on a quiet machine); a rank that fails still stops the others at once
    world = LocalWorld(n, timeout_s=300.0)
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
