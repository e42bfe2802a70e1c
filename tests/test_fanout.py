"""A mesh search shared out among forked copies of the planning process (planner.fanout) plans
exactly what it plans in one process, and loses nothing when a copy dies, hangs or raises."""
import os
import time

import pytest
import torch

import autoshard
from autoshard.planner import fanout, search
from autoshard.planner.solve import MemoryBudgetError, NoBetterPlan
from models import GPT

PARENT = os.getpid()
# 26 meshes searched: some pruned by their bound, some refined (a third of world 256's time)
WORLD = 64


def _gpt():
    with torch.device("meta"):
        model = GPT(vocab=1024, d=256, heads=4, layers=2, seq=128)
    idx = torch.zeros(512, 128, dtype=torch.long, device="meta")
    return model, (idx, idx)


class _Counted(fanout.Fanout):
    """A Fanout that remembers how many processes each search used and which asked what."""
    made: list = []
    asked: list = []

    def __init__(self, count, handlers):
        super().__init__(count, handlers)
        _Counted.made.append(self.count)

    def ask(self, owner, name, *args):
        _Counted.asked.append((owner, name, args))
        return super().ask(owner, name, *args)

    def share(self, name, jobs, first=None):
        got = super().share(name, jobs, first)
        _Counted.asked.extend((owner, name, job) for (owner, _), job in zip(got, jobs))
        return got


def _searched(monkeypatch, workers: int):
    monkeypatch.setenv(fanout.ENV, str(workers))
    monkeypatch.setattr(search, "FANOUT_AFTER", 0.0)   # share out however fast the one-axis plan came
    monkeypatch.setattr(search, "Fanout", _Counted)
    _Counted.made, _Counted.asked = [], []
    model, inputs = _gpt()
    plan = autoshard.plan(model, inputs, world=WORLD, verbose=False)
    return plan, list(_Counted.made), list(_Counted.asked)


@pytest.fixture(scope="module")
def alone():
    """The search's plan in one process."""
    with pytest.MonkeyPatch.context() as mp:
        plan, made, _ = _searched(mp, 1)
    assert made == [1, 1]   # nothing forked
    return plan


def _same(a, b):
    assert a.mesh_shape == b.mesh_shape and a.cost == b.cost
    assert a.mesh_candidates == b.mesh_candidates   # every mesh's bound, cost and status
    assert {n: (c.inputs, c.outputs) for n, c in a.nodes.items()} == \
           {n: (c.inputs, c.outputs) for n, c in b.nodes.items()}


def test_a_shared_search_plans_what_one_process_plans(monkeypatch, alone):
    sent = set()
    for workers in (2, 3):
        shared, made, asked = _searched(monkeypatch, workers)
        assert made == [1, workers]
        sent |= {name for owner, name, _ in asked if owner > 0}
        _same(shared, alone)
        # a mesh is solved by the process that bounded it, which keeps its program
        bounded_by = {mesh: owner for owner, name, job in asked if name == "bounds" for mesh in job[0]}
        solved = [(owner, args[0]) for owner, name, args in asked if name == "solve"]
        assert solved and all(owner == bounded_by[mesh] for owner, mesh in solved)
    assert sent >= {"bounds", "refine"}   # the copies bounded and refined meshes
    assert any(c["status"].startswith("refined") for c in alone.mesh_candidates)


def test_a_copy_that_dies_mid_search_loses_nothing(monkeypatch, alone, tmp_path):
    real = search.lower_bound
    calls = []
    died = tmp_path / "died"

    def dies_in_a_copy(graph, strategies, costs, *args, **kw):
        calls.append(costs.mesh_shape)
        if os.getpid() != PARENT:
            died.write_text(repr(costs.mesh_shape))
            os._exit(7)   # a copy killed while it bounds the first mesh it took
        return real(graph, strategies, costs, *args, **kw)

    monkeypatch.setattr(search, "lower_bound", dies_in_a_copy)
    shared, made, _ = _searched(monkeypatch, 2)
    assert made == [1, 2]
    assert eval(died.read_text()) in calls   # bounded here, once the copy was gone
    _same(shared, alone)


def test_shared_jobs_go_to_whichever_process_is_free():
    with fanout.Fanout(3, HANDLERS) as fan:
        # the first two jobs keep two processes a while; the others take the quick ones meanwhile
        got = fan.share("nap", [(1.0,), (1.0,)] + [(0.0,)] * 10)
        assert [fan.answer(t) for _, t in got] == [1.0, 1.0] + [0.0] * 10
        owners = [o for o, _ in got]
        assert owners[0] != owners[1] and set(owners) == {0, 1, 2}
        assert owners[2:].count(owners[0]) + owners[2:].count(owners[1]) < owners[2:].count(3 - owners[0] - owners[1])
        # a copy that dies holding a job: it is done here
        got = fan.share("dies_late_here", [(i,) for i in range(6)])
        assert [fan.answer(t) for _, t in got] == [-i for i in range(6)]
        assert None in fan.copies


def test_a_share_runs_this_processs_first_work_once_the_copies_have_their_jobs_and_its_copies_are_reaped():
    ran = []
    with fanout.Fanout(2, HANDLERS) as fan:
        pids = [c[1] for c in fan.copies]
        # the copy takes the long job while this process does its own first
        got = fan.share("nap", [(0.5,)] + [(0.0,)] * 4, first=lambda: ran.append((os.getpid(), time.sleep(0.3))))
        assert [fan.answer(t) for _, t in got] == [0.5] + [0.0] * 4
        assert got[0][0] == 1 and ran == [(PARENT, None)]
    # told to end, not waited for: reaped by the next Fanout or here, none left a zombie
    fanout.reap(wait=True)
    assert not [pid for pid, _ in fanout._ending if pid in pids]
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_a_copy_killed_holding_the_jobs_lock_stops_no_share(monkeypatch):
    monkeypatch.setattr(fanout.Fanout, "STALL", 1.0)
    with fanout.Fanout(2, HANDLERS) as fan:
        pid = os.fork()
        if pid == 0:   # a process that dies holding the lock, as a copy killed inside _take would
            fan._batch.get_lock().acquire()
            os._exit(0)
        os.waitpid(pid, 0)
        start = time.perf_counter()
        got = fan.share("square", [(i,) for i in range(5)])
        assert [fan.answer(t) for _, t in got] == [i * i for i in range(5)]
        assert all(owner == 0 for owner, _ in got) and fan.copies == [None]
        assert time.perf_counter() - start < 30


def _plan_in_a_rank(workers: int):
    """A mesh search in a rank of a gloo group (a daemonic process, whose gloo threads run)."""
    os.environ[fanout.ENV] = str(workers)
    search.FANOUT_AFTER = 0.0
    made = []

    class Counted(fanout.Fanout):
        def __init__(self, count, handlers):
            super().__init__(count, handlers)
            made.append(self.count)

    search.Fanout = Counted
    model, inputs = _gpt()
    plan = autoshard.plan(model, inputs, world=WORLD, verbose=False)
    return plan.mesh_shape, plan.cost, plan.mesh_candidates, made


def test_a_rank_of_a_process_group_shares_its_search_out_too(world2, alone):
    # multiprocessing forbids a daemonic process (launch.LocalWorld's ranks) children of its own:
    # the copies are forked by os.fork, and plan what one process plans
    for mesh, cost, candidates, made in world2.run(_plan_in_a_rank, 2):
        assert made == [1, 2]
        assert (mesh, cost, candidates) == (alone.mesh_shape, alone.cost, alone.mesh_candidates)


def _square(x):
    return x * x


def _nap(seconds):
    time.sleep(seconds)
    return seconds


def _dies(x):
    if os.getpid() != PARENT:
        os._exit(3)
    return -x


def _dies_late_here(x):
    if os.getpid() == PARENT and x == 0:
        time.sleep(0.3)   # the copies take the next jobs meanwhile
    return _dies(x)


def _hangs(x):
    if os.getpid() != PARENT:
        time.sleep(600)
    return x + 1


def _no_better(proven):
    raise NoBetterPlan(proven)


def _over_budget():
    raise MemoryBudgetError("needs 81.00 GB per rank, over the budget of 80.00 GB")


class _Unpicklable(Exception):
    def __init__(self, a, b):   # pickling passes one argument back: unpickling fails
        super().__init__(f"{a} {b}")


def _odd():
    raise _Unpicklable(1, 2)


HANDLERS = {"nap": _nap, "square": _square, "dies": _dies, "dies_late_here": _dies_late_here, "hangs": _hangs,
            "no_better": _no_better, "over_budget": _over_budget, "odd": _odd}


def test_answers_come_back_in_order_from_every_copy():
    with fanout.Fanout(3, HANDLERS) as fan:
        assert fan.count == 3
        tickets = [fan.ask(i % 3, "square", i) for i in range(12)]
        assert [fan.answer(t) for t in reversed(tickets)] == [i * i for i in reversed(range(12))]
        assert all(c is not None for c in fan.copies)


def test_what_a_copy_raises_is_raised_here():
    with fanout.Fanout(2, HANDLERS) as fan:
        for proven in (True, False):
            with pytest.raises(NoBetterPlan) as e:
                fan.answer(fan.ask(1, "no_better", proven))
            assert e.value.proven is proven
        with pytest.raises(MemoryBudgetError, match="over the budget of 80.00 GB"):
            fan.answer(fan.ask(1, "over_budget"))
        with pytest.raises(fanout.CopyFailed, match="_Unpicklable: 1 2"):
            fan.answer(fan.ask(1, "odd"))
        assert fan.answer(fan.ask(1, "square", 5)) == 25   # the copy lives on


def test_a_dead_or_hung_copy_is_replaced_by_this_process(monkeypatch):
    with fanout.Fanout(2, HANDLERS) as fan:
        first, second = fan.ask(1, "dies", 4), fan.ask(1, "square", 6)
        assert fan.answer(second) == 36 and fan.answer(first) == -4   # both done here
        assert fan.copies == [None]
        assert fan.answer(fan.ask(1, "square", 7)) == 49
    monkeypatch.setattr(fanout.Fanout, "STALL", 1.0)   # a copy asleep uses no CPU
    with fanout.Fanout(2, HANDLERS) as fan:
        start = time.perf_counter()
        assert fan.answer(fan.ask(1, "hangs", 1)) == 2
        assert time.perf_counter() - start < 30 and fan.copies == [None]


def test_the_number_of_processes_is_the_users_to_set(monkeypatch):
    monkeypatch.setenv(fanout.ENV, "1")
    assert fanout.available() == 1
    monkeypatch.setenv(fanout.ENV, "64")
    assert fanout.available() == fanout.MAX_WORKERS
    for bad in ("0", "two"):
        monkeypatch.setenv(fanout.ENV, bad)
        with pytest.raises(ValueError, match=fanout.ENV):
            fanout.available()
    monkeypatch.delenv(fanout.ENV)
    alone = fanout.available()
    assert 1 <= alone <= fanout.MAX_WORKERS
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1024")   # torchrun's ranks of one node share its cores
    assert fanout.available() == 1
