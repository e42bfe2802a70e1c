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
"""
from __future__ import annotations

import math
import time
import warnings

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


class _Candidates:
    """Every candidate mesh's entry (mesh, bound, cost, status) and its annotated work."""

    def __init__(self, graph, world, cluster, pins_for, training, bucket_bytes, max_axes, reshard=False,
                 recompute="none"):
        self.graph, self.cluster, self.training, self.bucket_bytes = graph, cluster, training, bucket_bytes
        self.reshard, self.recompute = reshard, recompute
        self.pins_for = pins_for
        self.entries = {m: {"mesh": list(m), "bound": None, "cost": None, "status": "not tried: refines none "
                            "of the meshes chosen so far"} for m in factorizations(world, max_axes)}
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
                     and e["bound"] is not None), None)

    def work(self, mesh):
        """(strategies, costs) of the mesh, or None when the pins do not fit it."""
        entry = self.entries[mesh]
        if "_work" in entry:
            return entry["_work"]
        pins = self.pins_for(mesh)
        if pins is None:
            entry["status"] = "pins name another number of axes"
            return None
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                strategies = annotate(self.graph, mesh, pins)
            for w in caught:   # once per search, not once per mesh
                self.warned.setdefault(str(w.message), w)
        except ValueError as e:
            entry["status"] = f"pins cannot hold: {str(e).split(':')[0]}"
            self.pin_errors.append(e)
            return None
        costs = Costs(self.graph, mesh, self.cluster, self.training, self.bucket_bytes, self.reshard)
        costs = costs.with_recompute(self.recompute)   # planner.recompute
        entry["_work"] = (strategies, costs)
        return entry["_work"]


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
           max_axes: int = MAX_SEARCH_AXES, reshard: bool = False, recompute: str = "none", seed=None):
    """The best plan over the candidate meshes; ``pins_for(mesh_shape)`` resolves the user's
    pins for a mesh (None: the pins do not fit that mesh). ``seed()``: (mesh, pins by node) of
    a layout to descend from as well (``planner.axonn_start``), or None."""
    with uncollected():
        return _search(graph, world, cluster, pins_for, training, time_limit, bucket_bytes, budget, max_axes,
                       reshard, recompute, seed)


def _search(graph, world, cluster, pins_for, training, time_limit, bucket_bytes, budget, max_axes, reshard,
            recompute, seed):
    start = time.perf_counter()
    cands = _Candidates(graph, world, cluster, pins_for, training, bucket_bytes, max_axes, reshard, recompute)
    progress = Progress(f"mesh search over {len(cands.entries)} meshes of {world} devices")
    errors: list = []
    results: list = []   # (plan, mesh, choice) of every mesh solved or refined
    owner: dict = {}     # mesh -> the process that bounds, solves or refines it (planner.fanout); 0: this one
    coarse_pays = [True]   # whether a two-axis mesh is bounded coarsely first (``_coarse_pays``)

    def report(step):
        done = sum(e["cost"] is not None or e["status"].startswith(("pruned", "does not")) for e in cands.entries.values())
        best = min(results, key=lambda r: r[0].cost) if results else None
        progress.update(f"{step}; {done} of {len(cands.entries)} meshes done"
                        + (f", best {best[1]} {best[0].cost * 1e3:.3f} ms per step" if best else ""))

    def bound(mesh):
        """The mesh's lower bound in its entry: a mesh that refines the best plan's must beat it
        by TIE, and its coarse bound (planner.coarse, a fraction of the program) may say that
        it cannot before its own relaxation is priced and built. What the entry and the
        search's warnings and pin errors gained, for the process that asked."""
        entry = cands.entries[mesh]
        warned, pin_errors = len(cands.warned), len(cands.pin_errors)
        work = cands.work(mesh)
        twin = cands.twin(mesh) if work is not None else None
        if twin:
            entry["bound"], entry["status"] = cands.entries[twin]["bound"], cands.entries[twin]["status"]
            entry["twin"] = twin
        elif work is not None:
            below = _to_beat(results, mesh, cluster) if coarse_pays[0] else None
            if below is not None:
                entry["bound"] = coarse_bound(graph, *work)
                if entry["bound"] >= below * (1 - 1e-9):
                    entry["status"] = f"pruned: its coarse bound is no better than the best plan's (within {100 * TIE:g}%)"
            if not entry["status"].startswith("pruned"):
                entry["bound"] = lower_bound(graph, *work, budget, quick=True)   # raised before a solve
                entry["status"] = "does not fit in memory" if math.isinf(entry["bound"]) else "bounded"
        return ({k: v for k, v in entry.items() if k != "_work"}, work is not None,
                [(w.message, w.category, w.filename, w.lineno) for w in list(cands.warned.values())[warned:]],
                cands.pin_errors[pin_errors:])

    def solved(mesh, below, effort, support):
        """The mesh's solution and the estimated step of its plan (``solve``)."""
        strategies, costs = cands.work(mesh)
        solution = solve(graph, strategies, costs, time_limit, budget, below=below, effort=effort, support=support)
        return solution, plan_cost(graph, strategies, solution, costs)

    def refined(fine, coarse, choice, groups, proven):
        """The plan of ``fine`` descended from ``coarse``'s plan (its ``choice``) lifted onto it,
        and its estimated step; None when the pins do not fit it. ``proven``: the coarse plan is
        a whole solve's within the solver's gap, so the descent skips the axes not split first
        (``descend.unsplit``)."""
        work = cands.work(fine)
        if work is None:
            return None
        strategies, costs = work
        lifted = lift(graph, cands.work(coarse)[0], choice, groups, strategies)
        solution = solve_mesh(graph, strategies, costs, time_limit, budget, lambda: [lifted],
                              unsplit(groups) if proven else frozenset())
        return solution, plan_cost(graph, strategies, solution, costs)

    def raised(mesh):
        """The mesh's bound, not quick (``lower_bound``): before it is solved."""
        return lower_bound(graph, *cands.work(mesh), budget)

    fan = Fanout(1, {"bounds": lambda meshes: [bound(m) for m in meshes], "raise": raised, "solve": solved,
                     "refine": refined, "seed": lambda: seed() if seed else None})
    twin_of: dict = {}   # mesh -> the mesh whose bound it took, its axes reordered (``_Candidates.twin``)
    exact: set = set()   # the meshes whose bounds are not quick

    def bounded(meshes):
        """Bound the meshes, each twin group (``_Candidates.twin_key``) in order by whichever
        process takes it first (``Fanout.share``), its owner from then on, and take in their
        entries in order."""
        groups: dict = {}
        for mesh in meshes:
            groups.setdefault(cands.twin_key(mesh), []).append(mesh)
        # the lopsided meshes first: their programs are the largest (the 96-layer GPT's (2, 512)
        # and (512, 2): 0.6-0.9 s against 0.45-0.55 s), and the last jobs taken decide when the
        # processes all end
        order = sorted(groups.values(), key=lambda g: -max(g[0]) / min(g[0]))
        answers = {}
        for group, (who, ticket) in zip(order, fan.share("bounds", [(tuple(g),) for g in order])):
            answers.update(zip(group, fan.answer(ticket)))
            owner.update(dict.fromkeys(group, who))
        for mesh in meshes:
            fields, worked, warned, pin_errors = answers[mesh]
            if owner.get(mesh, 0):
                cands.entries[mesh].update(fields)
                for message, category, filename, lineno in warned:
                    cands.warned.setdefault(str(message), warnings.WarningMessage(message, category, filename, lineno))
                cands.pin_errors.extend(pin_errors)
            if worked:
                cands.worked.append(mesh)
            entry = cands.entries[mesh]
            twin = entry.pop("twin", None)
            twin_of[mesh] = twin or mesh
            if entry["status"] == "pins name another number of axes" or entry["status"].startswith("pins cannot"):
                continue
            report(f"bounded {mesh} (as {twin}, its axes reordered)" if twin else
                   f"pruned {mesh}" if entry["status"].startswith("pruned") else f"bounded {mesh}")

    def attempt(mesh, first):
        """Solve the mesh: in the first round, its plan among its LP's support (a blink; it
        proves most meshes within GAP_LIMIT); in the second, the whole program of a mesh left
        unproven, the best of them as any solve, the others that might still win for at most
        EFFORT deterministic seconds each."""
        entry = cands.entries[mesh]
        # the best plan so far, unproven, is solved whole as the mesh to refine; the others
        # only for a plan that beats it, with a bounded effort
        best = not first and (not results or min(results, key=lambda r: r[0].cost)[1] == mesh)
        below = None if best else _to_beat(results, mesh, cluster)
        effort = 0 if first else None if best else EFFORT
        source = twin_of.get(mesh, mesh)
        if below is not None and entry["bound"] < below * (1 - 1e-9) and source not in exact:
            # its quick bound does not prune it: its exact one may (the mesh's owner keeps its relaxations)
            exact.add(source)
            cands.entries[source]["bound"] = fan.answer(fan.ask(owner.get(source, 0), "raise", source))
        if source in exact:
            entry["bound"] = cands.entries[source]["bound"]
        if below is not None and entry["bound"] >= below * (1 - 1e-9):
            entry["status"] = f"pruned: its lower bound is no better than the best plan's (within {100 * TIE:g}%)"
            return
        try:   # time_limit: per solve
            solution, cost = fan.answer(fan.ask(owner.get(mesh, 0), "solve", mesh, below, effort, first))
        except MemoryBudgetError as e:
            entry["status"] = "does not fit in memory"
            errors.append(e)
            return
        except NoBetterPlan as e:
            if first:
                unproven.append(mesh)
                return
            if entry["cost"] is not None:   # its plan of the first round stands
                entry["status"] += f"; no better plan in {EFFORT:g} deterministic s"
                return
            entry["status"] = (f"pruned: no plan on it beats the best plan's by {100 * TIE:g}% "
                               + ("(proven)" if e.proven else f"(none found in {EFFORT:g} deterministic s)"))
            return
        before = next((r for r in results if r[1] == mesh), None)
        if before is not None and before[0].cost <= solution.objective:
            # its plan of the first round stands: a whole solve stopped by the time limit
            # may end above it (GPT-3 175B's search lost its (128, 8) plan of 60.66 s so)
            entry["status"] += "; the whole solve found no better plan"
            return
        results[:] = [r for r in results if r[1] != mesh]   # its plan of the first round, bettered
        results.append(_record(cands, graph, mesh, solution, cost))
        if first and solution.gap is not None and solution.gap > GAP_LIMIT:
            unproven.append(mesh)
            entry["status"] = f"solved ({100 * solution.gap:.2f}% from its bound)"
        elif effort:
            entry["status"] = ("solved" if solution.gap is not None and solution.gap <= GAP_LIMIT else
                               f"solved ({100 * solution.gap:.2f}% from its bound after {EFFORT:g} deterministic s)")
        report(f"solved {mesh}")

    try:
        # phase 1: one and two axes, bounded and solved whole, best bound first: the one-axis
        # mesh first, so that its plan can prune a two-axis mesh by its coarse bound; then the
        # meshes the first round left unproven. The two-axis meshes are shared out among forked
        # copies of this process (planner.fanout) once the one-axis mesh has taken long enough
        # for the copies to pay
        unproven: list = []
        small = [m for m in cands.entries if len(m) <= EXACT_AXES]
        for axes in range(1, EXACT_AXES + 1):
            meshes = [m for m in small if len(m) == axes]
            groups = len({cands.twin_key(m) for m in meshes})
            if axes == EXACT_AXES:
                coarse_pays[0] = _coarse_pays(graph, cands, results)
            if axes > 1 and groups > 1 and time.perf_counter() - start > FANOUT_AFTER:
                fan = Fanout(min(available(), groups), fan.handlers)
            bounded(meshes)
            for mesh in sorted((m for m in meshes if cands.entries[m]["status"] == "bounded"),
                               key=lambda m: cands.entries[m]["bound"]):
                attempt(mesh, True)
        while unproven:
            # the meshes that only might win first, each for a plan that beats the best one's with
            # a bounded effort; the best last, solved whole: one of them may take its place (the
            # 96-layer GPT's (256, 4) did, once (512, 2) had been solved whole first, to gain 0.01%)
            lead = min(results, key=lambda r: r[0].cost)[1] if results else None
            mesh = next((m for m in unproven if m != lead), unproven[0])
            unproven.remove(mesh)
            attempt(mesh, False)

        # phase 2: refine the best two-axis mesh (one axis is refined by the two-axis meshes
        # already), one axis split at a time, while refining pays. Only where a second axis paid:
        # when no two-axis mesh beat the best one-axis plan by more than TIE, more axes are not tried
        best = _simplest(results, cluster)[0] if results else None
        one = [r for r in results if len(r[1]) == 1]
        widest = min((r for r in results if len(r[1]) == EXACT_AXES), key=lambda r: r[0].cost, default=None)
        paid = widest is not None and (not one or widest[0].cost < min(r[0].cost for r in one) * (1 - TIE))
        frontier = [widest] if paid and max_axes > EXACT_AXES else []
        if widest is not None and not paid:
            for e in cands.entries.values():
                if len(e["mesh"]) > EXACT_AXES and e["status"].startswith("not tried"):
                    e["status"] = f"not tried: no two-axis mesh beat the one-axis plan by more than {100 * TIE:g}%"
        if best is None:
            for mesh in _untried_starts(cands, small):
                got = _descend_from(cands, graph, mesh, time_limit, budget, errors)
                if got is not None:
                    results.append(got)
                report(f"descended on {mesh}")
        # AxoNN's own best-ranked grid (descended from after the search), worked out by a copy
        seeded = fan.ask(1 if fan.count > 1 else 0, "seed")

        def unpruned():
            """Let go of the pruned meshes' programs, which nothing reads again: once the copies
            have the first refinements (0.06-0.14 s of the 96-layer GPT's search, alone before)."""
            for e in cands.entries.values():
                if e["status"].startswith("pruned"):
                    e.pop("_work", None)

        while frontier:   # a beam: the BEAM best refinements of a round that improve on their parent
            grown = []
            # a parent solved whole within GAP_LIMIT ("solved"; not a descent's local optimum)
            round_ = [(plan, fine, (fine, mesh, choice, groups, cands.entries[mesh]["status"] == "solved"))
                      for plan, mesh, choice in frontier
                      for fine, groups in splits(mesh)
                      if len(fine) <= max_axes and fine in cands.entries and cands.entries[fine]["cost"] is None]
            firsts: dict = {}   # each fine mesh's first refinement of the round, by whichever process is free
            for i, (_, fine, _) in enumerate(round_):
                firsts.setdefault(fine, i)
            tickets = {}
            shared = fan.share("refine", [round_[i][2] for i in firsts.values()], unpruned)
            for (fine, i), (who, ticket) in zip(firsts.items(), shared):
                tickets[i], owner[fine] = ticket, who
            for i, (parent, fine, args) in enumerate(round_):
                if cands.entries[fine]["cost"] is not None:
                    continue   # refined already this round, from the other plan of the beam
                ticket = tickets[i] if i in tickets else fan.ask(0, "refine", *args)
                got = _recorded(cands, graph, fine, fan, ticket, errors)
                report(f"refined {fine}")
                if got is not None:
                    results.append(got)
                    if got[0].cost < parent.cost * (1 - TIE):
                        grown.append(got)
            frontier = sorted(grown, key=lambda r: r[0].cost)[:BEAM]
        seeded = fan.answer(seeded)
    finally:
        fan.close()

    # AxoNN's own best-ranked grid, which no refinement reaches (planner.axonn_start)
    got = _descend_from_seed(cands, graph, seeded, time_limit, budget, results)
    if got is not None:
        results[:] = [r for r in results if r[1] != got[1]] + [got]
        report(f"descended on {got[1]} from AxoNN's layout")

    for w in cands.warned.values():
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    candidates = list(cands.entries.values())
    if not results and cands.pin_errors and all(e["bound"] is None and e["cost"] is None for e in candidates):
        raise cands.pin_errors[0]
    if not results:
        for e in candidates:
            e.pop("_work", None)
        if errors:
            raise errors[0]
        if cands.worked:
            # solve the first for its report of the least memory it reaches
            strategies, costs = cands.work(cands.worked[0])
            solve(graph, strategies, costs, time_limit, budget)
        raise ValueError(f"no mesh of {world} devices with at most {max_axes} axes takes the pins given: "
                         + "; ".join(f"{tuple(e['mesh'])}: {e['status']}" for e in candidates))
    best, why = _simplest(results, cluster)
    plan = best[0].made()
    for e in candidates:
        e.pop("_work", None)
    cands.entries[best[1]]["status"] = "chosen" + (f": {why}" if why else "")
    plan.mesh_candidates = sorted(candidates, key=lambda e: (e["cost"] is None, e["cost"] or 0,
                                                             e["bound"] is None, e["bound"] or 0))
    plan.solver["search_seconds"] = time.perf_counter() - start
    plan.solver["mesh_choice"] = why or f"{best[1]}: the shortest estimated step"
    progress.done(f"chose {best[1]}")
    return plan


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
    if all(cands.entries[m]["status"] == "pins name another number of axes" for m in small):
        return more
    bounded = sorted((m for m in small if cands.entries[m]["bound"] is not None
                      and not math.isinf(cands.entries[m]["bound"]) and len(m) == EXACT_AXES),
                     key=lambda m: cands.entries[m]["bound"])[:BEAM]
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

    def __init__(self, cands, graph, mesh, solution, cost: float):
        self.cost = cost
        self._made = (cands, graph, mesh, solution)

    def made(self):
        cands, graph, mesh, solution = self._made
        strategies, costs = cands.work(mesh)
        return make_plan(graph, strategies, solution, costs)


def _record(cands, graph, mesh, solution, cost: float):
    """A solved candidate's plan in its entry; (plan, mesh, choice)."""
    entry = cands.entries[mesh]
    entry["cost"] = cost
    entry["status"] = f"refined ({solution.status.lower()})" if solution.status.startswith("LOCAL") else "solved"
    return _Unmade(cands, graph, mesh, solution, cost), mesh, solution.choice


def _recorded(cands, graph, mesh, fan, ticket, errors):
    """The result of a descent asked of ``fan`` (its ``ticket``), recorded; None when the pins
    do not fit the mesh or its plans break the memory budget (the error kept in ``errors``)."""
    try:
        got = fan.answer(ticket)
    except MemoryBudgetError as e:
        cands.entries[mesh]["status"] = "does not fit in memory"
        errors.append(e)
        return None
    if got is None:
        return None
    cands.worked.append(mesh)
    return _record(cands, graph, mesh, *got)


def _descend_from_seed(cands, graph, seed, time_limit, budget, results):
    """The plan descended from ``seed`` (mesh, pins by node) on its mesh, unpinned, where it
    beats the mesh's plan so far; else None. A mesh of up to ``EXACT_AXES`` axes was solved
    whole already."""
    if seed is None or seed[0] not in cands.entries or len(seed[0]) <= EXACT_AXES:
        return None
    mesh, pins = seed
    work = cands.work(mesh)
    if work is None or cands.pins_for(mesh):   # the user's pins lay out the plan
        return None
    strategies, costs = work
    try:
        solution = descend_from_pins(graph, strategies, costs, pins, time_limit, budget)
    except (ValueError, RuntimeError):   # the pins cannot hold on this mesh's shapes, or no plan in time
        return None
    before = next((r for r in results if r[1] == mesh), None)
    if solution is None or (before is not None and before[0].cost <= solution.objective):
        return None
    got = _record(cands, graph, mesh, solution, plan_cost(graph, strategies, solution, costs))
    cands.entries[mesh]["status"] += ", descended from AxoNN's layout"
    return got


def _descend_from(cands, graph, mesh, time_limit, budget, errors):
    """Descend on ``mesh`` from the pins' layout (phase 1 found no plan): its result, or None."""
    work = cands.work(mesh)
    if work is None:
        return None
    strategies, costs = work
    try:
        solution = solve_mesh(graph, strategies, costs, time_limit, budget)
    except MemoryBudgetError as e:
        cands.entries[mesh]["status"] = "does not fit in memory"
        errors.append(e)
        return None
    cands.worked.append(mesh)
    return _record(cands, graph, mesh, solution, plan_cost(graph, strategies, solution, costs))
