"""One training step's time, from the parts each choice adds.

Compute and the communication that compute waits for (activation conversions) add up. The
parameter collectives that the schedule pass starts early and waits on late (gradient all-reduce
buckets, parameter gathers and their reduce-scatters) run beside the compute of their phase and
cost only what that compute does not cover:

    step = compute_fwd + compute_bwd + comm
           + max(0, hidden_fwd - compute_fwd) + max(0, hidden_bwd - compute_bwd)
           + DRAG * (hidden_fwd + hidden_bwd) + optimizer

``optimizer`` is the optimizer's step over this rank's parameter shares, after backward's
collectives are done; only a measured cluster prices it (``Cluster.optimizer``).

Overlapped communication is not quite free: its kernels take memory bandwidth and SMs from the
compute beside it (a few percent in NCCL measurements), which ``DRAG`` charges. It also makes the
plan that moves fewer bytes win between two whose communication hides completely (data parallel
over FSDP when memory allows). The solver keeps the two max terms linear with one variable each
(``planner.solve``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

DRAG = 0.03


@dataclass(frozen=True)
class Cost:
    compute_fwd: float = 0.0
    compute_bwd: float = 0.0
    comm: float = 0.0         # communication compute has to wait for
    hidden_fwd: float = 0.0   # forward communication the schedule overlaps with forward compute
    hidden_bwd: float = 0.0   # backward communication overlapped with backward compute
    optimizer: float = 0.0    # the optimizer's step over this rank's parameter shares

    def __init__(self, compute_fwd: float = 0.0, compute_bwd: float = 0.0, comm: float = 0.0,
                 hidden_fwd: float = 0.0, hidden_bwd: float = 0.0, optimizer: float = 0.0):
        # one update of the instance's dict, where a frozen dataclass's own __init__ sets each
        # field through object.__setattr__: the planner makes millions
        self.__dict__.update(compute_fwd=compute_fwd, compute_bwd=compute_bwd, comm=comm, hidden_fwd=hidden_fwd,
                             hidden_bwd=hidden_bwd, optimizer=optimizer)

    def __add__(self, other: "Cost") -> "Cost":
        # part by part, written out: the planner adds millions of these
        return Cost(self.compute_fwd + other.compute_fwd, self.compute_bwd + other.compute_bwd,
                    self.comm + other.comm, self.hidden_fwd + other.hidden_fwd,
                    self.hidden_bwd + other.hidden_bwd, self.optimizer + other.optimizer)

    @property
    def compute(self) -> float:
        return self.compute_fwd + self.compute_bwd

    @property
    def communication(self) -> float:
        return self.comm + self.hidden_fwd + self.hidden_bwd

    @property
    def exposed(self) -> float:
        """Communication the step waits for, and the drag of what overlaps."""
        return (self.comm + max(0.0, self.hidden_fwd - self.compute_fwd)
                + max(0.0, self.hidden_bwd - self.compute_bwd) + DRAG * (self.hidden_fwd + self.hidden_bwd))

    @property
    def step(self) -> float:
        return self.compute + self.exposed + self.optimizer


PARTS = tuple(f.name for f in fields(Cost))
