"""The optimizer step over autoshard's parameters.

Each parameter is a DTensor, and every op on a DTensor pays DTensor's dispatch (tens of
microseconds in Python) before the local kernel runs. torch's optimizers left to their default
(``foreach=None``) take the for-loop path on devices without foreach kernels (the CPU): about a
dozen ops per parameter per step, each dispatched, which costs AdamW on a 4-block GPT 100 ms
against 20 ms on plain tensors. Their foreach path dispatches once per op for the whole list
(11 ms). So an optimizer left to its default steps autoshard's parameters by its foreach path; a
choice the user made (``foreach=False``, ``fused=True``, ``differentiable=True``) is kept.

The switch is made in a global step pre-hook (``torch.optim.optimizer``'s public
``register_optimizer_step_pre_hook``), once per parameter group, and only for the optimizers
whose foreach path DTensor runs exactly as the for-loop path (checked in tests/test_optim.py).
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# optimizers whose foreach step over DTensors equals their for-loop step (Rprop's needs
# _foreach_copy_, which DTensor has no rule for; Adafactor has no foreach path)
FOREACH_SAFE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
                torch.optim.Adagrad, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax,
                torch.optim.Adadelta)

MARK = "_autoshard_parameter"
_hook = None


def adopt(params) -> None:
    """Mark ``params`` (autoshard's DTensor parameters) for the foreach step."""
    global _hook
    for p in params:
        setattr(p, MARK, True)
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_prefer_foreach)


def _prefer_foreach(optimizer, args, kwargs) -> None:
    if type(optimizer) not in FOREACH_SAFE:
        return
    for group in optimizer.param_groups:
        if group.get("foreach", False) is not None or group.get("fused") or group.get("differentiable"):
            continue   # the user chose, or already switched
        params = group["params"]
        if params and all(getattr(p, MARK, False) for p in params):
            group["foreach"] = True
