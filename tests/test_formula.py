"""plan.formula: the estimated step as a sympy expression that evaluates to the plan's cost, moves
as the plan would with the sizes, and reduces to AxoNN's per-layer formulas (DESIGN.md section 6)
for AxoNN's 4-D layout."""
import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy

import autoshard
from autoshard import schemes
from autoshard.cost import axonn
from models import GPT


def gpt(batch=64, layers=2):
    with torch.device("meta"):
        model = GPT(vocab=1000, d=256, heads=4, layers=layers, seq=128)
        idx = torch.empty(batch, 128, dtype=torch.long)
    return model, (idx, idx)


def value(expr, values):
    return float(expr.subs(values))


@pytest.fixture(scope="module")
def two_d():
    model, inputs = gpt()
    return autoshard.plan(model, inputs, mesh=(2, 2))


@pytest.mark.parametrize("kw", [None, dict(mesh=(4,), training=False), dict(mesh=(4,), reshard_after_forward=True, fsdp=True),
                                dict(mesh=(4,), fsdp=True, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                                         reduce_dtype=torch.float32))],
                         ids=["2d", "inference", "fsdp-reshard", "fsdp-bf16-reduce-fp32"])
def test_formula_evaluates_to_the_plan(kw, two_d):
    model, inputs = gpt()
    kw = dict(kw or {})
    if kw.pop("fsdp", False):
        kw["pin"] = schemes.fsdp(model, inputs, kw["mesh"])
    plan = autoshard.plan(model, inputs, **kw) if kw else two_d
    expr, values = plan.formula()
    assert value(expr, values) == pytest.approx(plan.cost, rel=1e-6)
    b = plan.breakdown
    compute, cvalues = plan.formula(part="compute")
    assert value(compute, cvalues) == pytest.approx(b["compute_fwd"] + b["compute_bwd"], rel=1e-6)
    comm, kvalues = plan.formula(part="communication")
    assert value(comm, kvalues) == pytest.approx(sum(c.seconds for c in plan.collectives), rel=1e-6, abs=1e-15)
    names = {str(s) for s in cvalues}
    assert {"b", "s", "d", "M"} <= names and names & {"F", "F16"}   # fp32's peak, or bf16's under the policy
    assert cvalues[sympy.Symbol("b", positive=True, integer=True)] == 64


def test_the_formula_in_the_batch_prices_the_same_layout_at_another_batch(two_d):
    """Doubling b in the formula gives what the cost model says of the same layout planned for
    the doubled batch: the sizes are symbols, not numbers that happen to fit."""
    plan = two_d
    expr, values = plan.formula(dims={"b": 64, "s": 128, "d": 256})
    b = sympy.Symbol("b", positive=True, integer=True)
    assert b in expr.free_symbols
    model2, inputs2 = gpt(batch=128)
    pins = {name: n.outputs[0] for name, n in plan.nodes.items() if n.kind != "output" and n.outputs}
    same = autoshard.plan(model2, inputs2, mesh=(2, 2), pin=pins)
    assert value(expr, {**values, b: 128}) == pytest.approx(same.cost, rel=1e-6)


def test_dims_name_what_stays_symbolic():
    model, inputs = gpt()
    plan = autoshard.plan(model, inputs, mesh=(4,))
    expr, values = plan.formula(dims={"b": 64})
    sizes = {str(s) for s in expr.free_symbols} - {"F", "M", "o", "p0"} - {str(s) for s in values if str(s).startswith(("alpha", "beta"))}
    assert sizes == {"b"}
    assert value(expr, values) == pytest.approx(plan.cost, rel=1e-6)
    with pytest.raises(ValueError, match="part is one of"):
        plan.formula(part="memory")
    with pytest.raises(ValueError, match="positive int"):
        plan.formula(dims={"b": 0})
    with pytest.raises(TypeError, match="dims maps"):
        plan.formula(dims=[64])
    with pytest.raises(ValueError, match="read from JSON"):
        autoshard.Plan.from_json(plan.to_json()).formula()
    # a measured cluster's fitted rates have no closed form
    from dataclasses import replace
    measured = replace(autoshard.Cluster.preset("a100-80gb-nvlink-ib"), name="here", op_overhead=1e-5)
    with pytest.raises(ValueError, match="was measured"):
        autoshard.plan(model, inputs, mesh=(4,), cluster=measured, verbose=False).formula()


def test_the_readmes_data_parallel_formula():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import gpt_factory
    with torch.device("meta"):
        model, batch = gpt_factory.gpt_tiny()
    plan = autoshard.plan(model, batch, mesh=(8,), pin=schemes.data_parallel(model, batch, (8,)))
    comm, values = plan.formula(part="communication")
    volume = comm.subs({s: 0 for s in values if str(s).startswith("alpha") or str(s) == "o"})
    assert str(sympy.factor(volume)) == "8*(52*d**2*p0 - 52*d**2 + d*p0*s + 54*d*p0 - d*s - 54*d + p0)/(beta_0*p0)"


class Block(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(k, n, bias=False), nn.Linear(n, k, bias=False)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc(x)))


class Stack(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.blocks = nn.ModuleList([Block(k, n)])

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


def test_axonn_4d_communication_is_axonns_per_layer_formulas():
    """AxoNN's layout of a block (fc: k -> n, then fc2: n -> k with x and y swapped) on a mesh
    (data, y, x, z), weights gathered again for backward as AxoNN does. With latency and launch
    overhead set to 0, the communication of the weights (gathered over z forward and backward,
    reduce-scattered over z, all-reduced over data) and of the activation between the layers
    (fc's Y all-reduced over x, fc2's dX over its y, which is x) simplifies to DESIGN.md
    section 6's volumes, bytes over each axis's bandwidth. (The block's input needs no
    gradient, so fc's dX all-reduce is absent; fc2's Y is all-reduced where the output is made
    whole, with the rest of that conversion.)"""
    T, K, N = 448, 96, 160
    with torch.device("meta"):
        model = Stack(K, N)
    x = torch.empty(T, K, device="meta")
    mesh = (2, 2, 2, 2)
    pins = schemes.axonn_4d(model, (x,), mesh, x=2, y=1, z=3)
    plan = autoshard.plan(model, (x,), mesh=mesh, pin=pins, reshard_after_forward=True)
    weights = [n.name for n in plan.nodes.values() if n.kind == "param"]
    matmuls = [n.name for n in plan.nodes.values() if n.op == "linear.default"]
    between = [n.name for n in plan.nodes.values() if n.op == "gelu.default"]
    expr, values = plan.formula(dims={"T": T, "k": K, "n": N}, part="communication", nodes=weights + matmuls + between)
    assert value(expr, values) == pytest.approx(sum(c.seconds for c in plan.collectives if c.node in weights + matmuls + between))
    sym = {str(s): s for s in values}
    volume_only = expr.subs({s: 0 for name, s in sym.items() if name.startswith("alpha") or name == "o"})
    t, k, n = (sympy.Symbol(c, positive=True, integer=True) for c in ("T", "k", "n"))
    gd, gy, gx, gz = (sym[f"p{a}"] for a in range(4))
    beta = {g: sympy.Symbol(f"beta_{a}", positive=True) for a, g in enumerate("dyxz")}
    assert {str(b) for b in beta.values()} - {"beta_1"} <= set(sym)   # nothing here runs over y
    # DESIGN.md section 6, per GPU, elements; fc2 is fc transposed: k and n, x and y swap
    design = {
        "fc": [("z", 2 * (gz - 1) / gz * k * n / (gx * gy)),            # all-gather of W, forward and backward
               ("x", 2 * (gx - 1) / gx * t / (gz * gd) * n / gy),         # all-reduce of Y over x
               ("z", (gz - 1) / gz * k * n / (gx * gy)),                  # reduce-scatter of dW
               ("d", 2 * (gd - 1) / gd * k * n / (gx * gy * gz))],        # all-reduce of dW over data
        "fc2": [("z", 2 * (gz - 1) / gz * n * k / (gy * gx)),
                ("x", 2 * (gx - 1) / gx * t / (gz * gd) * n / gy),        # all-reduce of dX over its y (x)
                ("z", (gz - 1) / gz * n * k / (gy * gx)),
                ("d", 2 * (gd - 1) / gd * n * k / (gy * gx * gz))],
    }
    expected = sum(4 * v / beta[g] for layer in design.values() for g, v in layer)
    assert sympy.simplify(volume_only - expected) == 0, sympy.simplify(volume_only - expected)
    # and autoshard.cost.axonn's own formulas, symbolic, say the same
    ours = axonn.layer_volumes(axonn.Layer(k, n), t, gx, gy, gz, gd)
    theirs = axonn.layer_volumes(axonn.Layer(n, k, transposed=True), t, gx, gy, gz, gd)
    from_module = sum(4 * ours[p][1] / beta[ours[p][0]] for p in ("all_gather_w", "all_reduce_y", "reduce_scatter_dw", "all_reduce_dw"))
    from_module += sum(4 * theirs[p][1] / beta[theirs[p][0]] for p in ("all_gather_w", "all_reduce_dx", "reduce_scatter_dw", "all_reduce_dw"))
    assert sympy.simplify(volume_only - from_module) == 0
