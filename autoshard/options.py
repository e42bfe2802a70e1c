"""The planning options of ``plan`` and ``parallelize``, as one value checked once.

``autoshard.plan(model, inputs, world=..., **options)`` takes them one by one, as a user writes
them; ``PlanOptions`` is what travels from there to the planner (``api.plan_graph``,
``api.search_mesh``), to a parallel module that plans at its first call, and into the key of a
plan kept on disk (``autoshard.cache``). The pins' names and placements are checked against the
graph when it is planned; everything else here, when the options are made.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from autoshard.arguments import (GPIPE, INTERLEAVED, MAX_AXES, ONE_F_ONE_B, RECOMPUTE_MODES, SCHEDULES, ZBV, ZERO_BUBBLE,
                                 check_bool, check_budget, check_int, check_mesh, check_number)
from autoshard.machine.cluster import Cluster
from autoshard.inputs import check_inputs
from autoshard.outputs import WHOLE, check_outputs
from autoshard.precision import check_policy


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """What ``plan`` documents, option by option; the defaults are its defaults."""

    mesh: Optional[tuple] = None              # None: searched over the shapes ``world`` factors into
    cluster: Union[None, str, Cluster] = None   # None: the default preset; a preset's name; "measure"
    pin: Optional[dict] = None                # {name: placements}
    training: bool = True
    time_limit: float = 60.0                  # the solver's seconds per mesh
    bucket_bytes: Optional[int] = None        # None: chosen from the cluster's links (cost.buckets)
    memory_budget: Optional[float] = None     # bytes per device; None: the cluster's device memory
    reshard_after_forward: bool = False
    outputs: str = WHOLE
    inputs: str = WHOLE                       # "local": each rank's own rows of the batch (autoshard.inputs)
    verbose: bool = True
    recompute: str = "auto"                   # planner.recompute.AUTO: the solver chooses per block
    mp_policy: object = None                  # a torch.distributed.fsdp.MixedPrecisionPolicy
    pipeline: Optional[int] = None            # pipeline stages: None or 1, none; k, k stages (planner.pipeline)
    microbatches: Optional[int] = None        # with a pipeline: None, chosen from the batch
    virtual: int = 1                          # with a pipeline: chunks of blocks per rank; > 1, interleaved 1F1B
    schedule: Optional[str] = None            # with a pipeline: one of SCHEDULES; None, chosen (planner.pipeline)

    def __post_init__(self):
        if self.cluster is not None and not isinstance(self.cluster, (str, Cluster)):
            raise TypeError(f"cluster is an autoshard.Cluster, a preset name (autoshard.PRESETS) or 'measure', "
                            f"got {type(self.cluster).__name__}")
        pin = self.pin
        if pin is not None and (not isinstance(pin, dict) or not all(isinstance(k, str) for k in pin)):
            raise TypeError(f"pin is a dict {{name: placements}}, e.g. {{'fc1.weight': ('S(0)',)}}, got {pin!r}")
        check_bool("training", self.training)
        check_number("time_limit", self.time_limit, positive=True, hint="the solver's seconds, such as 60")
        if self.bucket_bytes is not None:
            check_int("bucket_bytes", self.bucket_bytes, low=1, hint="bytes per gradient bucket, or None to "
                      "choose it from the links")
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", check_budget(self.memory_budget))
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward is True or False, got {self.reshard_after_forward!r}")
        modes = ", ".join(map(repr, RECOMPUTE_MODES))
        if not isinstance(self.recompute, str):
            raise TypeError(f"recompute is one of {modes}, got {type(self.recompute).__name__}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute is one of {modes} (the solver chooses, none, every repeated block, every "
                             f"block's cheap ops), got {self.recompute!r}")
        check_outputs(self.outputs)
        check_inputs(self.inputs)
        if self.mesh is not None:
            object.__setattr__(self, "mesh", check_mesh(self.mesh, MAX_AXES))
        check_policy(self.mp_policy)
        self._check_pipeline()

    def _check_pipeline(self):
        """``pipeline``: None or 1 (no pipeline), or k stages; ``microbatches`` and ``virtual`` only
        with one."""
        if self.pipeline is not None:
            check_int("pipeline", self.pipeline, low=1, hint="the number of pipeline stages, such as 2, or None")
        if self.microbatches is not None:
            check_int("microbatches", self.microbatches, low=1, hint="how many microbatches a step's batch is cut "
                      "into, such as 8")
            if not self.pipelined:
                raise ValueError("microbatches= cuts the batch for a pipeline's schedule; pass pipeline=k (k > 1) with "
                                 "it, or leave it out")
        check_int("virtual", self.virtual, low=1, hint="how many chunks of blocks each pipeline rank holds, such as 2")
        if self.virtual > 1 and not self.pipelined:
            raise ValueError(f"virtual={self.virtual} interleaves chunks of a pipeline's stages; pass pipeline=k (k > 1) "
                             "with it, or leave it out")
        if self.schedule is not None:
            if self.schedule not in SCHEDULES:
                raise ValueError(f"schedule is one of {', '.join(map(repr, SCHEDULES))} (torch.distributed.pipelining's "
                                 f"schedules by name), or None to let the planner choose; got {self.schedule!r}")
            if not self.pipelined:
                raise ValueError(f"schedule={self.schedule!r} runs a pipeline; pass pipeline=k (k > 1) with it, or leave "
                                 "it out")
            if self.schedule == ZBV and self.virtual != 2:
                raise ValueError(f"schedule={ZBV!r} runs exactly two chunks per rank: pass virtual=2 with it")
            if self.virtual > 1 and self.schedule in (ONE_F_ONE_B, GPIPE):
                raise ValueError(f"schedule={self.schedule!r} runs one stage per rank, and virtual={self.virtual} makes "
                                 f"several: pass schedule={INTERLEAVED!r} or {ZERO_BUBBLE!r}, or virtual=1")

    @property
    def pipelined(self) -> bool:
        return self.pipeline is not None and self.pipeline > 1


# the names ``parallelize`` passes on to the planner (``plan``'s keyword options but ``world``)
PLAN_OPTIONS = tuple(f.name for f in dataclasses.fields(PlanOptions))
