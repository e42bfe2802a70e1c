"""Mesh search: how ``world`` devices factor into mesh axes, chosen outside the ILP (DESIGN.md
section 5).

Every ordered factorization of ``world`` into at most 4 axes of 2 or more devices is a candidate;
the order matters, since the last axis is innermost on the hardware (the cluster maps it onto the
fastest links). The search runs in two phases:

1. Meshes of one and two axes, exactly. Each gets a lower bound, the LP relaxation of its
   integer program; they are solved best bound first, and one whose bound is no better than the
   best plan found is pruned without solving. The bound is first a quick one (the cheap ops'
   recomputation bounded by its floor, ``lower_bound(quick=True)``), raised to the exact one only
   for a mesh it does not prune. The two-axis meshes are shared out among the processes
   (``planner.fanout``), the lopsided ones first: theirs are the largest programs. The one-axis
   mesh is bounded and solved first, so
   that each two-axis mesh can be bounded by a coarse program first (planner.coarse, its layouts
   only whole or not whole, a fraction of its own), and pruned there when even that shows it
   cannot beat the one-axis plan: the tiny models whose best plan keeps activations whole on
   every mesh, whose two-axis programs are never priced. Only where the one-axis mesh's own
   coarse bound reaches its plan (``_coarse_pays``): elsewhere no coarse bound prunes.
2. Refinement, up to 4 axes. Each axis of the best two-axis mesh is split in two in every way
   ((64, 4) -> (8, 8, 4), (64, 2, 2), ...); its plan lifts onto each refinement exactly and
   improves there by one-axis descent (planner.descend). The best refinement becomes the mesh to
   refine next, while refining still pays. When no two-axis mesh beats the best one-axis plan by
   more than ``TIE`` (by its plan or its lower bound), splitting an axis did not pay and
   refinement is not tried at all: the tiny models whose every mesh ties at replicated compute's cost.

The simplest mesh among equals wins: of the meshes whose plans come within ``TIE`` of the
cheapest, the one with the fewest axes, then the one whose largest axis stays inside a node (the
cluster's ``gpus_per_node``), then the cheapest. ``plan.solver["mesh_choice"]`` says why. A mesh
with fewer axes than the best so far is solved, not pruned, while its bound is within the tie.

Three- and four-axis meshes have too many layouts to bound or solve whole in seconds, so a mesh
that refines none of the chosen meshes is not tried; its entry in ``plan.mesh_candidates`` says
so. When the pins name three or four axes, phase 1 has nothing to solve: every mesh of that many
axes descends from the pins' own layout.

In the code: ``MeshSearch.run`` takes the steps in order; each mesh is a ``Candidate`` whose
``Status`` says what became of it, kept in ``plan.mesh_candidates`` as a dict with the status in
words (``Candidate.as_dict``).
"""
from __future__ import annotations

import dataclasses
import enum
import math
import time
import warnings
from typing import Optional

from autoshard.passes.annotate import annotate
from autoshard.planner.coarse import coarse_bound
from autoshard.planner.axonn_start import descend_from_pins
from autoshard.planner.descend import EXACT_AXES, lift, solve_mesh, unsplit
from autoshard.planner.fanout import Fanout, available
from autoshard.planner.progress import Progress, uncollected
from autoshard.cost.price import Costs
from autoshard.planner.solve import GAP_LIMIT, MemoryBudgetError, NoBetterPlan, lower_bound, solve
from autoshard.planner.make import make_plan, plan_cost

MAX_SEARCH_AXES = 4
TIE = 1e-3   # meshes whose estimated steps differ by less than this share are equals: the simpler wins
# CP-SAT's deterministic seconds for a mesh whose LP support did not prove its plan: a few wall
# seconds on one core; GPT 96 layers at (512, 2), whose budget-bound program CP-SAT cannot
# close in minutes, is dropped after it
EFFORT = 5.0
# refinements carried into the next round: descent is greedy, and the second best of a round may
# refine into the best (a 7.3B GPT block at 256: (8, 16, 2) -> (8, 8, 2, 2), past (8, 2, 16)'s best)
BEAM = 2
# seconds the search runs in one process before it shares its two-axis meshes out among forked
# copies (planner.fanout): a copy takes tens of milliseconds to start, and the tiny models that
# plan in a second would only pay for it
FANOUT_AFTER = 0.1


def factorizations(world: int, max_axes: int) -> list:
    """Ordered factorizations of ``world`` into 1..max_axes factors of at least 2 ((world,) first)."""
    out = [(world,)]

    def extend(prefix, rest, left):
        if left == 0:
            return
        for f in range(2, rest + 1):
            if rest % f == 0:
                if rest // f == 1:
                    if len(prefix) >= 1:
                        out.append(prefix + (f,))
                else:
                    extend(prefix + (f,), rest // f, left - 1)

    extend((), world, max_axes)
    return sorted(set(out), key=lambda m: (len(m), m))


def splits(mesh: tuple) -> list:
    """(finer mesh, groups): each axis of ``mesh`` split into two ordered factors, one at a time."""
    out = []
    for i, n in enumerate(mesh):
        for f in range(2, n // 2 + 1):
            if n % f == 0:
                fine = mesh[:i] + (f, n // f) + mesh[i + 1:]
                out.append((fine, tuple(2 if j == i else 1 for j in range(len(mesh)))))
    return out


class Status(enum.Enum):
    """What became of a candidate mesh, as far as the search took it; its value is its words in
    ``plan.mesh_candidates`` (``Candidate.text`` fills them in)."""
    NOT_TRIED = "not tried: refines none of the meshes chosen so far"
    NOT_WORTH_TRYING = "not tried: no two-axis mesh beat the one-axis plan by more than {tie:g}%"
    PINS_OTHER_AXES = "pins name another number of axes"
    PINS_CANNOT_HOLD = "pins cannot hold: {detail}"   # detail: the first words of the pins' error
    BOUNDED = "bounded"   # its quick bound priced, its program not solved yet
    NO_FIT = "does not fit in memory"
    COARSE_BOUNDED_OUT = "pruned: its coarse bound is no better than the best plan's (within {tie:g}%)"
    BOUNDED_OUT = "pruned: its lower bound is no better than the best plan's (within {tie:g}%)"
    NO_BETTER_PLAN = "pruned: no plan on it beats the best plan's by {tie:g}% (proven)"
    TIMED_OUT = ("pruned: no plan on it beats the best plan's by {tie:g}% "
                 "(none found in {effort:g} deterministic s)")
    SOLVED = "solved"   # its whole program: within GAP_LIMIT of its bound, but where the time limit stopped it
    SOLVED_UNPROVEN = "solved ({gap:.2f}% from its bound)"   # by its LP's support, beyond GAP_LIMIT
    SOLVED_AFTER_EFFORT = "solved ({gap:.2f}% from its bound after {effort:g} deterministic s)"
    REFINED = "refined ({detail})"   # a descent's local optimum (planner.descend); detail: how it ended
    CHOSEN = "chosen"   # the shortest estimated step
    CHOSEN_SIMPLER = "chosen: {detail}"   # within TIE of the shortest, and simpler (``_simplest``); detail: why

    @property
    def pruned(self) -> bool:
        """Whether the search let the mesh go without a plan: it could not beat the best one."""
        return self in (Status.COARSE_BOUNDED_OUT, Status.BOUNDED_OUT, Status.NO_BETTER_PLAN, Status.TIMED_OUT)


class Note(enum.Enum):
    """What a later attempt at a mesh already planned adds to its status's words."""
    NO_BETTER_IN_EFFORT = "; no better plan in {effort:g} deterministic s"
    WHOLE_SOLVE_NO_BETTER = "; the whole solve found no better plan"
    FROM_AXONN = ", descended from AxoNN's layout"


@dataclasses.dataclass
class Candidate:
    """A candidate mesh: its lower bound and its plan's estimated step (seconds) once known, and
    what became of it. Forked copies of the search send it back as it is (planner.fanout);
    ``plan.mesh_candidates`` keeps it as a dict (``as_dict``)."""
    mesh: tuple
    bound: Optional[float] = None
    cost: Optional[float] = None
    status: Status = Status.NOT_TRIED
    detail: str = ""              # the words the status takes from elsewhere: PINS_CANNOT_HOLD, REFINED, CHOSEN_SIMPLER
    gap: Optional[float] = None   # its plan's distance from its bound, a fraction: SOLVED_UNPROVEN, SOLVED_AFTER_EFFORT
    notes: tuple = ()             # Note, in the order added

    def becomes(self, status: Status, detail: str = "", gap: Optional[float] = None) -> None:
        """A new status, its words its own: the old one's detail, gap and notes go with it."""
        self.status, self.detail, self.gap, self.notes = status, detail, gap, ()

    def note(self, note: Note) -> None:
        self.notes += (note,)

    @property
    def proven(self) -> bool:
        """Whether its plan is a whole solve's (``Status.SOLVED``, nothing noted since), not a
        descent's local optimum: a refinement of it skips the axes not split first."""
        return self.status is Status.SOLVED and not self.notes

    def text(self) -> str:
        """Its status in words, as ``plan.mesh_candidates`` shows it."""
        words = self.status.value.format(detail=self.detail, tie=100 * TIE, effort=EFFORT,
                                         gap=None if self.gap is None else 100 * self.gap)
        return words + "".join(n.value.format(effort=EFFORT) for n in self.notes)

    def as_dict(self) -> dict:
        return {"mesh": list(self.mesh), "bound": self.bound, "cost": self.cost, "status": self.text()}


class _Candidates:
    """Every candidate mesh (``Candidate``) and its annotated work."""

    def __init__(self, graph, world, cluster, pins_for, training, bucket_bytes, max_axes, reshard=False,
                 recompute="none", inputs="whole"):
        self.graph, self.cluster, self.training, self.bucket_bytes = graph, cluster, training, bucket_bytes
        self.reshard, self.recompute, self.inputs = reshard, recompute, inputs
        self.pins_for = pins_for
        self.entries = {m: Candidate(m) for m in factorizations(world, max_axes)}
        self.works: dict = {}   # mesh -> (strategies, costs), made by ``work`` in this process
        self.pin_errors, self.warned = [], {}
        self.worked = []   # the meshes whose work was made, in any process, in the search's order

    def _twinnable(self, mesh) -> bool:
        return not (self.cluster.collectives or math.prod(mesh) > self.cluster.gpus_per_node or self.pins_for(mesh))

    def twin_key(self, mesh):
        """What the meshes that may be one another's ``twin`` share: their axes' sizes, sorted."""
        return tuple(sorted(mesh)) if self._twinnable(mesh) else mesh

    def twin(self, mesh):
        """A mesh bounded already whose program is this one's with its axes in another order,
        or None. Inside one node, on links not measured per group shape, every group of the
        same size talks over the same links, so (2, 4) and (4, 2) price every layout alike; pins
        name axes, so a mesh with pins has no twin."""
        if not self._twinnable(mesh):
            return None
        return next((m for m, e in self.entries.items() if m != mesh and sorted(m) == sorted(mesh)
                     and e.bound is not None), None)

    def work(self, mesh):
        """(strategies, costs) of the mesh, or None when the pins do not fit it."""
        if mesh in self.works:
            return self.works[mesh]
        pins = self.pins_for(mesh)
        if pins is None:
            self.entries[mesh].becomes(Status.PINS_OTHER_AXES)
            return None
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                strategies = annotate(self.graph, mesh, pins)
            for w in caught:   # once per search, not once per mesh
                self.warned.setdefault(str(w.message), w)
        except ValueError as e:
            self.entries[mesh].becomes(Status.PINS_CANNOT_HOLD, str(e).split(':')[0])
            self.pin_errors.append(e)
            return None
        costs = Costs(self.graph, mesh, self.cluster, self.training, self.bucket_bytes, self.reshard,
                      recompute=self.recompute, inputs=self.inputs)   # planner.recompute; autoshard.inputs
        self.works[mesh] = (strategies, costs)
        return self.works[mesh]


def simpler(a: tuple, b: tuple, cluster) -> bool:
    """Whether mesh ``a`` is simpler than ``b``: fewer axes, then its largest axis within a node
    where ``b``'s is not."""
    if len(a) != len(b):
        return len(a) < len(b)
    node = cluster.gpus_per_node
    return max(a) <= node < max(b)


def _simplest(results: list, cluster):
    """The result to choose among (plan, mesh, ...) results: of those within ``TIE`` of the
    cheapest estimated step, the simplest mesh (``simpler``), then the cheapest; and why, in
    words (None when the cheapest is chosen anyway)."""
    cheapest = min(results, key=lambda r: r[0].cost)
    near = [r for r in results if r[0].cost <= cheapest[0].cost * (1 + TIE)]
    best = cheapest
    for r in near:
        if simpler(r[1], best[1], cluster) or (not simpler(best[1], r[1], cluster) and r[0].cost < best[0].cost):
            best = r
    if best is cheapest:
        return best, None
    why = "fewer axes" if len(best[1]) < len(cheapest[1]) else "its largest axis within a node"
    return best, (f"{best[1]} chosen over {cheapest[1]}, whose estimated step is "
                  f"{100 * (1 - cheapest[0].cost / best[0].cost):.3f}% shorter (within {100 * TIE:g}%): {why}")


def search(graph, world: int, cluster, pins_for, training, time_limit, bucket_bytes, budget,
           max_axes: int = MAX_SEARCH_AXES, reshard: bool = False, recompute: str = "none", seed=None,
           inputs: str = "whole"):
    """The best plan over the candidate meshes; ``pins_for(mesh_shape)`` resolves the user's
    pins for a mesh (None: the pins do not fit that mesh). ``seed()``: (mesh, pins by node) of
    a layout to descend from as well (``planner.axonn_start``), or None."""
    with uncollected():
        return MeshSearch(graph, world, cluster, pins_for, training, time_limit, bucket_bytes, budget, max_axes,
                          reshard, recompute, seed, inputs).run()


class MeshSearch:
    """One search's state, and its steps; ``run`` takes them in order.

    ``bound`` (``bound_all``), ``raise_bound``, ``solve`` and ``refine`` run in the process that
    owns the mesh (``planner.fanout``; ``owner``), a forked copy or this one, and ``axonn_seed``
    in a copy where there is one; they send back what they found. The other steps run in the
    planning process, which takes those answers in its own order."""

    def __init__(self, graph, world, cluster, pins_for, training, time_limit, bucket_bytes, budget, max_axes,
                 reshard, recompute, seed, inputs="whole"):
        self.start = time.perf_counter()
        self.graph, self.world, self.cluster, self.max_axes = graph, world, cluster, max_axes
        self.time_limit, self.budget, self.seed = time_limit, budget, seed
        self.cands = _Candidates(graph, world, cluster, pins_for, training, bucket_bytes, max_axes, reshard,
                                 recompute, inputs)
        self.progress = Progress(f"mesh search over {len(self.cands.entries)} meshes of {world} devices")
        self.errors: list = []    # the memory budget's errors met: the first is raised where no mesh has a plan
        self.results: list = []   # (plan, mesh, choice) of every mesh solved or refined
        self.owner: dict = {}     # mesh -> the process that bounds, solves or refines it (planner.fanout); 0: this one
        self.coarse_pays = True   # whether a two-axis mesh is bounded coarsely first (``_coarse_pays``)
        self.twin_of: dict = {}   # mesh -> the mesh whose bound it took, its axes reordered (``_Candidates.twin``)
        self.exact: set = set()   # the meshes whose bounds are not quick
        self.unproven: list = []  # the meshes the first round of solves left unproven
        self.small = [m for m in self.cands.entries if len(m) <= EXACT_AXES]   # phase 1's meshes
        self.fan = Fanout(1, {"bounds": self.bound_all, "raise": self.raise_bound, "solve": self.solve,
                              "refine": self.refine, "seed": self.axonn_seed})

    def run(self):
        """The search's spine: its chosen plan."""
        try:
            self.solve_exactly()   # phase 1
            frontier = self.first_frontier()
            # AxoNN's own best-ranked grid (descended from after the search), worked out by a copy
            seeded = self.fan.ask(1 if self.fan.count > 1 else 0, "seed")
            while frontier:   # phase 2
                frontier = self.refine_round(frontier)
            seeded = self.fan.answer(seeded)
        finally:
            self.fan.close()
        self.descend_from_seed(seeded)
        return self.choose()

    def report(self, step: str) -> None:
        done = sum(c.cost is not None or c.status.pruned or c.status is Status.NO_FIT
                   for c in self.cands.entries.values())
        best = min(self.results, key=lambda r: r[0].cost) if self.results else None
        self.progress.update(f"{step}; {done} of {len(self.cands.entries)} meshes done"
                             + (f", best {best[1]} {best[0].cost * 1e3:.3f} ms per step" if best else ""))

    # ---- phase 1: one and two axes, solved whole -----------------------------------------------

    def solve_exactly(self) -> None:
        """Phase 1: one and two axes, bounded and solved whole, best bound first: the one-axis
        mesh first, so that its plan can prune a two-axis mesh by its coarse bound; then the
        meshes the first round left unproven. The two-axis meshes are shared out among forked
        copies of this process (planner.fanout) once the one-axis mesh has taken long enough
        for the copies to pay."""
        entries = self.cands.entries
        for axes in range(1, EXACT_AXES + 1):
            meshes = [m for m in self.small if len(m) == axes]
            groups = len({self.cands.twin_key(m) for m in meshes})
            if axes == EXACT_AXES:
                self.coarse_pays = _coarse_pays(self.graph, self.cands, self.results)
            if axes > 1 and groups > 1 and time.perf_counter() - self.start > FANOUT_AFTER:
                self.fan = Fanout(min(available(), groups), self.fan.handlers)
            self.take_bounds(meshes)
            for mesh in sorted((m for m in meshes if entries[m].status is Status.BOUNDED),
                               key=lambda m: entries[m].bound):
                self.attempt(mesh, True)
        while self.unproven:
            # the meshes that only might win first, each for a plan that beats the best one's with
            # a bounded effort; the best last, solved whole: one of them may take its place (the
            # 96-layer GPT's (256, 4) did, once (512, 2) had been solved whole first, to gain 0.01%)
            lead = min(self.results, key=lambda r: r[0].cost)[1] if self.results else None
            mesh = next((m for m in self.unproven if m != lead), self.unproven[0])
            self.unproven.remove(mesh)
            self.attempt(mesh, False)

    def bound_all(self, meshes) -> list:
        """``bound`` of each mesh, in order (a job of ``take_bounds``)."""
        return [self.bound(m) for m in meshes]

    def bound(self, mesh):
        """The mesh's lower bound in its candidate: a mesh that refines the best plan's must beat
        it by TIE, and its coarse bound (planner.coarse, a fraction of the program) may say that
        it cannot before its own relaxation is priced and built. For the process that asked:
        the candidate, the twin whose bound it took (or None), whether its work was made, and
        the search's warnings and pin errors it added."""
        entry = self.cands.entries[mesh]
        warned, pin_errors = len(self.cands.warned), len(self.cands.pin_errors)
        work = self.cands.work(mesh)
        twin = self.cands.twin(mesh) if work is not None else None
        if twin:
            other = self.cands.entries[twin]
            entry.bound, entry.status, entry.detail, entry.gap, entry.notes = (
                other.bound, other.status, other.detail, other.gap, other.notes)
        elif work is not None:
            below = _to_beat(self.results, mesh, self.cluster) if self.coarse_pays else None
            if below is not None:
                entry.bound = coarse_bound(self.graph, *work)
                if entry.bound >= below * (1 - 1e-9):
                    entry.becomes(Status.COARSE_BOUNDED_OUT)
            if not entry.status.pruned:
                entry.bound = lower_bound(self.graph, *work, self.budget, quick=True)   # raised before a solve
                entry.becomes(Status.NO_FIT if math.isinf(entry.bound) else Status.BOUNDED)
        return (entry, twin, work is not None,
                [(w.message, w.category, w.filename, w.lineno) for w in list(self.cands.warned.values())[warned:]],
                self.cands.pin_errors[pin_errors:])

    def take_bounds(self, meshes) -> None:
        """Bound the meshes, each twin group (``_Candidates.twin_key``) in order by whichever
        process takes it first (``Fanout.share``), its owner from then on, and take in their
        candidates in order."""
        groups: dict = {}
        for mesh in meshes:
            groups.setdefault(self.cands.twin_key(mesh), []).append(mesh)
        # the lopsided meshes first: their programs are the largest (the 96-layer GPT's (2, 512)
        # and (512, 2): 0.6-0.9 s against 0.45-0.55 s), and the last jobs taken decide when the
        # processes all end
        order = sorted(groups.values(), key=lambda g: -max(g[0]) / min(g[0]))
        answers = {}
        for group, (who, ticket) in zip(order, self.fan.share("bounds", [(tuple(g),) for g in order])):
            answers.update(zip(group, self.fan.answer(ticket)))
            self.owner.update(dict.fromkeys(group, who))
        for mesh in meshes:
            self.take_bound(mesh, *answers[mesh])

    def take_bound(self, mesh, entry, twin, worked, warned, pin_errors) -> None:
        """One mesh's answer to ``bound``, taken in."""
        if self.owner.get(mesh, 0):   # bounded by a copy: its candidate, warnings and pin errors here too
            self.cands.entries[mesh] = entry
            for message, category, filename, lineno in warned:
                self.cands.warned.setdefault(str(message), warnings.WarningMessage(message, category, filename, lineno))
            self.cands.pin_errors.extend(pin_errors)
        if worked:
            self.cands.worked.append(mesh)
        self.twin_of[mesh] = twin or mesh
        status = self.cands.entries[mesh].status
        if status in (Status.PINS_OTHER_AXES, Status.PINS_CANNOT_HOLD):
            return
        self.report(f"bounded {mesh} (as {twin}, its axes reordered)" if twin else
                    f"pruned {mesh}" if status.pruned else f"bounded {mesh}")

    def raise_bound(self, mesh) -> float:
        """The mesh's bound, not quick (``lower_bound``): before it is solved."""
        return lower_bound(self.graph, *self.cands.work(mesh), self.budget)

    def take_exact_bound(self, mesh, below) -> None:
        """The mesh's exact bound in its candidate, where its quick one does not prune it (raised
        once per twin group by the owner of its first mesh, which keeps its relaxations)."""
        entry, source = self.cands.entries[mesh], self.twin_of.get(mesh, mesh)
        if below is not None and entry.bound < below * (1 - 1e-9) and source not in self.exact:
            self.exact.add(source)
            self.cands.entries[source].bound = self.fan.answer(self.fan.ask(self.owner.get(source, 0), "raise", source))
        if source in self.exact:
            entry.bound = self.cands.entries[source].bound

    def solve(self, mesh, below, effort, support):
        """The mesh's solution and the estimated step of its plan (``solve``)."""
        strategies, costs = self.cands.work(mesh)
        solution = solve(self.graph, strategies, costs, self.time_limit, self.budget, below=below, effort=effort,
                         support=support)
        return solution, plan_cost(self.graph, strategies, solution, costs)

    def attempt(self, mesh, first: bool) -> None:
        """Solve the mesh: in the first round, its plan among its LP's support (a blink; it
        proves most meshes within GAP_LIMIT); in the second, the whole program of a mesh left
        unproven, the best of them as any solve, the others that might still win for at most
        EFFORT deterministic seconds each."""
        entry = self.cands.entries[mesh]
        # the best plan so far, unproven, is solved whole as the mesh to refine; the others
        # only for a plan that beats it, with a bounded effort
        best = not first and (not self.results or min(self.results, key=lambda r: r[0].cost)[1] == mesh)
        below = None if best else _to_beat(self.results, mesh, self.cluster)
        effort = 0 if first else None if best else EFFORT
        self.take_exact_bound(mesh, below)
        if below is not None and entry.bound >= below * (1 - 1e-9):
            entry.becomes(Status.BOUNDED_OUT)
            return
        try:   # time_limit: per solve
            solution, cost = self.fan.answer(self.fan.ask(self.owner.get(mesh, 0), "solve", mesh, below, effort, first))
        except MemoryBudgetError as e:
            entry.becomes(Status.NO_FIT)
            self.errors.append(e)
            return
        except NoBetterPlan as e:
            self.no_better(mesh, first, e)
            return
        self.take_solution(mesh, solution, cost, first, effort)

    def no_better(self, mesh, first: bool, e: NoBetterPlan) -> None:
        """A solve found no plan that beats the best one's: left unproven in the first round."""
        entry = self.cands.entries[mesh]
        if first:
            self.unproven.append(mesh)
        elif entry.cost is not None:   # its plan of the first round stands
            entry.note(Note.NO_BETTER_IN_EFFORT)
        else:
            entry.becomes(Status.NO_BETTER_PLAN if e.proven else Status.TIMED_OUT)

    def take_solution(self, mesh, solution, cost: float, first: bool, effort) -> None:
        """A solve's plan, recorded where it betters the mesh's plan of the first round."""
        entry = self.cands.entries[mesh]
        before = next((r for r in self.results if r[1] == mesh), None)
        if before is not None and before[0].cost <= solution.objective:
            # its plan of the first round stands: a whole solve stopped by the time limit
            # may end above it (GPT-3 175B's search lost its (128, 8) plan of 60.66 s so)
            entry.note(Note.WHOLE_SOLVE_NO_BETTER)
            return
        self.results[:] = [r for r in self.results if r[1] != mesh]   # its plan of the first round, bettered
        self.results.append(self.record(mesh, solution, cost))
        if first and solution.gap is not None and solution.gap > GAP_LIMIT:
            self.unproven.append(mesh)
            entry.becomes(Status.SOLVED_UNPROVEN, gap=solution.gap)
        elif effort:
            if solution.gap is not None and solution.gap <= GAP_LIMIT:
                entry.becomes(Status.SOLVED)
            else:
                entry.becomes(Status.SOLVED_AFTER_EFFORT, gap=solution.gap)
        self.report(f"solved {mesh}")

    def record(self, mesh, solution, cost: float):
        """A solved candidate's plan in its candidate; (plan, mesh, choice)."""
        entry = self.cands.entries[mesh]
        entry.cost = cost
        if solution.status.startswith("LOCAL"):   # a descent's (planner.descend)
            entry.becomes(Status.REFINED, solution.status.lower())
        else:
            entry.becomes(Status.SOLVED)
        return _Unmade(self.cands, self.graph, mesh, solution, cost, self.budget), mesh, solution.choice

    # ---- phase 2: refinement, up to 4 axes ------------------------------------------------------

    def first_frontier(self) -> list:
        """Phase 2's first round: the best two-axis mesh's plan (one axis is refined by the
        two-axis meshes already), where a second axis paid: when no two-axis mesh beat the best
        one-axis plan by more than TIE, more axes are not tried. Where phase 1 found no plan,
        descents on the meshes of more axes (``_untried_starts``) instead."""
        one = [r for r in self.results if len(r[1]) == 1]
        widest = min((r for r in self.results if len(r[1]) == EXACT_AXES), key=lambda r: r[0].cost, default=None)
        paid = widest is not None and (not one or widest[0].cost < min(r[0].cost for r in one) * (1 - TIE))
        if widest is not None and not paid:
            for c in self.cands.entries.values():
                if len(c.mesh) > EXACT_AXES and c.status is Status.NOT_TRIED:
                    c.becomes(Status.NOT_WORTH_TRYING)
        if not self.results:
            for mesh in _untried_starts(self.cands, self.small):
                self.descend(mesh)
        return [widest] if paid and self.max_axes > EXACT_AXES else []

    def refine_round(self, frontier: list) -> list:
        """One round of a beam: each axis of each plan of ``frontier`` split in two, every
        refinement not refined yet descended once; the ``BEAM`` best that improve on their
        parent, the next round's frontier."""
        entries = self.cands.entries
        # a parent solved whole within GAP_LIMIT (``Candidate.proven``; not a descent's local optimum)
        round_ = [(plan, fine, (fine, mesh, choice, groups, entries[mesh].proven))
                  for plan, mesh, choice in frontier
                  for fine, groups in splits(mesh)
                  if len(fine) <= self.max_axes and fine in entries and entries[fine].cost is None]
        firsts: dict = {}   # each fine mesh's first refinement of the round, by whichever process is free
        for i, (_, fine, _) in enumerate(round_):
            firsts.setdefault(fine, i)
        tickets = {}
        shared = self.fan.share("refine", [round_[i][2] for i in firsts.values()], self.let_go_of_pruned)
        for (fine, i), (who, ticket) in zip(firsts.items(), shared):
            tickets[i], self.owner[fine] = ticket, who
        grown = []
        for i, (parent, fine, args) in enumerate(round_):
            if entries[fine].cost is not None:
                continue   # refined already this round, from the other plan of the beam
            ticket = tickets[i] if i in tickets else self.fan.ask(0, "refine", *args)
            got = self.take_refined(fine, ticket)
            self.report(f"refined {fine}")
            if got is not None:
                self.results.append(got)
                if got[0].cost < parent.cost * (1 - TIE):
                    grown.append(got)
        return sorted(grown, key=lambda r: r[0].cost)[:BEAM]

    def let_go_of_pruned(self) -> None:
        """Let go of the pruned meshes' programs, which nothing reads again: once the copies
        have the first refinements (0.06-0.14 s of the 96-layer GPT's search, alone before)."""
        for mesh, c in self.cands.entries.items():
            if c.status.pruned:
                self.cands.works.pop(mesh, None)

    def refine(self, fine, coarse, choice, groups, proven):
        """The plan of ``fine`` descended from ``coarse``'s plan (its ``choice``) lifted onto it,
        and its estimated step; None when the pins do not fit it. ``proven``: the coarse plan is
        a whole solve's within the solver's gap, so the descent skips the axes not split first
        (``descend.unsplit``)."""
        work = self.cands.work(fine)
        if work is None:
            return None
        strategies, costs = work
        lifted = lift(self.graph, self.cands.work(coarse)[0], choice, groups, strategies)
        solution = solve_mesh(self.graph, strategies, costs, self.time_limit, self.budget, lambda: [lifted],
                              unsplit(groups) if proven else frozenset())
        return solution, plan_cost(self.graph, strategies, solution, costs)

    def take_refined(self, mesh, ticket):
        """The result of a descent asked of the fanout (its ``ticket``), recorded; None when the
        pins do not fit the mesh or its plans break the memory budget (the error kept)."""
        try:
            got = self.fan.answer(ticket)
        except MemoryBudgetError as e:
            self.cands.entries[mesh].becomes(Status.NO_FIT)
            self.errors.append(e)
            return None
        if got is None:
            return None
        self.cands.worked.append(mesh)
        return self.record(mesh, *got)

    # ---- descents from a layout given --------------------------------------------------------------

    def descend(self, mesh) -> None:
        """Descend on ``mesh`` from the pins' layout (phase 1 found no plan), its result kept."""
        work = self.cands.work(mesh)
        if work is not None:
            strategies, costs = work
            try:
                solution = solve_mesh(self.graph, strategies, costs, self.time_limit, self.budget)
            except MemoryBudgetError as e:
                self.cands.entries[mesh].becomes(Status.NO_FIT)
                self.errors.append(e)
            else:
                self.cands.worked.append(mesh)
                self.results.append(self.record(mesh, solution, plan_cost(self.graph, strategies, solution, costs)))
        self.report(f"descended on {mesh}")

    def axonn_seed(self):
        """(mesh, pins by node) of AxoNN's own best-ranked grid (``planner.axonn_start``), or None."""
        return self.seed() if self.seed else None

    def descend_from_seed(self, seed) -> None:
        """The plan descended from ``seed`` (mesh, pins by node) on its mesh, unpinned, kept where
        it beats the mesh's plan so far: AxoNN's own best-ranked grid, which no refinement
        reaches. A mesh of up to ``EXACT_AXES`` axes was solved whole already."""
        if seed is None or seed[0] not in self.cands.entries or len(seed[0]) <= EXACT_AXES:
            return
        mesh, pins = seed
        work = self.cands.work(mesh)
        if work is None or self.cands.pins_for(mesh):   # the user's pins lay out the plan
            return
        strategies, costs = work
        try:
            solution = descend_from_pins(self.graph, strategies, costs, pins, self.time_limit, self.budget)
        except (ValueError, RuntimeError):   # the pins cannot hold on this mesh's shapes, or no plan in time
            return
        before = next((r for r in self.results if r[1] == mesh), None)
        if solution is None or (before is not None and before[0].cost <= solution.objective):
            return
        got = self.record(mesh, solution, plan_cost(self.graph, strategies, solution, costs))
        self.cands.entries[mesh].note(Note.FROM_AXONN)
        self.results[:] = [r for r in self.results if r[1] != mesh] + [got]
        self.report(f"descended on {mesh} from AxoNN's layout")

    # ---- the choice -----------------------------------------------------------------------------

    def choose(self):
        """The plan of the simplest mesh among equals (``_simplest``), every candidate in its
        ``mesh_candidates`` (as dicts, best first); or what went wrong, raised."""
        for w in self.cands.warned.values():
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        candidates = list(self.cands.entries.values())
        if not self.results:
            self.fail(candidates)
        best, why = _simplest(self.results, self.cluster)
        plan = best[0].made()
        self.cands.works.clear()
        self.cands.entries[best[1]].becomes(Status.CHOSEN_SIMPLER if why else Status.CHOSEN, why or "")
        plan.mesh_candidates = [c.as_dict() for c in sorted(candidates, key=lambda c: (
            c.cost is None, c.cost or 0, c.bound is None, c.bound or 0))]
        plan.solver["search_seconds"] = time.perf_counter() - self.start
        plan.solver["mesh_choice"] = why or f"{best[1]}: the shortest estimated step"
        self.progress.done(f"chose {best[1]}")
        return plan

    def fail(self, candidates: list) -> None:
        """No mesh has a plan: the first pin error where no mesh took the pins, else the first
        memory error, else the least memory the first mesh worked reaches (``solve`` raises
        it), else why each mesh has none."""
        if self.cands.pin_errors and all(c.bound is None and c.cost is None for c in candidates):
            raise self.cands.pin_errors[0]
        self.cands.works.clear()
        if self.errors:
            raise self.errors[0]
        if self.cands.worked:
            # solve the first for its report of the least memory it reaches
            strategies, costs = self.cands.work(self.cands.worked[0])
            solve(self.graph, strategies, costs, self.time_limit, self.budget)
        raise ValueError(f"no mesh of {self.world} devices with at most {self.max_axes} axes takes the pins given: "
                         + "; ".join(f"{c.mesh}: {c.text()}" for c in candidates))


def _coarse_pays(graph, cands, results) -> bool:
    """Whether a two-axis mesh's coarse bound (planner.coarse) may prune it: where the one-axis
    mesh's own coarse bound reaches its plan (within ``TIE``), the plan keeps activations whole,
    as a second axis's best plan likely does too (the tiny models: each bound equal to the plan
    to the last digit). Where it falls short, the coarse bounds of the two-axis meshes fall as
    short and prune nothing: the 96-layer GPT at world 1024, 0.94 s of a 1.88 s plan, nine coarse
    programs of 0.05 s each left unbuilt. Skipping one changes no plan: a mesh it would prune is
    pruned by its relaxation, or solved to a plan no better."""
    one = next((r for r in results if len(r[1]) == 1), None)
    work = cands.work(one[1]) if one is not None else None
    if work is None:
        return True
    return coarse_bound(graph, *work) >= one[0].cost * (1 - TIE) * (1 - 1e-9)


def _untried_starts(cands, small) -> list:
    """The meshes of more axes to descend on when phase 1 found no plan: every one when the
    pins name more axes than phase 1 solves (descending from the pins' layout); when nothing of
    one or two axes fits the budget, only the refinements of the ``BEAM`` two-axis meshes whose
    relaxation fits it (a few seconds, not one descent per mesh: GPT-3 175B without
    recomputation took 856 s over 130 meshes to say that nothing fits)."""
    more = [m for m in cands.entries if len(m) > EXACT_AXES]
    if all(cands.entries[m].status is Status.PINS_OTHER_AXES for m in small):
        return more
    bounded = sorted((m for m in small if cands.entries[m].bound is not None
                      and not math.isinf(cands.entries[m].bound) and len(m) == EXACT_AXES),
                     key=lambda m: cands.entries[m].bound)[:BEAM]
    return [fine for m in bounded for fine, _ in splits(m) if fine in cands.entries]


def _to_beat(results, mesh, cluster):
    """The estimated step a mesh's plan must beat to be chosen (``_simplest``): the cheapest so
    far less ``TIE``, or plus ``TIE`` for a mesh simpler than the cheapest one; None when
    nothing was solved yet."""
    if not results:
        return None
    cheapest = min(results, key=lambda r: r[0].cost)
    return cheapest[0].cost * ((1 + TIE) if simpler(mesh, cheapest[1], cluster) else (1 - TIE))


class _Unmade:
    """A solved candidate's plan, made (``make_plan``) only for the mesh the search chooses; its
    ``cost`` now, as the plan would have it (``plan_cost``, worked out by the mesh's owner)."""

    def __init__(self, cands, graph, mesh, solution, cost: float, budget: float):
        self.cost = cost
        self._made = (cands, graph, mesh, solution, budget)

    def made(self):
        cands, graph, mesh, solution, budget = self._made
        strategies, costs = cands.work(mesh)
        return make_plan(graph, strategies, solution, costs, budget=budget)
