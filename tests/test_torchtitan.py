"""torchtitan's own models in the suite (issue 32, point 5): Llama 3, Qwen3 dense and MoE, and
DeepSeek-V3 (MoE + multi-head latent attention), from torchtitan 0.3.0's model code and config
classes (tests/models_torchtitan.py), with attention on SDPA and on FlexAttention (torchtitan's
default, with its block-causal document mask).

For each: it captures; every op has a rule, none carrying compute falls back on (4,) (the coverage
report), and what runs whole is cheap; and in a gloo group of 4 it computes what one device
computes, the loss, every token's loss and every parameter's gradient, under the solver's plan
on (4,) and on (2, 2) for compute slow enough that it splits the work, and for the mixtures also
with the experts and their sorted rows pinned split on axis 0 or on axis 1 of (2, 2) (expert
parallelism: rows exchanged by all-to-all), and with the routing's sort and counts pinned split
over both axes (``runtime.scans``: a counting sort, running sums plus the earlier ranks' totals). On a CPU FlexAttention runs forward only: those
models are compared in inference (loss and every token's loss), on (2, 2).

torchtitan multiplies its experts in bf16, so the mixtures are compared at bf16's tolerance
(``BF16_TOL``), the dense models at fp32's.

What runs whole on every rank for want of a split: with FlexAttention, the block mask's making
from the positions (``arange``, ``full``, ``index_put``, ``unsqueeze`` of index tensors of at most
batch x sequence, 4 x 32). The routing's ``argsort`` of the (token, expert) pairs and the
``cumsum`` of the per-expert counts (1-D: 256 and 8 long) have split forms, but the solver keeps
them whole here, as it should: split, the sort costs three collectives (the ranges, the
histograms, the all-to-all: 60 us of latency on the slow cluster's links) against well under a
microsecond of sorting 256 integers, its consumers take the order whole (``experts.gather_rows``),
and the grouped matmul takes the offsets whole.

torchtitan is installed by the README's test command and .ci/run (``--no-deps``: it pins a
nightly torch); where it is missing this module is skipped, which only an environment other than
the project's own test command can meet.
"""
import time
import warnings

import pytest
import torch
import torch.nn as nn

pytest.importorskip("torchtitan", reason="installed by the README's test command (pip install --no-deps torchtitan)")

import autoshard  # noqa: E402
from autoshard.api import plan_graph  # noqa: E402
from autoshard.options import PlanOptions  # noqa: E402
from autoshard.passes.capture import capture  # noqa: E402
from autoshard.report.coverage import coverage_of, is_compute_op  # noqa: E402
from autoshard.testing.launch import LocalWorld  # noqa: E402
from cases import by_case, rel_err, run_each  # noqa: E402
import models_torchtitan as titan  # noqa: E402

pytestmark = pytest.mark.long("torchtitan's 4 models, planned and run on 4 ranks in 16 layouts: about 2 minutes on 2 cores")

TOL = 1e-5   # relative to the magnitude: cases.rel_err
# torchtitan computes its experts in bf16 (GroupedExperts casts the rows and the weights to bf16
# and multiplies them with torch._grouped_mm): a plan that splits an expert matmul's contracted
# dim sums bf16 partial products, and the CPU's grouped matmul rounds its bf16 result by how many
# rows each expert has on the rank, so the mixtures' numbers move by bf16's last place (2^-8 of a
# value; measured: a token's loss by up to 1.7e-3 of the largest, a gradient by 1.4e-3). Even
# with the products in fp32 (through torchtitan's seam for them, GroupedExperts._grouped_mm) the
# rows are cast to bf16 first, where a last-bit difference upstream (an attention split) can round
# to the next bf16 value, and the backward rounds each rank's partial gradient to bf16 at the
# same casts: measured there, a token's loss 1.9e-5, an expert weight's gradient 1.2e-4. A wrong
# program (rows taken from the wrong chunk, a partial sum left out) is off by a fraction of the
# magnitude itself, as the 2-axis routing bug was (a token's loss off by 0.23 of about 6: 4e-2)
BF16_TOL = 1e-2
# Where the plan splits an expert matmul's contracted dim on one axis and its columns on the other
# (the solver's (2, 2) plan for Qwen3-MoE, and the routing pinned split over both axes, whose
# plan the solver completes the same way), every rank rounds its bf16 partial product before the
# sum: measured 2026-11-29, a token's loss 4.0e-3 and the embedding's gradient 8.4e-3 of their
# magnitudes (the same layout exact in fp32: tests/test_moe_axes.py), where the experts held
# whole per rank give 3.8e-5 and 5e-4. Bounded at 2e-2, half the 2-axis routing bug's 4e-2
BF16_SPLIT_TOL = 2e-2
# ops that may run whole on every rank for want of a split: with FlexAttention, the block mask
# made from the positions (index tensors of at most batch x sequence)
CHEAP = {"arange.default", "arange.start", "full.default", "index_put.default", "unsqueeze.default"}
# compute this slow next to the links makes the solver split the work of models this small
SLOW = autoshard.Cluster(name="slow-compute", peak_flops=2e9, peak_flops_fp32=1e9, memory_bandwidth=4e9)
# the routing's sort and counts pinned split over both axes (the solver keeps them whole at these
# sizes: the module's docstring says why)
ROUTING = "routing"
ROUTING_OPS = ("argsort.stable", "cumsum.default")
TIME_LIMIT = 600.0   # only keeps a loaded machine from stopping the solver planless
LAYOUTS = {"4": ((4,), None), "2x2": ((2, 2), None), "2x2-ep0": ((2, 2), 0), "2x2-ep1": ((2, 2), 1),
           "2x2-routing": ((2, 2), ROUTING)}
# expert parallelism for the mixtures only; FlexAttention on (2, 2) only (the mixture is the same
# whichever the attention)
CASES = ([(name, "sdpa", layout) for name in titan.CONFIGS for layout in LAYOUTS
          if name in titan.MOE or LAYOUTS[layout][1] is None]
         + [(name, "flex", "2x2") for name in titan.CONFIGS])
MODELS = list(dict.fromkeys(case[:2] for case in CASES))
# the ranks prepare the models side by side, the slowest first: FlexAttention's, then the mixtures
SLOWEST_FIRST = sorted(MODELS, key=lambda m: (m[1] != "flex", m[0] not in titan.MOE))


def _token_losses(logits, labels):
    return nn.functional.cross_entropy(logits.detach().flatten(0, 1).double(), labels.flatten(), reduction="none")


def _pins(graph, model, mesh, axis):
    """The experts (3-D weights) and the grouped matmuls' rows split on mesh axis ``axis``; or
    (``ROUTING``) the routing's sorts and counts split over every axis."""
    if axis is None:
        return None
    if axis == ROUTING:
        return {n.name: ("S(0)",) * len(mesh) for n in graph.nodes if n.kind == "op" and n.op_name in ROUTING_OPS}
    split = tuple("S(0)" if a == axis else "B" for a in range(len(mesh)))
    pins = {n: split for n, p in model.named_parameters() if p.dim() == 3}
    pins.update({n.name: split for n in graph.nodes if n.kind == "op" and "grouped_mm" in n.op_name})
    return pins


def _replicated(plan, graph) -> dict:
    """The plan's op nodes that run whole on every rank (every input and output broadcast on
    every axis), by whether they carry compute: name -> (op, shapes)."""
    targets = {n.name: n.target for n in graph.nodes if n.kind == "op"}
    out = {"compute": {}, "other": {}}
    for c in plan.nodes.values():
        if c.kind != "op" or not c.outputs or any(p != "B" for x in c.inputs + c.outputs for p in x):
            continue
        out["compute" if is_compute_op(targets.get(c.name)) else "other"][c.name] = (c.op, [tuple(s) for s in c.shapes])
    return out


def _reference(name, variant) -> dict:
    """The model on one device. torchtitan compiles flex_attention for speed; capture records
    the op itself, which one device runs uncompiled here: the same op, split or whole."""
    model, inputs = titan.build(name, variant)
    training = variant == "sdpa"
    with torch.set_grad_enabled(training), torch.compiler.set_stance("force_eager"):
        loss, logits = model(*inputs)
    if training:
        loss.backward()
    return {"loss": loss.detach(), "tokens": _token_losses(logits, inputs[2]),
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def _prepare(name, variant) -> dict:
    """One model: its reference numbers on one device, its coverage on (4,), and its plan's JSON
    for each layout (one capture for all), with the seconds planning took and what the plan
    leaves whole."""
    model, inputs = titan.build(name, variant)
    training = variant == "sdpa"
    began = time.perf_counter()
    out = {"reference": _reference(name, variant), "plans": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(model, inputs)
        cov = coverage_of(graph, (4,), training=training, model=name)
        out["compute_fallbacks"] = [(o.op, o.why, o.replicated) for o in cov.compute_fallbacks]
        out["without_rules"] = [o.op for o in cov.without_rules]
        out["replicated"] = {o.op: o.replicated for o in cov.fallbacks}
        for layout, (mesh, axis) in LAYOUTS.items():
            if (name, variant, layout) not in CASES:
                continue
            start = time.perf_counter()
            plan = plan_graph(graph, mesh, PlanOptions(cluster=SLOW, pin=_pins(graph, model, mesh, axis),
                                                       training=training, time_limit=TIME_LIMIT, verbose=False))
            out["plans"][layout] = {"json": plan.to_json(), "seconds": time.perf_counter() - start,
                                    "replicated": _replicated(plan, graph),
                                    "experts": sorted({tuple(v) for k, v in plan.params.items() if "w1_EFD" in k})}
    out["seconds"] = time.perf_counter() - began
    return out


def prepare_share(models):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for model in sorted(models, key=SLOWEST_FIRST.index)[rank::world]:
        try:
            out[model] = _prepare(*model)
        except Exception as e:  # noqa: BLE001 - reported by the model's tests
            out[model] = {"error": f"{type(e).__name__}: {e}"}
    return out


def run_case(name, variant, layout, planned, reference) -> dict:
    """One forward (and on SDPA backward) of the model parallelized by the plan's JSON, against
    the single device's numbers."""
    model, inputs = titan.build(name, variant)
    training = variant == "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autoshard.parallelize(model, inputs, plan=autoshard.Plan.from_json(planned))
    with torch.set_grad_enabled(training):
        loss, logits = pm(*inputs)
    res = {"loss": rel_err(loss, reference["loss"]), "tokens": rel_err(_token_losses(logits, inputs[2]),
                                                                        reference["tokens"])}
    res["experts_calls"] = [ln for ln in pm.program.splitlines() if "autoshard_runtime_experts_grouped_mm(" in ln]
    res["scans_calls"] = [ln for ln in pm.program.splitlines() if "autoshard_runtime_scans_" in ln]
    res["grads"] = {}
    if training:
        loss.backward()
        res["grads"] = {n: rel_err(p.grad.full_tensor(), reference["grads"][n]) if p.grad is not None else None
                        for n, p in pm.named_parameters()}
    return res


@pytest.fixture(scope="module")
def world4():
    w = LocalWorld(4, timeout_s=TIME_LIMIT + 300)
    yield w
    w.close()


@pytest.fixture(scope="module")
def results(world4):
    """Two calls to the group: the ranks prepare the models side by side (each its share: the
    reference, the coverage, every layout's plan), then every rank runs every case."""
    shares = world4.run(prepare_share, MODELS)
    prepared = {model: prep for share in shares for model, prep in share.items()}
    todo = [c for c in CASES if "error" not in prepared[c[:2]]]
    per_rank = world4.run(run_each, run_case, [(*c, prepared[c[:2]]["plans"][c[2]]["json"],
                                                prepared[c[:2]]["reference"]) for c in todo])
    runs = by_case(todo, per_rank)
    return {"prepared": prepared, "runs": runs}


def _ids(cases):
    return ["-".join(c) for c in cases]


@pytest.mark.parametrize("name,variant,layout", CASES, ids=_ids(CASES))
def test_matches_single_device(results, name, variant, layout):
    prep = results["prepared"][name, variant]
    assert "error" not in prep, prep["error"]
    tol = (BF16_SPLIT_TOL if layout in ("2x2", "2x2-routing") else BF16_TOL) if name in titan.MOE else TOL
    for r, res in enumerate(results["runs"][name, variant, layout]):
        assert "error" not in res, f"rank {r}: {res['error']}"
        assert res["loss"] < tol and res["tokens"] < tol, (r, res["loss"], res["tokens"])
        if variant == "sdpa":
            assert len(res["grads"]) > 10 and None not in res["grads"].values(), res["grads"]
            bad = {n: e for n, e in res["grads"].items() if not e < tol}
            assert not bad, f"rank {r}: gradients differ: {bad}"
    plan = prep["plans"][layout]
    axis = LAYOUTS[layout][1]
    layers = sum(n.endswith("w1_EFD") for n in prep["reference"]["grads"])
    calls = results["runs"][name, variant, layout][0]["scans_calls"]
    if axis == ROUTING:   # a counting sort and a running sum over both axes in every expert layer
        assert sum("scans_sort(" in ln for ln in calls) == sum("scans_cumsum(" in ln for ln in calls) == layers, calls
        assert all("axis = (0, 1)" in ln for ln in calls), calls
    elif axis is not None:   # the experts held as pinned, their rows exchanged by all-to-all on that axis
        assert plan["experts"] == [tuple("S(0)" if a == axis else "B" for a in range(2))], plan["experts"]
        calls = results["runs"][name, variant, layout][0]["experts_calls"]
        assert len(calls) == 3 * layers, calls
        assert all(f", ({axis},), ({axis},), " in ln for ln in calls), calls


@pytest.mark.parametrize("name,variant", MODELS, ids=_ids(MODELS))
def test_no_compute_runs_replicated(results, name, variant):
    """Every op has a rule, none carrying compute falls back on (4,), and what does run whole
    is cheap."""
    prep = results["prepared"][name, variant]
    assert "error" not in prep, prep["error"]
    assert not prep["without_rules"], prep["without_rules"]
    assert not prep["compute_fallbacks"], prep["compute_fallbacks"]
    # what may run whole: the routing's sort and counts, and FlexAttention's mask making
    assert set(prep["replicated"]) <= CHEAP, prep["replicated"]


# ---- torchtitan's document mask: its rule checked against the real op ------------------------------

def _titan_document_case(p_rows=4):
    """flex_attention with torchtitan's mask: ``and_masks`` (which starts from
    ``b.new_ones((), dtype=torch.bool)``) of causal and its packed-document mask
    (``q_idx <= doc_end_by_token[b, kv_idx]``)."""
    from autoshard.check.cases import flex_case
    seq = 128
    at = torch.arange(seq)
    starts = torch.tensor([[0, 20, 90], [0, 45, 128], [0, 70, 100], [0, 128, 128]][:p_rows])
    end = (torch.searchsorted(starts, at.expand(p_rows, seq).contiguous(), right=True) - 1).clamp(max=2)
    end = torch.gather(torch.cat([starts[:, 1:], torch.full((p_rows, 1), seq)], 1), 1, end) - 1

    def mask(b, h, i, j, e):
        return b.new_ones((), dtype=torch.bool) & (i >= j) & (i <= torch.ops.aten.index.Tensor(e, [b, j]))
    qkv = [torch.randn(p_rows, 4, seq, 8, dtype=torch.float64) for _ in range(3)]
    return flex_case(*qkv, mask, (end,), mask_b=p_rows)


@pytest.mark.parametrize("p", (2, 4))
def test_document_mask_splits_the_batch_and_validates(p):
    from autoshard.check.validate import signatures, validate
    from autoshard.placement import Split
    op, args, kwargs = _titan_document_case()
    sigs = signatures(op, args, kwargs)
    assert any(s.inputs[0] == Split(0) for s in sigs), sigs   # the rows split, the doc ends with them
    rep = validate([(op, args, kwargs)], p=p)
    assert rep.ok, rep.format()
    assert rep.per_op["flex_attention"] >= 2, rep.per_op
