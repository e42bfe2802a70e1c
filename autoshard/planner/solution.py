"""What a solve answers: a plan with its bound (``Solution``), or why there is none."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Solution:
    choice: dict        # node name -> index into its strategies
    objective: float    # seconds
    bound: Optional[float]   # seconds, proven lower bound; None when nothing is proven (planner.descend)
    status: str
    seconds: float      # wall time of the solve
    recompute: dict = field(default_factory=dict)   # block group -> how many of its blocks recompute (planner.recompute)

    @property
    def gap(self) -> Optional[float]:
        if self.bound is None:
            return None
        return 0.0 if self.objective <= 0 else max(0.0, (self.objective - self.bound) / self.objective)


class MemoryBudgetError(ValueError):
    """No layout fits the memory budget; the message says what the model can reach."""


class NoPlanInTime(RuntimeError):
    """The solver stopped at its time limit with no plan at all (not even a proof that none fits)."""


class NoBetterPlan(Exception):
    """``solve(..., below=...)`` found no plan under the cost it was asked to beat: proven
    (``proven``), or none found within the time limit."""

    def __init__(self, proven: bool):
        super().__init__("proven" if proven else "none found in time")
        self.proven = proven

    def __reduce__(self):   # carried back from a forked copy of a mesh search (planner.fanout)
        return NoBetterPlan, (self.proven,)
