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

An optimizer built before ``parallelize`` holds the parameters it replaced by their shares. The
same hook hands it the shares at its first step (``_take_shares``), with any state it holds
already cut to each share's layout from rank 0's, as the parameters were: it trains on as the
optimizer would have on one device. The user's parameter objects cannot become the shares
themselves: ``torch.utils.swap_tensors`` swaps a tensor's class, and CPython refuses to turn an
``nn.Parameter`` into a DTensor, whose instances have a different layout (two slots more).
State that has no share to cut, and a share the optimizer holds already, raise at that step.
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
# on a parameter ``parallelize`` replaced by its share: (the name it had in the model, the share)
REPLACED = "_autoshard_replaced"
# the state a 0-dim parameter's optimizer keeps as a plain scalar however it is placed (Adam's step
# count, ASGD's eta and mu); its other 0-dim state is per element, as a fresh optimizer's would be
SCALAR_STATE = ("step", "eta", "mu")
_hook = None


def adopt(params) -> None:
    """Mark ``params`` (autoshard's DTensor parameters) for the faster step."""
    for p in params:
        setattr(p, MARK, True)
    _hook_once()


def retire(param, name: str, share) -> None:
    """Mark ``param``, which ``parallelize`` replaced in the model (where it was ``name``) by
    ``share``: an optimizer built before then holds it, and is handed ``share`` at its step."""
    setattr(param, REPLACED, (name, share))
    _hook_once()


def _hook_once() -> None:
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_step_pre_hook)


def _step_pre_hook(optimizer, args, kwargs) -> None:
    if any(hasattr(p, REPLACED) for group in optimizer.param_groups for p in group["params"]):
        _take_shares(optimizer)
    _choose_path(optimizer)


def _take_shares(optimizer) -> None:
    """Put each share in place of the parameter it replaced in ``optimizer``'s groups (the same
    list objects: LBFGS keeps its first group's), and the state held for that parameter, cut to
    the share's layout, under the share. Everything is checked before anything changes; the
    cutting is collective (every rank steps the optimizer, in the same order of parameters)."""
    from torch.distributed.tensor import distribute_tensor
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    moves = []
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            if not hasattr(p, REPLACED):
                continue
            name, share = getattr(p, REPLACED)
            if id(share) in held:
                raise _cannot(optimizer, name, "it holds that parameter's share too, and would step it twice")
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if torch.is_tensor(value) and _cut(key, value, p) is None:
                    raise _cannot(optimizer, name, f"its state {key!r}, of shape {tuple(value.shape)}, is not one "
                                  f"value per element of the parameter (shape {tuple(p.shape)}), so it has no share "
                                  "to carry over")
                if isinstance(value, (list, tuple, dict)) and any(map(torch.is_tensor, _items(value))):
                    raise _cannot(optimizer, name, f"its state {key!r} holds tensors in a {type(value).__name__}, "
                                  "which autoshard does not know how to cut")
            moves.append((group["params"], i, p, share))
    for params, i, p, share in moves:
        state = optimizer.state.pop(p, None)
        if state:
            optimizer.state[share] = {key: distribute_tensor(value.detach(), share.device_mesh, share.placements,
                                                             src_data_rank=0)
                                      if torch.is_tensor(value) and _cut(key, value, p) else value
                                      for key, value in state.items()}
        params[i] = share


def _items(value):
    return value.values() if isinstance(value, dict) else value


def _cut(key, value, p):
    """Whether the state tensor ``value`` (under ``key``) of parameter ``p`` is cut to the share's
    layout (True: one value per element), kept whole (False: a scalar, such as a step count), or
    neither (None)."""
    if value.dim() == 0 and (p.dim() > 0 or key in SCALAR_STATE):
        return False
    return True if value.shape == p.shape else None


def _cannot(optimizer, name: str, why: str) -> RuntimeError:
    return RuntimeError(
        f"{type(optimizer).__name__}.step(): autoshard.parallelize replaced the parameter {name!r} by its share, and "
        f"this optimizer, built before, cannot be handed the share: {why}. Build the optimizer after parallelize, "
        "from the parallel module's parameters (`torch.optim.AdamW(module.parameters())`), as with FSDP2's "
        "fully_shard; its state then starts afresh")


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
