"""Plans kept on disk, so that a restart or a resume does not plan again.

``parallelize`` plans on rank 0 and hands the plan to every rank; before planning, rank 0 looks
for a plan made for the same graph, shapes, mesh and options by the same autoshard and torch, and
saves the one it makes. Every rank takes what rank 0 took, so the ranks cannot disagree.

The key is a hash of: the captured program's code (with the regions it calls: a mask's mod)
and every node's name, kind and tensors (so
the model, its shapes and dtypes, its precision and how its outputs are taken), the mesh, the
planning options (the cluster's figures, the pins, the budget, ...), autoshard's own source and
torch's version (a changed cost model or rule plans again). A measured cluster's figures differ
from one measurement to the next, so its plans are found again only with the same figures.

Where: ``$AUTOSHARD_PLAN_CACHE`` (a directory; ``off`` or ``0`` turns the cache off), else
``$XDG_CACHE_HOME/autoshard/plans``, else ``~/.cache/autoshard/plans``. A file that cannot be
read or written is passed over (the plan is made as without a cache).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import tempfile
from typing import Optional

import torch

from autoshard.ir import Graph
from autoshard.options import PlanOptions

ENV = "AUTOSHARD_PLAN_CACHE"
_OFF = ("", "0", "off", "no", "false")


def directory() -> Optional[pathlib.Path]:
    """Where plans are kept, or None when the cache is off."""
    asked = os.environ.get(ENV)
    if asked is not None:
        return None if asked.strip().lower() in _OFF else pathlib.Path(asked).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "autoshard" / "plans"


@functools.lru_cache(maxsize=None)
def _code_digest() -> str:
    """autoshard's source and torch's version: another version plans afresh."""
    h = hashlib.sha256(torch.__version__.encode())
    root = pathlib.Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _plain(x):
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"dataclass": type(x).__name__, **dataclasses.asdict(x)}
    if isinstance(x, (set, frozenset)):
        return sorted(map(repr, x))
    return repr(x)


# options the key leaves out: the mesh shape is hashed itself, the graph carries the outputs and
# the precision policy (capture), and verbose only prints the planner's progress
_UNREAD = ("mesh", "outputs", "mp_policy", "verbose")


def key(graph: Graph, mesh_shape, options: PlanOptions) -> str:
    """The plan's key: what the planner reads, hashed (module docstring)."""
    h = hashlib.sha256(_code_digest().encode())
    for text in ingredients(graph, mesh_shape, options):
        h.update(text.encode())
    return h.hexdigest()[:40]


def ingredients(graph: Graph, mesh_shape, options: PlanOptions) -> list:
    """What the planner reads of a graph under ``options``, as texts: ``key`` hashes them, and
    ``planner.alike`` hashes them with a stage's blocks' names written as their positions."""
    options = {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.name not in _UNREAD}
    texts = []
    # the program's code and that of every region it calls (a FlexAttention mask's or score's mod,
    # a branch): two models apart only in a mask's mod are two plans (whether a split is legal
    # depends on what the mod reads)
    for name, module in sorted(graph.exported.graph_module.named_modules(), key=lambda kv: kv[0]):
        if isinstance(module, torch.fx.GraphModule):
            texts += [name, module.code]
    texts.append(repr([(n.name, n.kind, n.fqn, n.region, n.recomputed,
                        [(tuple(m.shape), str(m.dtype)) for m in n.outputs]) for n in graph.nodes]))
    texts.append(repr((graph.outputs, graph.received, graph.precision, sorted(graph.param_aliases.items()),
                       tuple(mesh_shape))))
    texts.append(json.dumps(options, sort_keys=True, default=_plain))
    return texts


def load(name: str) -> Optional[str]:
    """The plan's JSON saved under ``name``, or None."""
    where = directory()
    if where is None:
        return None
    try:
        return (where / f"{name}.json").read_text()
    except OSError:
        return None


def save(name: str, text: str) -> None:
    """Keep the plan's JSON under ``name``, written whole or not at all."""
    where = directory()
    if where is None:
        return
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=where, suffix=".tmp", delete=False) as f:
            f.write(text)
        os.replace(f.name, where / f"{name}.json")
    except OSError:
        pass
