"""autoshard: automatic parallelization of PyTorch models.

model -> fx graph (torch.export) -> SBP strategies -> ILP -> plan -> per-rank program
"""
from autoshard.api import ParallelModule, parallelize, plan
from autoshard.machine.cluster import Cluster, PRESETS
from autoshard.machine.measure import measure
from autoshard.report.coverage import Coverage, coverage
from autoshard.passes.capture import CaptureError
from autoshard.plan import Collective, Plan
from autoshard.rules.moe import expert_loads
from autoshard import schemes  # noqa: F401 - hand-designed plans as pins (DESIGN.md section 6)

__all__ = ["plan", "parallelize", "coverage", "Plan", "Collective", "Cluster", "PRESETS", "measure", "ParallelModule",
           "Coverage", "CaptureError", "expert_loads"]
__version__ = "0.1.0"
