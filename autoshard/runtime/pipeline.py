"""Running a rank's pipeline stage on torch's own engine, ``torch.distributed.pipelining``.

Each rank holds one stage, or ``v`` chunks of the blocks (``r, r + k, ...``): the program lowered
for each on the mesh of the other axes (``StageProgram``, the module a ``PipelineStage`` wraps),
run by one of torch's schedules (``Schedule1F1B``, ``ScheduleGPipe`` where there are fewer
microbatches than stages, ``ScheduleInterleaved1F1B`` over several chunks, or
``ScheduleInterleavedZeroBubble``, whose split backward runs on the parameters' shares the
program takes: ``StageProgram.parameters``). A
schedule's ``step`` runs forward and backward together; ``Runner.step`` presents it as a training
loop expects: it returns the whole batch's loss on every rank, as a tensor whose backward puts
the gradients the step made into ``param.grad`` (scaled by the gradient the loss is given, so
``(loss * c).backward()`` is exact too). Until that backward the step's gradients wait aside,
and ``param.grad`` holds what it held before the call.

What a step does around torch's schedule is done once a step, not per microbatch: each
program's parameters are looked up and their shares made once (``Shares``, ``StageProgram.begin``),
the microbatches' gradients add up on the shares and are handed on once after the schedule, and
on the CPU the ranks post the receives of the loss and of a tied parameter's gradient shares
before the schedule, so that what a rank whose schedule ended earlier sent has arrived when
theirs ends (``Runner._loss_posted``, ``Runner._ties_posted``).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from autoshard._compat import is_view, local_tensor
from autoshard.arguments import GPIPE, INTERLEAVED, ONE_F_ONE_B, SPLIT_BACKWARD, ZBV, ZERO_BUBBLE
from autoshard.runtime.grads import share_grad
from autoshard.runtime.mesh import RankMesh, active

# the tags of what a rank receives after the schedule, its receive posted before it: the loss
# from the last stage on the pipeline's group, apart from the schedule's sends (tag 0), which it
# must not take (gloo matches by tag), and a tied parameter's gradient from its other holders
LOSS_TAG, TIE_TAG = 1, 2


def schedule_name(stages: int, microbatches: int, virtual: int = 1) -> str:
    """1F1B keeps at most ``stages`` microbatches in flight; torch runs it where there are at
    least as many microbatches as stages, and GPipe (all forwards, then all backwards) else.
    With ``virtual`` chunks per rank (> 1), interleaved 1F1B, which torch runs where the
    microbatches split into its rounds (``check_schedule``)."""
    if virtual > 1:
        return INTERLEAVED
    return ONE_F_ONE_B if microbatches >= stages else GPIPE


def check_schedule(name: str, mesh_shape: tuple, microbatches: int) -> None:
    """Whether torch runs schedule ``name`` on a pipeline of ``mesh_shape[0]`` stages with
    ``microbatches``; a ValueError that says what to change where it does not."""
    k = mesh_shape[0]
    if name == ONE_F_ONE_B and microbatches < k:
        raise ValueError(f"1F1B runs at least as many microbatches as stages, {k}, not {microbatches}: pass "
                         f"microbatches= of {k} or more, or schedule='GPipe'")
    if name in (INTERLEAVED, ZERO_BUBBLE):   # the microbatches in max(1, m // k) rounds of equal size
        rounds = max(1, microbatches // k)
        if microbatches % rounds:
            fits = [m for m in range(1, 4 * k + 1) if m % max(1, m // k) == 0]
            raise ValueError(f"{name} runs {microbatches} microbatches on {k} stages in {rounds} rounds of equal "
                             f"size, and they do not split so: pass microbatches= one of {fits}, ...")


class Shares:
    """Each DTensor parameter's share, as a leaf of its own aliasing its local tensor, that a
    rank's stage programs take: the same leaf from step to step while the parameter holds the same
    local tensor (the optimizer and a checkpoint's load write into it in place). The
    microbatches' gradients add up on it, and ``Runner.step`` takes them once after the schedule
    (``take``): no hook runs per parameter per microbatch. One per rank, for all its chunks: two
    chunks holding one parameter (an embedding tied to the head on one rank) take one leaf."""

    def __init__(self):
        # id(parameter) -> (the parameter, its local tensor, its leaf): a plain dict, looked up
        # twice per parameter a step (a weak one builds a reference at every lookup); the rank's
        # module holds its parameters anyway
        self._leaves: dict = {}

    def of(self, p: torch.Tensor) -> torch.Tensor:
        local = local_tensor(p)
        if not p.requires_grad:
            return local.detach()
        hit = self._leaves.get(id(p))
        if hit is not None and hit[0] is p and hit[1] is local:
            return hit[2]
        leaf = local.detach().requires_grad_()
        self._leaves[id(p)] = (p, local, leaf)
        return leaf

    def take(self, p: torch.Tensor, divisor: int):
        """The gradient the step left on ``p``'s share, over ``divisor``, as a DTensor gradient of
        ``p`` (None where it has none: its reduction held back under no_sync); the share is left
        with none."""
        hit = self._leaves.get(id(p))
        if hit is None or hit[0] is not p or hit[2].grad is None:
            return None
        leaf = hit[2]
        g, leaf.grad = leaf.grad, None
        return share_grad(p, leaf, g.div_(divisor))


class StageProgram(nn.Module):
    """One stage's per-rank program as a module: it holds the stage's parameters (DTensor shares
    on the mesh of the other axes, under their names in the model) and takes and returns the
    tensors that cross between stages as this rank's shares of them in their crossing layouts
    (``inputs.crossing_layout``): each rank of a stage sends its own share to the rank at its
    place in the next stage, and the program converts it to and from its planned layout on the
    stage's own links (``outputs.SENT``); gradients come back the same way."""

    def __init__(self, program, held: nn.Module, slots: list, rank_mesh: RankMesh, first: bool = False,
                 last: bool = False, split_backward: bool = False, reads: tuple = (), shares: Shares = None):
        super().__init__()
        self.shares = Shares() if shares is None else shares
        self._feed = None   # the parameters' shares and the buffers, looked up once a step (``begin``)
        self._leaves = None   # under a split backward, the shares torch's weight pass reads, so too
        # the user's inputs the program takes after what crosses, by their index in the batch:
        # the schedule hands every stage the rank's whole batch as keywords (``Runner.step``)
        self.reads = tuple(reads)
        # a zero-bubble schedule runs the input gradients and the weights' apart, on the tensors
        # the program takes (its parameters' shares: ``parameters``)
        self.split_backward = split_backward
        self.held = held
        self.program = program
        self._slots = slots   # per parameter/buffer placeholder: (registry, module, attribute), or a tensor
        self.rank_mesh = rank_mesh
        self.first, self.last = first, last   # the first takes nothing from another stage; the last gives the loss
        self.calls, self.reduce_at = 0, None   # microbatches run this step; the one whose backward reduces

    def forward(self, *crossing, **batch):
        # the gradients of a step's microbatches are reduced over the stage's axes once: every
        # microbatch's backward but the last keeps its sum (the program's no_sync), and the
        # last's, run after all the others' (1F1B and GPipe alike), reduces them all
        if self.reduce_at is not None:
            self.rank_mesh.sync_grads = self.calls == self.reduce_at
        self.calls += 1
        out = self._run([*crossing, *(batch[_given(i)] for i in self.reads)])
        if self.split_backward:   # torch's weight pass detaches a stage's outputs in place, which a view cannot be
            out = [x.clone() if is_view(x) else x for x in out]
        return out[0] if len(out) == 1 else tuple(out)

    def parameters(self, recurse: bool = True):
        """The stage's parameters as torch's stage computes their gradients: under a split backward,
        the shares the program takes (``Shares``), whose gradients ``Runner`` hands to the
        parameters; else the parameters."""
        if not self.split_backward:
            yield from super().parameters(recurse)
        elif self._leaves is not None:   # within a step: twice a microbatch (the input pass, the weights')
            yield from self._leaves
        else:
            yield from self._share_leaves()

    def begin(self) -> None:
        """What every microbatch of a step feeds the program besides what crosses, found once:
        the parameters do not change between a step's microbatches."""
        self._feed = self._lookup()
        if self.split_backward:
            self._leaves = self._share_leaves()

    def end(self) -> None:
        self._feed = self._leaves = None

    def _share_leaves(self) -> list:
        return [self.shares.of(p) for p in self.held.parameters() if p.requires_grad]

    def _lookup(self) -> list:
        feed = []
        for slot in self._slots:
            if isinstance(slot, torch.Tensor):
                feed.append(slot)
            elif slot[0] == "_parameters":
                feed.append(self.shares.of(slot[1]._parameters[slot[2]]))
            else:
                feed.append(slot[1]._buffers[slot[2]])
        return feed

    def _run(self, crossing):
        feed = self._feed if self._feed is not None else self._lookup()
        with active(self.rank_mesh):
            return list(self.program(*feed, *crossing))


def _given(i: int) -> str:
    """The keyword under which the schedule hands a stage the batch's ``i``-th input."""
    return f"input{i}"


def _schedule(pipe_stages: list, microbatches: int, name: str):
    """torch's schedule ``name`` for a rank's stages (``arguments.SCHEDULES``)."""
    from torch.distributed import pipelining
    kind = getattr(pipelining, "Schedule" + name)
    # the gradients are scaled where they land, on the parameters after the step (Runner.step)
    if name in (INTERLEAVED, *SPLIT_BACKWARD):   # the schedules of several stages per rank
        return kind(pipe_stages, n_microbatches=microbatches, loss_fn=_given_loss, scale_grads=False)
    return kind(pipe_stages[0], n_microbatches=microbatches, loss_fn=_given_loss, scale_grads=False)


def _given_loss(output, target):
    """The last stage's program computes the loss itself: the schedule's loss is its output."""
    return output


class Runner:
    """A rank's stages and schedule (torch's, by name), and what one call needs around them.
    ``chunks``: per stage the rank runs, ``(StageProgram, stage index, what it takes, what it
    gives)``; more than one (chunks ``r, r + k, ...``) run by an interleaved schedule."""

    def __init__(self, chunks: list, k: int, microbatches: int, pipe_group, last_rank: int, device, ties: list,
                 loss_dtype: torch.dtype, holder: nn.Module, schedule: str):
        from torch.distributed.pipelining import PipelineStage
        self.modules = [c[0] for c in chunks]
        n = k * len(chunks)
        self.microbatches = microbatches
        self.first, self.last = chunks[0][1] == 0, chunks[-1][1] == n - 1
        self.group, self.last_rank, self.device = pipe_group, last_rank, device
        self.holder = holder   # the parameters of every stage the rank runs, by their names in the model
        self.loss_dtype = loss_dtype   # the last stage's (bf16 under a policy): every rank returns it so
        self.ties = ties   # [(parameter name, process group of its holders, same placements)]
        # what each takes and gives, given: nothing runs to find them out
        self.pipe_stages = [PipelineStage(module, s, n, device, input_args=takes, output_args=gives, group=pipe_group)
                            for module, s, takes, gives in chunks]
        self.schedule, self.schedule_name = _schedule(self.pipe_stages, microbatches, schedule), schedule
        self.held_back = False   # whether the last step ran under no_sync
        self.shares = self.modules[0].shares   # every chunk's: ``pipelined`` hands them one
        self.others = [r for r in dist.get_process_group_ranks(pipe_group) if r != dist.get_rank()]
        self.tie_ranks = {name: dist.get_process_group_ranks(group) for name, group, _ in ties}

    def no_sync(self):
        """Every stage's gradients kept unreduced inside (``RankMesh.no_sync``)."""
        stack = contextlib.ExitStack()
        for module in self.modules:
            stack.enter_context(module.rank_mesh.no_sync())
        return stack

    def named_params(self) -> list:
        return list(self.holder.named_parameters())

    def step(self, inputs: list) -> torch.Tensor:
        """Forward and backward of the whole batch ``inputs`` (the first stage's, split into the
        microbatches along dim 0); the mean of the microbatches' losses on every rank, whose
        backward places the gradients."""
        named = self.named_params()
        losses: list = []
        target = torch.zeros(self.microbatches, device=self.device) if self.last else None
        batch = self._batch(inputs)
        synced = self.modules[0].rank_mesh.sync_grads   # False under no_sync: no microbatch reduces
        for module in self.modules:
            module.calls, module.reduce_at = 0, self.microbatches - 1 if synced else None
            module.begin()
        # a schedule that raises leaves these receives unmatched, as it leaves its own sends: a
        # pipeline whose step failed is not run again
        posted, tied = self._loss_posted(), self._ties_posted()
        try:   # the microbatches' gradients added up on the shares, taken once after them
            self.schedule.step(target=target, losses=losses, return_outputs=False, **batch)
        finally:
            for module in self.modules:
                module.end()
                module.reduce_at, module.rank_mesh.sync_grads = None, synced
        loss = self._whole_loss(losses, posted)
        # the microbatches' mean (torch scales only the gradients it sees on the parameters, and
        # these are on the shares), kept aside from ``param.grad`` until the loss's backward
        made = {n: self.shares.take(p, self.microbatches) for n, p in named}
        self._sum_tied(made, tied)
        anchor = torch.zeros((), device=self.device, requires_grad=True)
        # a step under no_sync keeps its gradients' sums in the program, and the next synced step
        # hands them on with its own: neither can scale them by its loss's gradient
        held = not synced or self.held_back
        self.held_back = not synced
        return _Placed.apply(anchor, loss, [p for _, p in named], [made[n] for n, _ in named], held)

    def evaluate(self, inputs: list) -> torch.Tensor:
        """The whole batch's loss on every rank, forward only."""
        if self.schedule_name == ZBV:
            raise ValueError("a pipeline under ZBVZeroBubble does not evaluate: torch's ScheduleZBVZeroBubble.eval "
                             "fails where the V turns on a rank (it hands on a backward it did not run). Evaluate a "
                             "copy parallelized with schedule='InterleavedZeroBubble', or train under that schedule")
        losses: list = []
        target = torch.zeros(self.microbatches, device=self.device) if self.last else None
        for module in self.modules:
            module.begin()
        posted = self._loss_posted()
        try:
            with torch.no_grad():
                self.schedule.eval(target=target, losses=losses, return_outputs=False, **self._batch(inputs))
        finally:
            for module in self.modules:
                module.end()
        return self._whole_loss(losses, posted)

    def _loss_posted(self):
        """On the CPU, a rank without the last stage posts the receive of the step's loss before
        the schedule runs: the last stage ends its schedule first under 1F1B and sends it, and the
        loss has arrived when this rank's schedule ends, where a broadcast after it waits for
        the last rank to end too and costs every rank a round of messages. (buffer, work), or None:
        elsewhere the loss is broadcast after the schedule (a receive posted on a GPU would hold a
        kernel on its stream through the schedule's sends)."""
        if self.last or self.device.type != "cpu":
            return None
        buf = torch.empty((), dtype=self.loss_dtype, device=self.device)
        return buf, dist.irecv(buf, src=self.last_rank, group=self.group, tag=LOSS_TAG)

    def _ties_posted(self) -> list:
        """Per tied parameter (``ties``), on the CPU where its holders' shares have one layout: the
        receives of the other holders' shares of its gradient, posted before the schedule, {rank:
        (buffer, work)}: a holder whose schedule ends first (the head's, under 1F1B) has sent its
        share when the last holder's ends, which then waits for no one. Else None: all-reduced."""
        posted = []
        for name, group, same in self.ties:
            if not same or self.device.type != "cpu":
                posted.append(None)
                continue
            like = local_tensor(self.holder.get_parameter(name))
            parts = {}
            for r in self.tie_ranks[name]:
                if r != dist.get_rank():
                    buf = torch.empty(like.shape, dtype=like.dtype, device=like.device)
                    parts[r] = buf, dist.irecv(buf, src=r, group=group, tag=TIE_TAG)
            posted.append(parts)
        return posted

    def _whole_loss(self, losses: list, posted) -> torch.Tensor:
        """The mean of the microbatches' losses, on every rank (the last stage's, sent to the others)."""
        if posted is not None:
            return _arrived(posted)
        if losses:
            loss = torch.stack([x.detach() for x in losses]).mean().reshape(())
        else:
            loss = torch.zeros((), dtype=self.loss_dtype, device=self.device)
        if self.device.type != "cpu":
            dist.broadcast(loss, src=self.last_rank, group=self.group)
        elif self.last:   # to the ranks that posted their receives
            sends = [dist.isend(loss, dst=r, group=self.group, tag=LOSS_TAG) for r in self.others]
            for work in sends:
                work.wait()
        return loss

    def _batch(self, inputs: list) -> dict:
        """The inputs of the whole batch the rank's stages read, as the keywords the schedule
        splits into microbatches and hands every stage (``StageProgram.reads``)."""
        return {_given(i): inputs[i] for i in sorted({i for module in self.modules for i in module.reads})}

    def _sum_tied(self, grads: dict, posted: list) -> None:
        """A parameter two stages use (an embedding tied to the head) is held by both, each
        with its own stage's share of the gradient: summed over its holders, both step alike.
        ``posted``: per tie, the other holders' shares on their way (``_ties_posted``), or None."""
        for (name, group, same), parts in zip(self.ties, posted):
            g = grads.get(name)
            p = self.holder.get_parameter(name)
            if g is None:   # this stage's part of it had no gradient: its holders still all take part
                g = grads[name] = torch.zeros_like(p)
            if parts is not None:
                mine = local_tensor(g)
                out = mine.contiguous()
                for work in [dist.isend(out, dst=r, group=group, tag=TIE_TAG) for r in parts]:
                    work.wait()
                # summed in the holders' rank order on every holder: each has the same sum
                total = None
                for r in sorted([*parts, dist.get_rank()]):
                    x = out if r == dist.get_rank() else _arrived(parts[r])
                    total = x.clone() if total is None else total.add_(x)
                mine.copy_(total)
            elif same:
                dist.all_reduce(g.to_local(), group=group)
            else:
                from torch.distributed.tensor import distribute_tensor
                whole = g.full_tensor()
                dist.all_reduce(whole, group=group)
                g.to_local().copy_(distribute_tensor(whole, g.device_mesh, g.placements, src_data_rank=None).to_local())


def _arrived(posted) -> torch.Tensor:
    buf, work = posted
    work.wait()
    return buf


class _Placed(torch.autograd.Function):
    """The step's loss; its backward adds the step's gradients, times the loss's gradient, to
    the parameters' (the schedule ran backward already: nothing flows further)."""

    @staticmethod
    def forward(ctx, anchor, loss, params, made, held):
        ctx.held = (params, made, held)
        return loss.clone()

    @staticmethod
    def backward(ctx, g):
        params, made, held = ctx.held
        scale = float(g)
        if held and scale != 1.0:
            raise RuntimeError("a pipeline's steps under no_sync (and the step after them) take the loss's backward "
                               "unscaled: call loss.backward(), and scale the learning rate instead")
        for p, d in zip(params, made):
            if d is None:
                continue
            d = d if scale == 1.0 else d * scale
            p.grad = d if p.grad is None else p.grad + d
        return None, None, None, None, None
