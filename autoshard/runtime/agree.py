"""Every rank must call ``parallelize`` alike: the same plan (or none), mesh and options, the same
whole batch, the same model. Ranks that do not would deadlock in a collective one of them never
issues, or run a program planned for another rank's shapes, or (with the same shapes but another
batch) compute a wrong answer without a word. So before the first collective that depends on
them, every rank sends a small summary of what it was given (``all_gather_object`` on the
default group, a few hundred bytes), and all raise at once, saying which ranks differ in what.
This happens when a module is made and when a program is built (the first call, or new
shapes); the steps after pay nothing.

A rank that never arrives is not a disagreement this can see: with ``parallelize(timeout=)`` on
gloo, a ``monitored_barrier`` first names the ranks that did not come within that time."""
from __future__ import annotations

import datetime
import hashlib
import warnings

import torch
import torch.distributed as dist


def from_first_rank(make):
    """``make()`` run on rank 0 alone and its (picklable) result handed to every rank, so that no
    two ranks can disagree; where it raises, every rank raises it (a ValueError or TypeError as
    itself, anything else as a RuntimeError), with its message."""
    msg = [None]
    if dist.get_rank() == 0:
        try:
            msg[0] = ("ok", make())
        except Exception as e:  # noqa: BLE001 - sent to every rank, raised there too
            msg[0] = ("error", type(e).__name__, str(e))
    dist.broadcast_object_list(msg, src=0)
    if msg[0][0] == "error":
        _, kind, text = msg[0]
        raise {"ValueError": ValueError, "TypeError": TypeError}.get(kind, RuntimeError)(text)
    return msg[0][1]


def digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def checksum(t: torch.Tensor) -> tuple:
    """Two sums of a tensor's values, the second weighted by position, computed where the tensor
    lives: enough to tell two ranks' batches or weights apart, and cheap beside planning."""
    if t.device.type == "meta" or t.numel() == 0:
        return (tuple(t.shape),)
    x = t.detach().reshape(-1).to(torch.float64)
    w = torch.arange(x.numel(), device=x.device, dtype=torch.float64).remainder_(7).add_(1)
    return round(float(x.sum()), 6), round(float((x * w).sum()), 6)


def _ranks(values: list, key) -> dict:
    """{value: [ranks]} of ``key`` over the gathered summaries, in rank order."""
    out: dict = {}
    for rank, summary in enumerate(values):
        out.setdefault(repr(summary[key]), []).append(rank)
    return out


def gather(summary: dict, timeout=None) -> list:
    """Every rank's ``summary``, after a barrier that names absent ranks (gloo, with a timeout)."""
    if timeout is not None and dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            raise RuntimeError(f"autoshard.parallelize: not every rank arrived within timeout={timeout:g} s "
                               f"(call it on every rank of the group):\n{e}") from e
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, summary)
    return out


# what each field of a summary is, and what every rank should pass instead
ADVICE = {
    "plan": "pass plan= on every rank, the same Plan (Plan.from_json of one text), or on none",
    "mesh": "pass the same mesh= (or world=) on every rank",
    "options": "pass the same planning options (cluster, pin, time_limit, ...) on every rank",
    "overlap": "pass the same overlap= on every rank",
    "model": "build the same model on every rank (the same modules, parameter names and shapes)",
    "training": "call every rank's module in the same mode (model.train() or model.eval() on all)",
    "shapes": "give every rank the same whole batch: autoshard splits it, each rank takes its share",
    "constants": "pass the same non-tensor arguments on every rank",
    "values": "give every rank the same whole batch (the same values): autoshard splits it, each rank "
              "takes its share, so each rank's own batch would be a wrong answer without an error",
}


def check(summary: dict, where: str, timeout=None) -> None:
    """Raise a ValueError on every rank if the ranks' ``summary`` differ, naming the field, the
    ranks on each side and what to pass. A field ``weights`` that differs only warns: the
    parameters are taken from rank 0, as the README says."""
    summaries = gather(summary, timeout)
    for key in summary:
        groups = _ranks(summaries, key)
        if len(groups) < 2:
            continue
        sides = "; ".join(f"ranks {ranks} have {value if len(value) < 200 else value[:200] + '...'}"
                          for value, ranks in groups.items())
        if key == "weights":
            differ = sorted(n for n in summary[key] if len({repr(s[key].get(n)) for s in summaries}) > 1)
            warnings.warn(f"autoshard.parallelize: the ranks' initial values of {differ[:5]}"
                          f"{' and more' if len(differ) > 5 else ''} differ; every rank takes rank 0's "
                          "(seed every rank alike, or load the weights on every rank, to silence this)")
            continue
        raise ValueError(f"autoshard.parallelize: the ranks disagree at {where} on {key}: {sides}. "
                         f"{ADVICE[key].capitalize()}.")


def layout_digest(plan) -> str:
    """What of a plan makes the program: its layouts, shapes, mode and schedule options, not its
    timings (two ranks that plan alike differ in the seconds the solver took) or priced costs (a
    cluster each rank measured for itself)."""
    nodes = [(c.name, c.kind, c.op, c.shapes, c.inputs, c.outputs) for c in plan.nodes.values()]
    params = sorted((k, list(v)) for k, v in plan.params.items())
    import json     # lists and tuples alike: a plan read back from JSON is the same plan
    return digest(json.dumps([list(plan.mesh_shape), params, plan.training, plan.schedule, nodes], sort_keys=True))


def check_call(model, plan, mesh_shape, overlap, plan_kwargs, timeout=None, inputs="whole") -> None:
    """At ``parallelize``, before the mesh's groups are made: the plan, mesh, options and model."""
    check({"plan": None if plan is None else layout_digest(plan), "mesh": tuple(mesh_shape),
           "options": digest(repr(sorted(plan_kwargs.items()))), "overlap": overlap, "inputs": inputs,
           "model": digest(repr([(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]))},
          "parallelize", timeout)


def check_inputs(model, leaves, shapes, consts, distributed: bool, timeout=None) -> None:
    """Before a program is planned and built: the mode and the batch, and (before the parameters
    are distributed from rank 0) their values."""
    described = ", ".join(f"{list(s)} {str(d).replace('torch.', '')}" for s, d in shapes)
    summary = {"training": model.training, "shapes": f"inputs of shapes {described}", "constants": consts,
               "values": [checksum(x) for x in leaves if isinstance(x, torch.Tensor)]}
    if not distributed:
        summary["weights"] = {n: checksum(p) for n, p in model.named_parameters()}
    check(summary, "the call that plans" if distributed else "the first call (or parallelize's example inputs)",
          timeout)
