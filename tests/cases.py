"""Running many cases in one process group: each case's failure is reported by its own test while
the others still run."""
import time
import traceback


def run_each(fn, cases) -> list:
    """``fn(*case)`` for each case: its result dict, or ``{"error": traceback}``, with the
    seconds it took."""
    out = []
    for case in cases:
        start = time.perf_counter()
        try:
            out.append(fn(*case))
        except Exception:  # noqa: BLE001 - reported by the case's test; the others still run
            out.append({"error": traceback.format_exc()})
        out[-1]["seconds"] = time.perf_counter() - start
    return out


def by_case(keys, per_rank) -> dict:
    """Each case's results on every rank, by its key: ``per_rank`` (a rank's results, one per case
    in ``keys``' order, as ``run_each`` gives them) turned round."""
    return {key: [r[i] for r in per_rank] for i, key in enumerate(keys)}


def rel_err(got, want) -> float:
    """The largest difference, relative to the reference's largest magnitude where that is above 1.

    float32 rounds a value to 6e-8 of itself, and a sum (a matmul's, a gradient's over the batch)
    to a few of those of its terms' magnitude, in an order that a split, and each processor's
    BLAS and vectorized kernels, choose: an absolute bound of 1e-5 allows 80 units in the last
    place at magnitude 1 but 5 at magnitude 16, the size of a summed loss's gradients. Relative to
    the magnitude, 1e-5 allows about 80 at every magnitude, far above the few a reordering costs,
    and far below what a wrong shard, a missing reduction or a wrong step is off by: a fraction
    of the magnitude itself."""
    got, want = got.detach().double(), want.detach().double()
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def step_on_the_same_gradients(pm, ref, opt, ref_opt):
    """Step both optimizers, the reference on the parallel model's gradients (made whole).

    Call it after the gradients were compared. Adam divides by a gradient's magnitude, so where a
    gradient is near zero (attention's key bias: zero up to rounding) a last-bit difference between
    a split and a whole matmul, which varies with the processor's BLAS, becomes a difference of
    the learning rate's size. On the same gradients the two steps differ only by the rounding of
    the optimizer's elementwise arithmetic, on every machine; what is compared is then the step
    itself: each rank updating its shares as the single device updates the whole.

    The reference steps by the same kernel path as the parallel model's optimizer (autoshard moves
    an Adam left to its default onto the fused kernel, whose vectorized arithmetic rounds apart
    from the for-loop path's differently on each processor)."""
    import torch
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if p.grad is not None:
                ref_params[n].grad.copy_(p.grad.full_tensor())
    opt.step()
    for group, ref_group in zip(opt.param_groups, ref_opt.param_groups):
        for key in ("foreach", "fused"):
            if key in group and key in ref_group:
                ref_group[key] = group[key]
    ref_opt.step()


def emits(program: str, kind: str) -> bool:
    """Whether a rank's program code runs the collective step ``kind`` (all_reduce, all_gather,
    ...): called where the rewriter put it, or started early and waited on late (the schedule pass)."""
    return (f"autoshard_runtime_{kind}(" in program
            or any("autoshard_runtime_step_start(" in line and f"'{kind}'" in line for line in program.splitlines()))


def plan_facts(plan) -> dict:
    """What a test asks of a plan that trained: the ops it split, the parameters it holds split,
    and its collectives as (kind, phase, axes)."""
    return {"split": sorted({c.op for c in plan.nodes.values() if c.kind == "op"
                             and any(p.startswith("S") for out in c.outputs for p in out)}),
            "sharded_params": sorted(n for n, p in plan.params.items() if any(q.startswith("S") for q in p)),
            "collectives": sorted({(c.kind, c.phase, c.axes) for c in plan.collectives})}


def against_one_device(pm, ref, inputs) -> dict:
    """Run a model that returns (loss, logits) parallelized (``pm``) and on one device (``ref``),
    backward from each loss: the loss's, the logits' and every gradient's ``rel_err``."""
    (loss, logits), (ref_loss, ref_logits) = pm(*inputs), ref(*inputs)
    loss.backward()
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    return {"loss": rel_err(loss, ref_loss), "logits": rel_err(logits, ref_logits),
            "grads": {n: rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()}}
