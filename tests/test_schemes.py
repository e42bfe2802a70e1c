"""``autoshard.schemes`` on models it was not written for: the roles of each block's linears
(column-type, row-type, other) come from the graph, not from module names, for the repo's GPT,
HuggingFace GPT-2 (Conv1D: ``addmm`` by (in, out) weights), LLaMA (separate q, k, v, rotary,
grouped-query attention, SwiGLU), BERT (post-norm, a classifier head) and a plain MLP stack.

The schemes' pins plan on each, and are kept; a Megatron-pinned LLaMA and GPT-2 in a real gloo
group of 2 give the single-device loss and gradients; a model without blocks is told what it
lacks.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard import schemes
from autoshard.api import plan_graph
from autoshard.options import PlanOptions
from autoshard.testing.launch import LocalWorld
from autoshard.passes.capture import capture
from cases import by_case, run_each
from models import GPT, MLP, TwoLayer
from models_hf import MODELS

# gradients agree to this fraction of each gradient's largest magnitude (float32 sums of two
# partial products against one whole product)
REL_TOL = 1e-5


def _gpt():
    torch.manual_seed(0)
    return GPT(), (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))


def _mlp():
    torch.manual_seed(0)
    return MLP(), (torch.randn(8, 32),)


BUILDERS = {"gpt": _gpt, "mlp": _mlp, **MODELS}


def _per_layer(layers, roles):
    """{f"{prefix}.{name}": role} for each layer prefix and each (name, role)."""
    return {f"{p}.{n}.weight": r for p in layers for n, r in roles}


# the roles each family's linears must get, by weight; the rest of its weights are no linear's
ROLES = {
    "gpt": {**_per_layer(["blocks.0", "blocks.1"], [("qkv", "column"), ("proj", "row"), ("fc", "column"),
                                                     ("fc2", "row")]),
            "head.weight": "other"},              # tied to the embedding
    "mlp": {**_per_layer(["layers.0", "layers.1"], [("fc1", "column"), ("fc2", "row")]),
            "out.weight": "other"},
    "gpt2": {**_per_layer(["transformer.h.0", "transformer.h.1"],
                          [("attn.c_attn", "column"), ("attn.c_proj", "row"), ("mlp.c_fc", "column"),
                           ("mlp.c_proj", "row")]),
             "lm_head.weight": "other"},
    "llama": {**_per_layer(["model.layers.0", "model.layers.1"],
                           [("self_attn.q_proj", "column"), ("self_attn.k_proj", "column"),
                            ("self_attn.v_proj", "column"), ("self_attn.o_proj", "row"),
                            ("mlp.gate_proj", "column"), ("mlp.up_proj", "column"), ("mlp.down_proj", "row")]),
              "lm_head.weight": "other"},
    "bert": {**_per_layer(["bert.encoder.layer.0", "bert.encoder.layer.1"],
                          [("attention.self.query", "column"), ("attention.self.key", "column"),
                           ("attention.self.value", "column"), ("attention.output.dense", "row"),
                           ("intermediate.dense", "column"), ("output.dense", "row")]),
             # the masked-LM head: dense -> gelu -> norm -> decoder closes no block
             "cls.predictions.transform.dense.weight": "other", "cls.predictions.decoder.weight": "other"},
}


@pytest.fixture(scope="module")
def captured():
    """Each family's model, inputs and graph, captured once."""
    out = {}
    for name, build in BUILDERS.items():
        model, inputs = build()
        out[name] = (model, inputs, capture(model, inputs))
    return out


@pytest.mark.parametrize("name", list(ROLES))
def test_roles_come_from_the_graph(captured, name):
    model, inputs, graph = captured[name]
    assert schemes.roles(model, inputs, graph=graph) == ROLES[name]


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_roles_with_eager_attention(name):
    """The same roles where attention is softmax between two matmuls rather than one fused op
    (LLaMA's v then reaches attention only through the probabilities' product)."""
    model, inputs = MODELS[name]("eager")
    assert schemes.roles(model, inputs) == ROLES[name]


def test_megatron_places_weights_by_their_orientation(captured):
    """GPT-2's Conv1D multiplies by an (in, out) weight: column-parallel splits its dim 1, in the
    blocks of the fused q, k, v; row-parallel its dim 0. LLaMA's (out, in) weights the other way."""
    model, inputs, graph = captured["gpt2"]
    pins = schemes.megatron(model, inputs, (2,), graph=graph)
    h = "transformer.h.0."
    assert {k: pins[h + k] for k in ("attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                                     "attn.c_proj.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight")} == {
        "attn.c_attn.weight": ("S(1)/3",), "attn.c_attn.bias": ("S(0)/3",), "attn.c_proj.weight": ("S(0)",),
        "attn.c_proj.bias": ("B",), "mlp.c_fc.weight": ("S(1)",), "mlp.c_fc.bias": ("S(0)",),
        "mlp.c_proj.weight": ("S(0)",)}
    assert "lm_head.weight" not in pins
    model, inputs, graph = captured["llama"]
    pins = schemes.megatron(model, inputs, (2, 2), tp=1, graph=graph)
    layer = "model.layers.1."
    assert {k: pins[layer + k + ".weight"] for k in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj",
                                                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")} == {
        "self_attn.q_proj": ("B", "S(0)"), "self_attn.k_proj": ("B", "S(0)"), "self_attn.o_proj": ("B", "S(1)"),
        "mlp.gate_proj": ("B", "S(0)"), "mlp.up_proj": ("B", "S(0)"), "mlp.down_proj": ("B", "S(1)")}
    assert pins["input_ids"] == pins["labels"] == ("S(0)", "B")


CASES = [(name, scheme) for name in BUILDERS for scheme in ("megatron", "fsdp", "data_parallel")]


@pytest.mark.parametrize("name,scheme", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_scheme_plans_with_its_pins(captured, name, scheme):
    model, inputs, graph = captured[name]
    pins = schemes.SCHEMES[scheme](model, inputs, (2,), graph=graph)
    if scheme == "megatron":   # as a user calls it: the plan captures the model itself
        plan = autoshard.plan(model, inputs, mesh=(2,), pin=pins)
    else:
        plan = plan_graph(graph, (2,), PlanOptions(pin=pins))
    assert {k: plan.placement(k) for k in pins} == {k: tuple(v) for k, v in pins.items()}
    split = {n for n, p in plan.params.items() if any(q.startswith("S") for q in p)}
    if scheme == "data_parallel":
        assert not split
    elif scheme == "megatron":   # exactly the block linears' weights (and the column ones' biases)
        assert {n for n in split if n.endswith(".weight")} == {w for w, r in ROLES[name].items() if r != "other"}
        # the row-parallel matmuls' partial sums are reduced over the axis
        kinds = {(c.kind, c.phase, c.axes) for c in plan.collectives}
        assert ("all_reduce", "forward", (0,)) in kinds
    else:
        assert split == set(plan.params)


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_megatron_keeps_the_stream_whole_on_any_cluster(captured, name):
    """Megatron-LM without sequence parallelism: each row-parallel matmul's partial sums are
    all-reduced into a residual stream kept whole, also on a cluster whose all-reduce starts
    three times slower than a reduce-scatter or an all-gather (where the solver, left free, would split the stream
    by sequence or by batch and gather it back): a scheme is one program, not the cluster's pick."""
    model, inputs, graph = captured[name]
    rows = tuple((kind, 2, 1, 3e-4 if kind == "all_reduce" else 1e-4, 1e10)
                 for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"))
    skewed = autoshard.Cluster.preset("a100-80gb-nvlink-ib").with_(collectives=rows)
    pins = schemes.megatron(model, inputs, (2,), graph=graph)
    plan = plan_graph(graph, (2,), PlanOptions(pin=pins, cluster=skewed))
    forward = {c.kind for c in plan.collectives if c.phase == "forward" and c.axes == (0,)}
    assert forward == {"all_reduce"}, forward
    rows_ = sum(r == "row" for r in schemes.roles(model, inputs).values())
    assert sum(c.kind == "all_reduce" and c.phase == "forward" for c in plan.collectives) == rows_ > 0


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_other_schemes_pin_hf_models(captured, name):
    """Sequence parallelism and 2-D, 3-D and AxoNN 4-D tensor parallelism lay out the same block
    linears, and their pins are layouts the graph's ops accept."""
    from autoshard.api import resolve_pins
    from autoshard.passes.annotate import annotate
    model, inputs, graph = captured[name]
    for scheme, mesh in (("sequence_parallel", (2,)), ("tensor_2d", (2, 2)), ("tensor_3d", (2, 2, 2)),
                         ("axonn_4d", (2, 2, 2))):
        pins = schemes.SCHEMES[scheme](model, inputs, mesh, graph=graph)
        annotate(graph, mesh, resolve_pins(graph, pins, len(mesh)))   # raises on a pin no layout has
        assert {w for w in ROLES[name] if w in pins} == {w for w, r in ROLES[name].items() if r != "other"}


class Products(nn.Module):
    """A block of bare parameters multiplied as stored, (in, out), by ``@``: no nn.Linear, no
    module names to go by; its second layer's weight transposed on the way (``x @ w.t()``)."""

    def __init__(self, d=16, hidden=32):
        super().__init__()
        self.a = nn.Parameter(torch.randn(d, hidden) / d ** 0.5)
        self.b = nn.Parameter(torch.randn(d, hidden) / hidden ** 0.5)

    def forward(self, x):
        return x + F.silu(x @ self.a) @ self.b.t()


def test_roles_of_bare_matmuls():
    model, inputs = Products(), (torch.randn(8, 16),)
    assert schemes.roles(model, inputs) == {"a": "column", "b": "row"}
    pins = schemes.megatron(model, inputs, (2,))
    # a: (in, out) used as stored, split by its outputs; b: (d, hidden) used transposed, by its inputs
    assert pins["a"] == ("S(1)",) and pins["b"] == ("S(1)",)
    plan = autoshard.plan(model, inputs, mesh=(2,), pin=pins)
    assert plan.placement("a") == ("S(1)",) and plan.placement("b") == ("S(1)",)


@pytest.mark.parametrize("model,inputs", [(nn.Linear(8, 8), (torch.randn(4, 8),)),
                                          (TwoLayer(8, 16), (torch.randn(4, 8), torch.randn(4, 8)))],
                         ids=["linear", "no-residual"])
def test_model_without_blocks_is_told_what_it_lacks(model, inputs):
    graph = capture(model, inputs)
    for scheme, mesh in (("megatron", (2,)), ("sequence_parallel", (2,)), ("tensor_2d", (2, 2)),
                         ("tensor_3d", (2, 2, 2)), ("axonn_4d", (2, 2, 2))):
        with pytest.raises(ValueError, match=f"{scheme}: found no linear that closes a block .feeds the residual "
                                             "add from the attention or the nonlinearity."):
            schemes.SCHEMES[scheme](model, inputs, mesh, graph=graph)
    # the schemes that lay out no block need none
    assert schemes.roles(model, inputs, graph=graph) == {k: "other" for k, _ in model.named_parameters()
                                                         if k.endswith("weight")}
    for scheme in ("data_parallel", "fsdp"):
        pins = schemes.SCHEMES[scheme](model, inputs, (2,), graph=graph)
        assert all(pins[n] == ("S(0)",) for n in graph.user_inputs), pins


def test_sequence_parallel_needs_a_sequence_dim(captured):
    model, inputs, graph = captured["mlp"]
    with pytest.raises(ValueError, match=r"by sequence .* has shape \[8, 32\]: use megatron"):
        schemes.sequence_parallel(model, inputs, (2,), graph=graph)


# ---- numerics: Megatron-pinned HuggingFace models in a gloo group of 2 ---------------------------

def _rel_err(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)


def megatron_case(name):
    """One forward and backward of HuggingFace model ``name`` with Megatron pinned on a mesh of
    2, against its unsharded copy: the loss's and each gradient's relative difference."""
    model, inputs = MODELS[name]()
    ref = copy.deepcopy(model)
    pins = schemes.megatron(model, inputs, (2,))
    pm = autoshard.parallelize(model, inputs, mesh=(2,), pin=pins)
    out, ref_out = pm(**inputs), ref(**inputs)
    out.loss.backward()
    ref_out.loss.backward()
    ref_params = dict(ref.named_parameters())
    plan = pm.plan
    return {"loss": _rel_err(out.loss, ref_out.loss),
            "grads": {n: _rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()},
            "kept": all(plan.placement(k) == tuple(v) for k, v in pins.items()),
            "split": sorted(n for n, p in plan.params.items() if any(q.startswith("S") for q in p)),
            "collectives": sorted({(c.kind, c.phase, c.axes) for c in plan.collectives})}


NUMERICS = ["llama", "gpt2"]


@pytest.fixture(scope="module")
def numerics():
    world = LocalWorld(2)
    try:
        per_rank = world.run(run_each, megatron_case, [(n,) for n in NUMERICS])
    finally:
        world.close()
    return by_case(NUMERICS, per_rank)


@pytest.mark.parametrize("name", NUMERICS)
def test_megatron_matches_single_device(numerics, name):
    for res in numerics[name]:
        assert "error" not in res, res["error"]
        assert res["loss"] <= REL_TOL, res["loss"]
        bad = {n: e for n, e in res["grads"].items() if e > REL_TOL}
        assert not bad, bad
        assert res["kept"]
        assert {w for w, r in ROLES[name].items() if r != "other"} <= set(res["split"]), res["split"]
        assert ("all_reduce", "forward", (0,)) in res["collectives"], res["collectives"]
