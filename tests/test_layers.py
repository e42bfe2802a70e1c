"""The house's layers, as the README's "How it works" says them: nothing in ``autoshard/cost/`` or
``autoshard/rules/`` imports from ``autoshard/passes/`` or ``autoshard/planner/`` at module level;
no circle among autoshard's modules, counting the imports inside functions (a function-level
import that hides a circle is a circle); and no import up a floor (``FLOORS``). A type checker's
import is no import."""
import ast
import collections
import pathlib

import pytest

import autoshard

ROOT = pathlib.Path(autoshard.__file__).parent


def module_level_imports(path: pathlib.Path) -> list:
    """The modules ``path`` imports outside functions and ``if TYPE_CHECKING:`` blocks."""
    found = []

    def visit(body):
        for stmt in body:
            if isinstance(stmt, ast.Import):
                found.extend(a.name for a in stmt.names)
            elif isinstance(stmt, ast.ImportFrom) and stmt.module:
                found.append(stmt.module)
            elif isinstance(stmt, ast.If) and not (isinstance(stmt.test, ast.Name) and stmt.test.id == "TYPE_CHECKING"):
                visit(stmt.body)
                visit(stmt.orelse)
            elif isinstance(stmt, (ast.Try, ast.With)):
                visit(stmt.body)
            elif isinstance(stmt, ast.ClassDef):
                visit(stmt.body)

    visit(ast.parse(path.read_text()).body)
    return found


@pytest.mark.parametrize("layer", ["cost", "rules"])
def test_cost_and_rules_import_neither_passes_nor_planner(layer):
    wrong = {f"{layer}/{p.name}": m for p in sorted((ROOT / layer).glob("*.py"))
             for m in module_level_imports(p)
             if any(m == up or m.startswith(up + ".") for up in ("autoshard.passes", "autoshard.planner"))}
    assert not wrong, wrong


def test_the_check_sees_a_module_level_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nfrom autoshard.passes.annotate import annotate\n"
                    "if TYPE_CHECKING:\n    from autoshard.passes.capture import Graph\n"
                    "def f():\n    from autoshard.planner.solve import solve\n")
    assert module_level_imports(path) == ["typing", "autoshard.passes.annotate"]


# Imports allowed to close a circle: only a lazy import of an optional dependency, each named here as
# (importer, imported) with why. None does today; keep it empty, and let no new one land.
ALLOWED = frozenset()


def _modules(root: pathlib.Path) -> dict:
    """dotted name -> path of every module under ``root`` (a package by its ``__init__.py``)."""
    out = {}
    for p in root.rglob("*.py"):
        parts = p.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def import_graph(root: pathlib.Path = ROOT) -> dict:
    """importer -> {imported: [(line, in a function)]} over the modules under ``root``, every import
    counted, those inside functions too; not a type checker's (``if TYPE_CHECKING:``). The root
    package (``autoshard/__init__.py``) is no node: it is the façade over everything, run before
    any of its modules whoever imports them."""
    mods = _modules(root)
    top = root.name

    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name if name and name != top else None

    graph = {m: collections.defaultdict(list) for m in mods if m != top}
    for name, path in mods.items():
        if name == top:
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                if (isinstance(child, ast.If) and isinstance(child.test, ast.Name)
                        and child.test.id == "TYPE_CHECKING"):
                    for stmt in child.orelse:
                        visit_stmt(stmt, in_function)
                    continue
                visit_stmt(child, in_function)

        def visit_stmt(node, in_function):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                if t == top or t.startswith(top + "."):
                    r = resolve(t)
                    if r is not None and r != name and (node.lineno, in_function) not in graph[name][r]:
                        graph[name][r].append((node.lineno, in_function))
            visit(node, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(ast.parse(path.read_text()), False)
    return graph


def circles(graph: dict, allowed=frozenset()) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted, once the
    ``allowed`` (importer, imported) edges are dropped."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if (v, w) in allowed:
                continue
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    import sys
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(graph):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def _words(graph: dict, comp: list) -> str:
    """Each import inside the circle ``comp``: importer -> imported (its lines, F: inside a function)."""
    inside = set(comp)
    lines = []
    for a in comp:
        for b, where in sorted(graph[a].items()):
            if b in inside:
                lines.append(f"  {a} -> {b} (line {', '.join(str(n) + ' F' * f for n, f in where)})")
    return "\n".join(lines)


def test_no_import_circle_counting_imports_inside_functions():
    graph = import_graph()
    found = circles(graph, ALLOWED)
    assert not found, "import circles:\n" + "\n".join(f"{len(c)} modules:\n{_words(graph, c)}" for c in found)


def test_every_allowed_edge_still_exists():
    """An allowed edge that is gone leaves the list: it only shrinks."""
    graph = import_graph()
    assert all(b in graph.get(a, {}) for a, b in ALLOWED), [e for e in ALLOWED if e[1] not in graph.get(e[0], {})]


def test_the_graph_sees_imports_inside_functions_and_finds_their_circle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\ndef f():\n    return b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.c\n"
                                      "def g():\n    from pkg import a\n")
    (pkg / "c.py").write_text("from .sub import b\n")
    graph = import_graph(pkg)
    assert dict(graph["pkg.a"]) == {"pkg.sub": [(1, False)], "pkg.sub.b": [(1, False)]}
    assert dict(graph["pkg.sub.b"]) == {"pkg.a": [(5, True)]}   # the TYPE_CHECKING import is none
    assert dict(graph["pkg.c"]) == {"pkg.sub": [(1, False)], "pkg.sub.b": [(1, False)]}
    assert circles(graph) == [["pkg.a", "pkg.sub.b"]]
    assert circles(graph, {("pkg.sub.b", "pkg.a")}) == []


# The floors, in the order a model flows through them (the README's "How it works"): a module imports
# from its own floor or those above it in this list, never from one below. A folder may span floors:
# passes/ captures and annotates before anything is priced, and lowers a plan after it is made.
# report/'s plan-reading modules stand under plan.py: a plan's methods call them, and they only read
# its fields (plan.py says why).
FLOORS = [
    ("_compat", "placement", "convert", "arguments", "ir", "precision", "outputs", "inputs", "planner.progress",
     "planner.repeat"),
    ("rules",),
    ("passes.functionalize", "passes.capture", "passes.annotate"),
    ("machine.cluster", "options"),  # a cluster, and the planning options that name one
    ("cost",),
    ("runtime",),
    ("report.summary", "report.explain", "report.formula", "report.html", "report.pipeline_page"),
    ("plan", "cache"),              # a plan as data, and plans kept on disk
    ("passes",),                     # rewrite, schedule, checkpoint, interleave, overdecompose; lower lists them
    ("schemes",),
    ("planner",),
    ("pipelined",),                  # parallelize's pipeline: a stage per rank, built from planner.pipeline
    ("feed",),                       # what a parallel module's program takes and gives back
    ("api", "machine.measure"),
    ("report.coverage", "cli", "__main__", "testing", "check"),
]

# Imports that go up a floor today, each with why; none does, and the list only shrinks.
UPWARD = frozenset()


def floor_of(module: str) -> int:
    """The floor of a module: that of the longest name in ``FLOORS`` it is or lies under; the
    ground floor for a package whose ``__init__.py`` imports nothing (``autoshard.cost``)."""
    name = module.partition(".")[2]
    init = ROOT.joinpath(*name.split("."), "__init__.py")
    if init.exists() and not any(isinstance(s, (ast.Import, ast.ImportFrom))
                                 for s in ast.walk(ast.parse(init.read_text()))):
        return 0
    best = max(((len(p), i) for i, names in enumerate(FLOORS) for p in names
                if name == p or name.startswith(p + ".")), default=None)
    assert best is not None, f"{module} stands on no floor: add it to FLOORS"
    return best[1]


def test_nothing_imported_upward():
    graph = import_graph()
    up = {(a, b): where for a in graph for b, where in graph[a].items() if floor_of(b) > floor_of(a)}
    assert set(up) <= UPWARD, {e: w for e, w in up.items() if e not in UPWARD}
    assert UPWARD <= set(up), f"no longer upward, strike from UPWARD: {UPWARD - set(up)}"


# STYLE.md: modules under about 800 lines. A module over it is split by what it holds, not excused.
MAX_LINES = 800

def test_no_module_over_800_lines():
    over = {str(p.relative_to(ROOT)): n for p in sorted(ROOT.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not over, over
