"""Stages alike, planned once: a pipeline's middle stages are usually the same program on other
blocks of the stack (``blocks.4-7`` and ``blocks.8-11``), on the same mesh, under the same options,
and the integer program would find the same plan for each. ``Alike`` plans the first of them and
hands the others its plan with the names moved over to their own blocks.

Two stages are alike where their captured programs read the same once every block's name is
replaced by its position in the stage (``blocks.4`` -> ``blocks.#0``, ``p_blocks_4_qkv_weight``
-> ``p_blocks_#0_qkv_weight``): the code, every node's name, kind, tensors and modules, the
parameters' aliases, the mesh, and the options (pins and memory budget among them; a pin is
renamed alike). Anything else that names a block's index (a stage whose code counts its blocks its
own way) keeps the programs apart, and each is planned: a plan is never handed to a stage it
was not made for.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re

from autoshard.cache import ingredients
from autoshard.planner.solution import NoPlanInTime

_MARK = "#"   # no name of a module or a graph node holds it


class Alike:
    """``plan_stage`` (``(graph, mesh_shape, options) -> Plan``) that plans each distinct stage
    once: ``plan(graph, mesh_shape, options, blocks)``, ``blocks`` the stage's block names in
    order (``("blocks.4", "blocks.5")``). ``solved`` counts the plans made, ``reused`` those
    handed on."""

    def __init__(self, plan_stage):
        self.plan_stage = plan_stage
        self.made: dict = {}   # key -> (the plan, its stage's blocks and inputs)
        self.solved = self.reused = 0
        self.key = None   # the last stage's: stages alike have one

    def plan(self, graph, mesh_shape: tuple, options, blocks: tuple):
        names = (tuple(blocks), tuple(graph.user_inputs))
        key = self.key = stage_key(graph, mesh_shape, options, names)
        if key in self.made:
            plan, source = self.made[key]
            self.reused += 1
            if isinstance(plan, Exception):   # none for the first alike stage (in its time): none for this one
                raise plan
            return renamed(plan, source, names)
        self.solved += 1
        try:
            plan = self.plan_stage(graph, mesh_shape, options)
        except (ValueError, NoPlanInTime) as failed:
            self.made[key] = (failed, names)
            raise
        self.made[key] = (plan, names)
        return plan


def _to_positions(text: str, names: tuple) -> str:
    """``text`` with each of the stage's blocks' names written as its position in the stage,
    dotted and as export writes them with underscores, and each of its inputs' names
    (``names``: (blocks, inputs)) as ``input#i`` (the stage before names what it hands on)."""
    blocks, inputs = names
    for i, block in enumerate(blocks):
        under = block.replace(".", "_")
        pattern = rf"(?<![\w.]){re.escape(block)}(?![\w])|(?<![A-Za-z0-9]){re.escape(under)}(?![0-9])"
        text = re.sub(pattern, lambda m, i=i: _positioned(m.group(0), i), text)
    for i, name in enumerate(inputs):
        text = re.sub(rf"(?<![\w]){re.escape(name)}(?![\w])", f"input{_MARK}{i}", text)
    return text


def _positioned(name: str, i: int) -> str:
    """``blocks.4`` -> ``blocks.#0``; ``blocks_4`` -> ``blocks_#0``."""
    head, sep, _ = name.rpartition("." if name.rpartition(".")[2].isdigit() else "_")
    return f"{head}{sep}{_MARK}{i}"


def _from_positions(text: str, names: tuple) -> str:
    """The inverse of ``_to_positions``: each position written as the block (or input) at it."""
    blocks, inputs = names
    text = re.sub(rf"(?<![\w])input{_MARK}(\d+)", lambda m: inputs[int(m.group(1))], text)
    return re.sub(rf"[\w.]*?([._]){_MARK}(\d+)", lambda m: _back(m, blocks), text)


def _back(m, blocks: tuple) -> str:
    """A positioned name (``blocks.#0``, ``p_blocks_#0``) as the stage's block at that position;
    the head before the container (``p_``) kept."""
    whole, sep, i = m.group(0), m.group(1), int(m.group(2))
    block = blocks[i]
    container = block.rpartition(".")[0]
    name = container if sep == "." else container.replace(".", "_")
    head = whole[: len(whole) - len(f"{sep}{_MARK}{i}")]
    if not head.endswith(name):
        raise ValueError(f"{whole!r} names no block of {blocks}")
    return head[: len(head) - len(name)] + (block if sep == "." else block.replace(".", "_"))


def stage_key(graph, mesh_shape: tuple, options, names: tuple) -> str:
    """What the integer program reads of a stage (``autoshard.cache.ingredients``, and each node's
    inputs and modules), its blocks' names as their positions, hashed."""
    h = hashlib.sha256()
    wiring = repr([(list(n.inputs), [v[0] for v in (n.fx_node.meta.get("nn_module_stack") or {}).values()])
                   for n in graph.nodes])
    for text in [*ingredients(graph, mesh_shape, options), wiring]:
        h.update(_to_positions(text, names).encode())
    return h.hexdigest()


def renamed(plan, source: tuple, names: tuple):
    """``plan``, made for the stage of ``source`` (its blocks and inputs), for the alike stage of
    ``names``: every name in it moved from one block (or input) to the one at its place. Its
    alternatives (``explain``) are renamed when read."""
    if source == names:
        return plan
    move = _mover(source, names)
    fields = {f.name: _rename(getattr(plan, f.name), move) for f in dataclasses.fields(plan)
              if not f.name.startswith("_")}
    return dataclasses.replace(plan, **fields, _alternatives=None, _priced=_Renamed(plan, move))


def _mover(source: tuple, names: tuple):
    cache: dict = {}

    def move(s: str) -> str:
        if s not in cache:
            cache[s] = _from_positions(_to_positions(s, source), names)
        return cache[s]
    return move


def _rename(x, move):
    if isinstance(x, str):
        return move(x)
    if isinstance(x, dict):
        return {_rename(k, move): _rename(v, move) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_rename(v, move) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _rename(getattr(x, f.name), move) for f in dataclasses.fields(x)
                                         if f.init})
    return x


class _Renamed:
    """The source plan's alternatives, renamed, where the renamed plan's are read."""

    def __init__(self, plan, move):
        self.plan, self.move = plan, move

    def alternatives(self, _plan) -> dict:
        return _rename(self.plan.alternatives, self.move)
