"""Mixtures of experts train exactly as on one device, in a real gloo group of 4 on meshes (4,)
and (2, 2): HuggingFace Mixtral (transformers' grouped-matmul experts: top-2 routing, a sort by
expert, a histogram of the expert ids) and mixtures written by hand (top-2 routing, every
expert's matmuls batched over an expert dim, or each expert its own linears in a loop). The loss, the logits, every parameter gradient and
one Adam step equal the unsharded model's, under the solver's plan and under pinned plans that
split the experts: over experts alone, over experts and rows together (expert parallelism: the
rows go to their experts' ranks by all-to-all and come back), and over experts on one axis with
each expert's columns on the other."""
import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
import transformers

import autoshard
from autoshard.passes.annotate import UnknownOpWarning
from cases import by_case, run_each, step_on_the_same_gradients

pytestmark = pytest.mark.long("Mixtral and two hand-written expert layers trained on 4 ranks in 11 layouts: 15 s on 2 cores")

TOL = 1e-5
SLOW = autoshard.Cluster(name="slow-compute", peak_flops=2e9, peak_flops_fp32=1e9, memory_bandwidth=4e9)
VOCAB, SEQ, BATCH = 128, 8, 8


def mixtral():
    """A tiny Mixtral: 4 experts, 2 per token, grouped-query attention; transformers 5 runs its
    experts through its grouped matmul (``experts_implementation="grouped_mm"``, the default)."""
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=SEQ, bos_token_id=0,
                                     eos_token_id=0, pad_token_id=0)
    model = transformers.MixtralForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return model, dict(input_ids=ids, labels=torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), use_cache=False)


class HandMoE(nn.Module):
    """Top-2 routing over 4 experts, each a two-layer MLP; every expert runs on every token (the
    batched form) and the router's weights combine them."""

    def __init__(self, d=32, hidden=64, experts=4, top=2):
        super().__init__()
        self.top = top
        self.router = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, d, hidden) / math.sqrt(d))
        self.w2 = nn.Parameter(torch.randn(experts, hidden, d) / math.sqrt(hidden))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, x, labels):
        probs = self.router(x).softmax(-1)
        w, idx = probs.topk(self.top, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, idx, w / w.sum(-1, keepdim=True))
        h = torch.einsum("btd,edh->ebth", x, self.w1).relu()
        y = torch.einsum("ebth,ehd->ebtd", h, self.w2)
        logits = self.head(x + torch.einsum("bte,ebtd->btd", gates, y))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return loss, logits


def hand():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return HandMoE(), dict(x=torch.randn(BATCH, SEQ, 32, generator=g),
                           labels=torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


class LoopMoE(HandMoE):
    """The same routing, each expert its own pair of linears, run in a loop over the experts and
    weighted by its gate (the per-expert loop form)."""

    def __init__(self, d=32, hidden=64, experts=4, top=2):
        super().__init__(d, hidden, experts, top)
        del self.w1, self.w2
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d))
                                     for _ in range(experts))

    def forward(self, x, labels):
        probs = self.router(x).softmax(-1)
        w, idx = probs.topk(self.top, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, idx, w / w.sum(-1, keepdim=True))
        y = x
        for e, expert in enumerate(self.experts):
            y = y + gates[..., e:e + 1] * expert(x)
        logits = self.head(y)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


def loop():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return LoopMoE(), dict(x=torch.randn(BATCH, SEQ, 32, generator=g),
                           labels=torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


MODELS = {"mixtral": mixtral, "hand": hand, "loop": loop}
EXPERTS = {"mixtral": ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"),
           "hand": ("w1", "w2"), "loop": ("experts.0.0.weight", "experts.0.2.weight")}
# the grouped matmuls' rows: pinned split with the experts, expert parallelism by all-to-all
ROWS = ("grouped_mm_fallback", "grouped_mm_fallback_1")


def pins(name, mesh, kind):
    """kind "default": the solver's plan; "experts": the experts split over every axis;
    "ep": experts and their rows split on axis 0 (all-to-all), on (2, 2) each expert's
    columns (gate_up) and rows (down) over axis 1."""
    if kind == "default":
        return None
    up, down = EXPERTS[name]
    if kind == "experts":
        return {up: ("S(0)",) * len(mesh), down: ("S(0)",) * len(mesh)}
    if len(mesh) == 1:
        return {up: ("S(0)",), down: ("S(0)",), **{r: ("S(0)",) for r in ROWS}}
    return {up: ("S(0)", "S(2)"), down: ("S(0)", "S(1)"), ROWS[0]: ("S(0)", "S(1)"), ROWS[1]: ("S(0)", "P")}


def _err(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def _objective(loss, logits):
    g = torch.Generator().manual_seed(11)
    return loss + (logits * torch.randn(logits.shape, generator=g)).mean()


def _parts(out):
    return (out.loss, out.logits) if hasattr(out, "logits") else out


def train_case(name, mesh, kind):
    model, inputs = MODELS[name]()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnknownOpWarning)
        pm = autoshard.parallelize(model, inputs, mesh=mesh, pin=pins(name, mesh, kind), cluster=SLOW)
    make_opt = lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-4)  # noqa: E731 - as in test_hf
    opt, ref_opt = make_opt(pm.parameters()), make_opt(ref.parameters())
    (loss, logits), (ref_loss, ref_logits) = _parts(pm(**inputs)), _parts(ref(**inputs))
    _objective(loss, logits).backward()
    _objective(ref_loss, ref_logits).backward()
    res = {"loss": _err(loss, ref_loss), "logits": _err(logits, ref_logits)}
    ref_params = dict(ref.named_parameters())
    res["grads"] = {n: _err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters()}
    step_on_the_same_gradients(pm, ref, opt, ref_opt)
    res["params"] = {n: _err(p.full_tensor(), ref_params[n]) for n, p in pm.named_parameters()}
    with torch.no_grad():
        res["loss2"] = _err(_parts(pm(**inputs))[0], _parts(ref(**inputs))[0])
    plan = pm.plan
    res["unknown"] = sorted({str(w.message) for w in caught if issubclass(w.category, UnknownOpWarning)})
    res["placements"] = {k: plan.placement(k) for k in EXPERTS[name]}
    res["shares"] = {n: tuple(p.to_local().shape) for n, p in pm.named_parameters() if n in EXPERTS[name]}
    res["program"] = pm.program
    res["collectives"] = sorted({(c.kind, c.phase, c.axes) for c in plan.collectives})
    return res


MESHES = ((4,), (2, 2))
CASES = [(name, mesh, kind) for name in MODELS for mesh in MESHES for kind in ("default", "experts", "ep")
         if (name == "mixtral" or kind != "ep") and (name != "loop" or kind == "default")]


@pytest.fixture(scope="module")
def results(world4):
    per_rank = world4.run(run_each, train_case, CASES)
    return by_case(CASES, per_rank)


@pytest.mark.parametrize("case", CASES, ids=lambda c: str(c))
def test_exact(results, case):
    for r, res in enumerate(results[case]):
        assert "error" not in res, f"rank {r}: {res['error']}"
        assert res["unknown"] == [], res["unknown"]
        for key in ("loss", "logits", "loss2"):
            assert res[key] < TOL, (key, res[key])
        for kind in ("grads", "params"):
            bad = {n: e for n, e in res[kind].items() if e > TOL}
            assert not bad, f"rank {r}: {kind} differ: {bad}"


@pytest.mark.parametrize("case", [c for c in CASES if c[2] != "default"], ids=lambda c: str(c))
def test_experts_split(results, case):
    """The pinned plans hold each rank's experts only; under "ep" the grouped matmuls take the
    rows split with the experts on axis 0: the all-to-all form (``experts.grouped_mm`` with the
    same axis for both)."""
    name, mesh, kind = case
    res = results[case][0]
    assert "error" not in res, res["error"]
    assert all(res["placements"][w][0] == "S(0)" for w in EXPERTS[name]), res["placements"]
    if kind == "ep":
        calls = [line for line in res["program"].splitlines() if "autoshard_runtime_experts_grouped_mm(" in line]
        assert len(calls) == 2 and all(", (0,), (0,), " in line for line in calls), calls
    if kind == "ep" and len(mesh) == 2:   # over experts on axis 0, within each expert on axis 1
        up, down = EXPERTS[name]
        assert (res["placements"][up], res["placements"][down]) == (("S(0)", "S(2)"), ("S(0)", "S(1)"))
        assert res["shares"][up] == (2, 128, 16)   # of (4, 128, 32): 2 experts, half of each one's columns


def test_solver_splits_the_experts(results):
    """Unpinned, the solver keeps each rank's experts only, Mixtral's and the hand-written
    layer's; Mixtral's tokens go to their experts' ranks and come back by all-to-all (the rows
    taken in expert order, ``experts.gather_rows``, and put back), over both axes of (2, 2)."""
    for name in ("mixtral", "hand"):
        res = results[(name, (4,), "default")][0]
        assert all(res["placements"][w] == ("S(0)",) for w in EXPERTS[name]), (name, res["placements"])
    for mesh in MESHES:
        res = results[("mixtral", mesh, "default")][0]
        assert res["program"].count("autoshard_runtime_experts_gather_rows(") == 2, mesh
        assert ("all_to_all", "forward", (0,)) in res["collectives"]
        assert ("all_to_all", "backward", (0,)) in res["collectives"]


@pytest.mark.parametrize("name", MODELS)
def test_coverage_finds_no_compute_fallback(name):
    model, inputs = MODELS[name]()
    cov = autoshard.coverage(model, inputs, world=4)
    assert cov.compute_fallbacks == [], str(cov)
    assert cov.without_rules == [], cov.without_rules


def test_expert_work_follows_the_loads():
    """Rows multiplied and sent by the busiest rank (rules.moe.expert_work), 64 rows over 4
    experts: expert parallel on one axis moves nothing when routing is uniform (rows sorted by
    expert lie on their experts' ranks already); a hot expert makes its rank the busiest and
    the others send it their rows; rows split on one axis and experts on the other leave half
    the ranks idle."""
    from autoshard.rules.moe import expert_work
    assert expert_work(64, (1, 1, 1, 1), (4,), (0,), (0,)) == (16.0, 0.0)
    assert expert_work(64, (1, 1, 1, 1), (4,), (), (0,)) == (16.0, 0.0)
    assert expert_work(64, (7, 1, 1, 1), (4,), (0,), (0,)) == (44.8, 16.0)
    assert expert_work(64, (1, 1, 1, 1), (2, 2), (0,), (1,)) == (32.0, 0.0)


def _plan(mesh, loads=None):
    model, inputs = mixtral()
    if loads is None:
        return autoshard.plan(model, inputs, mesh=mesh, cluster=SLOW, verbose=False)
    with autoshard.expert_loads(model, {w: loads for w in EXPERTS["mixtral"]}):
        return autoshard.plan(model, inputs, mesh=mesh, cluster=SLOW, verbose=False)


def test_solver_weighs_expert_parallelism_by_the_loads():
    """Under uniform routing the solver keeps a quarter of Mixtral's experts per rank on (4,)
    and (2, 2) (expert-parallel degree 4): the tokens' all-to-all carries each rank's rows
    (32 rows of 32 floats), the grouped matmuls exchange nothing. With one expert taking 97% of
    the rows (measured loads), that expert's rank would do nearly all the work: on (4,) it
    splits every expert's columns over the ranks instead (tensor parallel within experts)."""
    up, down = EXPERTS["mixtral"]
    for mesh in MESHES:
        plan = _plan(mesh)
        assert plan.placement(up) == plan.placement(down) == ("S(0)",) * len(mesh)
        moved = {(c.node, c.phase): c.bytes for c in plan.collectives if c.kind == "all_to_all"}
        assert moved[("index_4", "forward")] == moved[("index_4", "backward")] == 32 * 32 * 4
        assert moved[("grouped_mm_fallback", "forward")] == 0
    skewed = _plan((4,), (97, 1, 1, 1))
    assert all(q != "S(0)" for w in (up, down) for q in skewed.placement(w)), skewed.placement(up)
    assert skewed.placement(up) == ("S(2)",)


def test_expert_loads_are_checked():
    model, _ = mixtral()
    up = EXPERTS["mixtral"][0]
    with pytest.raises(ValueError, match="not a parameter.*Did you mean"):
        with autoshard.expert_loads(model, {up[:-1]: (1, 1, 1, 1)}):
            pass
    with pytest.raises(ValueError, match="holds 4 experts on its dim 0; give 4"):
        with autoshard.expert_loads(model, {up: (1, 1)}):
            pass
    with pytest.raises(TypeError, match="dict"):
        with autoshard.expert_loads(model, [1, 1, 1, 1]):
            pass
