"""The optimizer step over autoshard's parameters.

Each parameter is a DTensor, and every op on a DTensor pays DTensor's dispatch (tens of
microseconds in Python) before the local kernel runs. torch's optimizers left to their default
(``foreach=None``, ``fused=None``) take the for-loop path on devices without foreach kernels (the
CPU): about a dozen ops per parameter per step, each dispatched, which costs AdamW on a 4-block
GPT 100 ms against 14-20 ms on plain tensors. So an optimizer left to its default steps
autoshard's parameters by a path that dispatches once per op for all of them:

    Adam, AdamW              the fused kernel: every update of a parameter in one pass while it
                             is in cache (on the CPU 4 ms on that GPT; the foreach path streams
                             every parameter through memory once per op, 17 ms), and on a GPU
                             one DTensor dispatch for the step instead of one per foreach op
                             (on an H200 the foreach path, torch's default there, took 5 ms
                             for a 4-block GPT whose forward took 4)
    the others               the foreach path

A choice the user made (``foreach=``, ``fused=``, ``differentiable=True``) is kept, and an
optimizer whose state was loaded before its first step keeps the foreach path (the fused one
keeps its step counts differently).

The switch is made in a global step pre-hook (``torch.optim.optimizer``'s public
``register_optimizer_step_pre_hook``), once per parameter group, and only for the optimizers
whose path DTensor runs as their for-loop path does (tests/test_parallel.py checks each).
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# optimizers whose foreach step over DTensors equals their for-loop step (Rprop's needs
# _foreach_copy_, which DTensor has no rule for; Adafactor has no foreach path)
FOREACH_SAFE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
                torch.optim.Adagrad, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax,
                torch.optim.Adadelta)
# and those whose fused kernel DTensor runs (it has no rule for SGD's or Adagrad's)
FUSED_SAFE = (torch.optim.Adam, torch.optim.AdamW)

MARK = "_autoshard_parameter"
# on a parameter ``parallelize`` replaced by its share: the name it had in the model
REPLACED = "_autoshard_replaced"
_hook = None


def adopt(params) -> None:
    """Mark ``params`` (autoshard's DTensor parameters) for the faster step."""
    for p in params:
        setattr(p, MARK, True)
    _hook_once()


def retire(param, name: str) -> None:
    """Mark ``param``, which ``parallelize`` replaced in the model by its share: an optimizer
    built before then holds it, gets no gradient for it and would step nothing, silently; its
    step raises instead (``_step_pre_hook``)."""
    setattr(param, REPLACED, name)
    _hook_once()


def _hook_once() -> None:
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_step_pre_hook)


def _step_pre_hook(optimizer, args, kwargs) -> None:
    stale = [getattr(p, REPLACED) for group in optimizer.param_groups for p in group["params"]
             if hasattr(p, REPLACED)]
    if stale:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() on {len(stale)} parameters that autoshard.parallelize replaced "
            f"by their shares (such as {stale[0]!r}): this optimizer was built before parallelize and would "
            "train nothing. Build it after parallelize, from the parallel module's parameters "
            "(`torch.optim.AdamW(module.parameters())`), as with FSDP2's fully_shard")
    _choose_path(optimizer)


def _choose_path(optimizer) -> None:
    if type(optimizer) not in FOREACH_SAFE:
        return
    for group in optimizer.param_groups:
        if group.get("foreach", False) is not None or group.get("fused") or group.get("differentiable"):
            continue   # the user chose, or already switched
        params = group["params"]
        if not params or not all(getattr(p, MARK, False) for p in params):
            continue
        fresh = not any(optimizer.state.get(p) for p in params)
        if type(optimizer) in FUSED_SAFE and fresh and all(p.device.type in ("cpu", "cuda") for p in params):
            group["fused"] = True
        else:
            group["foreach"] = True
