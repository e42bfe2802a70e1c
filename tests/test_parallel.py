"""Parallelized models train exactly as on one device: real gloo process groups of 2 and 4 ranks
against an unsharded reference, for the default plans and for pinned tensor-parallel plans."""
import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import autoshard
from cases import emits, rel_err, step_on_the_same_gradients
from models import GPT, MLP, ROPE_HEADS, Block, RopeAttention, RopeLlama, megatron_pins

TOL = dict(rtol=1e-5, atol=2e-6)


def _make(name):
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(), (torch.randn(8, 32),)
    if name == "block":
        return Block(), (torch.randn(4, 16, 32),)
    if name == "gpt":
        return GPT(), (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    if name == "rope":
        return RopeAttention(), (torch.randn(4, 16, 32),)
    if name == "llama":
        return RopeLlama(), (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    raise KeyError(name)


def _scalar(out, seed=1):
    if out.dim() == 0:
        return out
    g = torch.Generator().manual_seed(seed)
    return (out * torch.randn(out.shape, generator=g)).sum()


def train_case(name, pin=None, optimizer="adam"):
    """One step on the parallel model and on the reference; the differences, and what ran."""
    model, inputs = _make(name)
    ref = copy.deepcopy(model)
    if pin == "megatron":   # the scheme pins the linears' outputs too: pinned weights alone may be gathered
        pin = autoshard.schemes.megatron(model, inputs, (torch.distributed.get_world_size(),))
    pm = autoshard.parallelize(model, inputs, pin=pin)
    make_opt = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-2), "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1)}[optimizer]
    opt, ref_opt = make_opt(pm.parameters()), make_opt(ref.parameters())
    out, ref_out = pm(*inputs), ref(*inputs)
    _scalar(out).backward()
    _scalar(ref_out).backward()
    result = {"out": rel_err(out, ref_out), "grads": {}, "params": {}, "shares": {}}
    ref_params = dict(ref.named_parameters())
    for n, p in pm.named_parameters():
        assert isinstance(p, torch.distributed.tensor.DTensor), n
        result["grads"][n] = rel_err(p.grad.full_tensor(), ref_params[n].grad)
        result["shares"][n] = (tuple(str(q) for q in p.placements), tuple(p.to_local().shape), tuple(p.shape))
    step_on_the_same_gradients(pm, ref, opt, ref_opt)
    for n, p in pm.named_parameters():
        result["params"][n] = rel_err(p.full_tensor(), ref_params[n])
    opt.zero_grad()
    out2 = pm(*inputs)
    result["out2"] = rel_err(out2, ref(*inputs))
    result["names"] = [n for n, _ in pm.named_parameters()] == [n for n, _ in ref.named_parameters()]
    result["placements"] = {n: pm.plan.placement(n) for n, _ in pm.named_parameters(remove_duplicate=False)}
    result["program"] = pm.program
    result["collectives"] = sorted({(c.kind, c.phase) for c in pm.plan.collectives})
    result["tied"] = getattr(pm, "head", None) is not None and pm.head.weight is pm.emb.weight
    result["split_ops"] = sorted({c.op for c in pm.plan.nodes.values()
                                  if c.kind == "op" and any(q.startswith("S") for out in c.outputs for q in out)})
    return result


def _assert_exact(res):
    # each difference relative to the tensor's largest magnitude where that is above 1 (cases.rel_err)
    assert res["names"]
    assert res["out"] <= 1e-5, res["out"]
    assert res["out2"] <= 1e-5, res["out2"]
    for n, e in res["grads"].items():
        assert e <= 1e-5, (n, e)
    for n, e in res["params"].items():
        assert e <= 1e-5, (n, e)


CASES = [
    ("mlp", None),
    ("mlp", {"layers.0.fc1.weight": ("S(0)",), "layers.0.fc2.weight": ("S(1)",),
             "layers.1.fc1.weight": ("S(0)",), "layers.1.fc2.weight": ("S(1)",)}),
    ("block", None),
    ("block", "megatron"),
    ("gpt", None),
    ("gpt", "megatron"),
    ("gpt", {"idx": ("S(0)",), "targets": ("S(0)",), "emb.weight": ("B",)}),
    ("rope", None),
    ("rope", ROPE_HEADS),
]


@pytest.mark.parametrize("name,pin", CASES, ids=[f"{n}-{'pinned' if p else 'default'}-{i}" for i, (n, p) in enumerate(CASES)])
def test_world4_matches_single_device(world4, name, pin):
    # Adam divides by the gradient's magnitude, so on attention's key bias (gradient zero up to
    # rounding) it turns rounding noise into a full step; SGD there, Adam on the MLP
    res = world4.run(train_case, name, pin, "adam" if name == "mlp" else "sgd")
    for r in res:
        _assert_exact(r)
    # every rank holds only its share of a split parameter
    for n, (places, local, full) in res[0]["shares"].items():
        for q in places:
            if q.startswith("Shard"):
                assert local != full, n
    if pin == "megatron":
        # the row-parallel output is a partial sum: reduced in forward (all-reduce, or
        # reduce-scatter when the solver keeps the residual stream split: sequence parallel)
        forward = {k for k, ph in res[0]["collectives"] if ph == "forward"}
        assert forward & {"all_reduce", "reduce_scatter"}, res[0]["collectives"]
        assert any(emits(res[0]["program"], k) for k in forward)


@pytest.mark.parametrize("name,pin", CASES[::2], ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES[::2])])
def test_world2_matches_single_device(world2, name, pin):
    for r in world2.run(train_case, name, pin, "sgd"):
        _assert_exact(r)


def test_megatron_pin_runs_tensor_parallel(world4):
    res = world4.run(train_case, "block", "megatron")[0]
    assert res["placements"]["qkv.weight"] == ("S(0)/3",)   # q, k and v each split by heads
    assert res["placements"]["fc2.weight"] == ("S(1)",)
    assert res["shares"]["fc2.weight"][1] == (32, 32)   # a quarter of (32, 128)
    assert emits(res["program"], "all_reduce") or emits(res["program"], "reduce_scatter")


def test_tied_parameters_stay_tied(world4):
    res = world4.run(train_case, "gpt", None)[0]
    assert res["tied"]
    assert res["placements"]["head.weight"] == res["placements"]["emb.weight"]


# ---- behaviour a user relies on ------------------------------------------------------------------

def lazy_case():
    model, inputs = _make("mlp")
    ref = copy.deepcopy(model)
    pm = autoshard.parallelize(model, world=dist.get_world_size())
    assert pm.plan is None
    out = pm(*inputs)
    again = pm(*inputs)
    err = max(rel_err(out, ref(*inputs)), rel_err(again, out))
    # other shapes: a larger batch and a ragged one (7 rows over 4 ranks), forward and backward,
    # each laid out once as the first (planner.reuse: no plan made), then run from the cache
    others = []
    for rows in (16, 7, 16):
        x = torch.randn(rows, 32)
        pm.zero_grad(), ref.zero_grad()
        got, want = pm(x), ref(x)
        (got * got).sum().backward()
        (want * want).sum().backward()
        grads = max(rel_err(p.grad.full_tensor(), q.grad) for p, q in zip(pm.parameters(), ref.parameters()))
        others.append((rel_err(got, want), grads, len(pm._programs)))
    return err, others, pm.plan is not None, [p.plan.solver["status"] for p in pm._programs.values()]


def test_plans_at_first_call_and_again_once_for_each_new_shape(world4):
    for err, others, planned, statuses in world4.run(lazy_case):
        assert planned
        assert err <= 1e-5
        assert all(out <= 1e-5 and grads <= 1e-5 for out, grads, _ in others), others
        assert [n for _, _, n in others] == [2, 3, 3]   # the second (16, 32) batch planned nothing new
        assert statuses == ["OPTIMAL", "REUSED", "REUSED"], statuses   # the first's layout, not solved again


def shapes_case(name, pin):
    """Training batches of 8 then a ragged 7, then eval batches of 16 and 4, against one device:
    each error, how each shape's program got its layout (planner.reuse), and how many nodes the
    ragged batch's layout moves."""
    model, example = _make(name)
    ref = copy.deepcopy(model)

    def batch(rows):   # the example's rows over and over
        return [t.repeat(16, *[1] * (t.dim() - 1))[:rows] for t in example]

    pm = autoshard.parallelize(model, batch(8), pin=pin)
    errs = []
    for rows in (8, 7):
        inputs = batch(rows)
        pm.zero_grad(), ref.zero_grad()
        got, want = pm(*inputs), ref(*inputs)
        _scalar(got).backward()
        _scalar(want).backward()
        grads = max(rel_err(p.grad.full_tensor(), q.grad) for p, q in zip(pm.parameters(), ref.parameters()))
        errs.append(max(rel_err(got, want), grads))
    pm.eval(), ref.eval()
    for rows in (16, 4):
        errs.append(rel_err(pm(*batch(rows)), ref(*batch(rows))))
    plans = [p.plan for p in pm._programs.values()]
    moved = sum(a.outputs != b.outputs for a, b in zip(plans[0].nodes.values(), plans[1].nodes.values()))
    return errs, [p.solver["status"] for p in plans], moved


# a layout legal on other sizes is reused (REUSED), uneven splits included (7 rows over 4 ranks);
# one that is not is planned again keeping what is: a batch split through the embedding, which
# takes no uneven split, and the loss's two views, which merge the batch with the sequence, move
SHAPES = {"mlp, batch split": ("mlp", {"linear": ("S(0)",)}, "REUSED", 0),
          "gpt, megatron": ("gpt", megatron_pins(["blocks.0.", "blocks.1."]), "REUSED", 0),
          "gpt, batch split": ("gpt", {"add": ("S(0)",)}, "OPTIMAL", 3)}


@pytest.mark.parametrize("case", SHAPES)
def test_other_shapes_reuse_the_layout_where_it_is_legal(world4, case):
    name, pin, ragged, moves = SHAPES[case]
    for errs, statuses, moved in world4.run(shapes_case, name, pin):
        assert max(errs) <= 1e-5, errs
        # train 8, train 7, eval 16 (a new mode: planned, the parameters pinned), eval 4
        assert statuses == ["OPTIMAL", ragged, "OPTIMAL", "REUSED"], statuses
        assert moved == moves


class Difference(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, a, b, negate=False):
        y = self.fc(a) - b
        return -y if negate else y


def keyword_order_case():
    torch.manual_seed(0)
    model = Difference()
    a, b = torch.randn(4, 8), torch.randn(4, 8) + 10
    want = model(a, b)
    pm = autoshard.parallelize(model, dict(a=a, b=b, negate=False))
    errs = [(pm(a=a, b=b, negate=False) - want).abs().max().item(),
            (pm(negate=False, b=b, a=a) - want).abs().max().item()]
    try:
        pm(a=a, b=b, negate=True)
    except ValueError as e:
        return errs, str(e)
    return errs, None


def test_keyword_arguments_in_any_order_and_constants_checked(world2):
    for errs, msg in world2.run(keyword_order_case):
        assert max(errs) <= 1e-6, errs
        assert msg is not None and "non-tensor arguments" in msg and "True" in msg


class NoRule(torch.nn.Module):
    """logcumsumexp has no sharding rule: it runs replicated between split matmuls"""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(torch.logcumsumexp(self.fc1(x), dim=1))


def no_rule_case():
    import warnings
    from autoshard.passes.annotate import UnknownOpWarning
    torch.manual_seed(0)
    model, x = NoRule(), torch.randn(8, 8)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = autoshard.parallelize(model, (x,), pin={"x": ("S(0)",)})   # a split batch around it
    out = pm(x)
    out.square().sum().backward()
    ref(x).square().sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    err = max([rel_err(out, ref(x))] + [rel_err(grads[n], p.grad) for n, p in ref.named_parameters()])
    return err, [str(w.message) for w in caught if issubclass(w.category, UnknownOpWarning)]


def test_an_op_without_a_rule_runs_correctly(world2):
    results = world2.run(no_rule_case)
    assert all(err <= 1e-5 for err, _ in results), results
    warned = [w for _, ws in results for w in ws]   # rank 0 plans, and warns once
    assert len(warned) == 1 and "logcumsumexp" in warned[0], warned


def world_mismatch_case():
    model, inputs = _make("mlp")
    try:
        autoshard.parallelize(model, inputs, world=dist.get_world_size() * 2)
    except ValueError as e:
        return str(e)
    return None


def test_world_mismatch_is_a_clear_error(world4):
    for msg in world4.run(world_mismatch_case):
        assert msg is not None and "process group has 4" in msg


def dropout_case():
    torch.manual_seed(0)
    model = Block(dropout=0.5)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 16, 32)
    pm = autoshard.parallelize(model, (x,))
    pm.manual_seed(123)
    out = pm(x)
    torch.manual_seed(123)
    return out.detach(), ref(x).detach()


def test_dropout_replicas_agree_and_match_single_device(world4):
    res = world4.run(dropout_case)
    for out, ref in res:
        torch.testing.assert_close(out, res[0][0], rtol=0, atol=0)
        torch.testing.assert_close(out, ref, **TOL)


def checkpoint_case(path):
    import torch.distributed.checkpoint as dcp
    model, inputs = _make("gpt")
    pm = autoshard.parallelize(model, inputs)
    before = {k: v.full_tensor().clone() for k, v in pm.state_dict().items() if hasattr(v, "full_tensor")}
    dcp.save(pm.state_dict(), checkpoint_id=path)
    with torch.no_grad():
        for p in pm.parameters():
            p.zero_()
    state = pm.state_dict()
    dcp.load(state, checkpoint_id=path)
    pm.load_state_dict(state)
    return max((pm.state_dict()[k].full_tensor() - v).abs().max().item() for k, v in before.items())


def test_distributed_checkpoint_round_trip(world4):
    with tempfile.TemporaryDirectory() as d:
        for err in world4.run(checkpoint_case, os.path.join(d, "ckpt")):
            assert err == 0


def mesh_case(name, pin):
    model, inputs = _make(name)
    ref = copy.deepcopy(model)
    pm = autoshard.parallelize(model, inputs, mesh=(2, 2), pin=pin)
    out, ref_out = pm(*inputs), ref(*inputs)
    _scalar(out).backward()
    _scalar(ref_out).backward()
    ref_params = dict(ref.named_parameters())
    grads = max(rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters())
    return rel_err(out, ref_out), grads, pm.plan.placement(next(iter(pin)) if pin else "x")


MESH_CASES = [
    ("block", None),
    ("block", {"x": ("S(0)", "B"), "qkv.weight": ("B", "S(0)"), "fc.weight": ("S(0)", "S(0)"), "fc2.weight": ("S(1)", "S(1)")}),
    ("mlp", {"x": ("S(0)", "S(0)"), "layers.0.fc1.weight": ("S(1)", "S(0)")}),
]


@pytest.mark.parametrize("name,pin", MESH_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(MESH_CASES)])
def test_2x2_mesh_matches_single_device(world4, name, pin):
    for out, grads, placement in world4.run(mesh_case, name, pin):
        assert out <= 1e-5 and grads <= 1e-5
        if pin:
            assert placement == pin[next(iter(pin))]


def reshard_case(mesh, reshard, overlap, shard=None):
    """FSDP on ``mesh`` (storing parameters split on the ``shard`` axes, default all: others
    hybrid, broadcast): one training step against the single device, the gathers each phase
    issues, and what the plan says of them."""
    from autoshard import schemes
    from autoshard.runtime import steps as runtime_steps
    torch.manual_seed(0)
    model = GPT(layers=2)
    inputs = (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    ref = copy.deepcopy(model)
    pm = autoshard.parallelize(model, inputs, mesh=mesh, pin=schemes.fsdp(model, inputs, mesh, shard=shard),
                               reshard_after_forward=reshard, overlap=overlap)
    opt, ref_opt = torch.optim.Adam(pm.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    out, ref_out = pm(*inputs), ref(*inputs)
    gathers, real = [], runtime_steps._all_gather
    runtime_steps._all_gather = lambda *a, **k: (gathers.append(1), real(*a, **k))[1]
    try:
        out.backward()
    finally:
        runtime_steps._all_gather = real
    ref_out.backward()
    ref_params = dict(ref.named_parameters())
    grads = max(rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters())
    step_on_the_same_gradients(pm, ref, opt, ref_opt)
    params = max(rel_err(p.full_tensor(), ref_params[n]) for n, p in pm.named_parameters())
    plan = pm.plan
    again = [c for c in plan.collectives if c.kind == "all_gather" and c.phase == "backward"]
    return dict(out=rel_err(out, ref_out), grads=grads, params=params, backward_gathers=len(gathers),
                planned_again=len(again), activations=plan.memory["activations"], text=str(plan))


@pytest.mark.parametrize("mesh,overlap,shard", [((4,), True, None), ((4,), False, None), ((2, 2), True, None),
                                               ((2, 2), True, 1)], ids=["4", "4-unscheduled", "2x2", "2x2-hybrid"])
def test_reshard_after_forward_gathers_weights_again_for_backward(world4, mesh, overlap, shard):
    """``reshard_after_forward=True``: every weight FSDP gathers for a matmul is freed after
    forward and gathered again when the matmul's backward needs it (with the weights of its gather bucket:
    at most as many gathers as the plan prices), the activations no longer hold the gathered weights, and the step still
    equals the single device's; hybrid sharding (stored split on axis 1, broadcast on axis 0) too."""
    kept = world4.run(reshard_case, mesh, False, overlap, shard)
    freed = world4.run(reshard_case, mesh, True, overlap, shard)
    for k, f in zip(kept, freed):
        for r in (k, f):
            assert max(r["out"], r["grads"], r["params"]) <= 1e-5, (r["out"], r["grads"], r["params"])
        assert k["backward_gathers"] == 0 and k["planned_again"] == 0
        # every weight priced again; gathered again in buckets, as in forward (one collective each)
        assert f["planned_again"] >= 4 * 2 and 1 <= f["backward_gathers"] <= f["planned_again"]
        assert f["activations"] < k["activations"]
        assert "converted again for backward" in f["text"]


def test_reshard_after_forward_is_a_flag():
    model, inputs = _make("mlp")
    with pytest.raises(ValueError, match="reshard_after_forward is True or False"):
        autoshard.plan(model, inputs, world=2, reshard_after_forward="yes")


# ---- the optimizer step over DTensor parameters -----------------------------------------------------

def optimizer_case(names, foreach):
    """Three steps of each optimizer in ``names`` (left to its default, or ``foreach`` as given) on
    a Megatron-split MLP, the reference stepping on the same gradients each time: the largest
    parameter difference, and the path each optimizer took."""
    from autoshard.runtime.optim import FOREACH_SAFE
    out = {}
    for name in names:
        cls = next(c for c in FOREACH_SAFE if c.__name__ == name)
        model, inputs = _make("mlp")
        ref = copy.deepcopy(model)
        pm = autoshard.parallelize(model, inputs, pin={"layers.0.fc1.weight": ("S(0)",), "layers.0.fc2.weight": ("S(1)",)})
        kw = {"lr": 1e-2} if foreach is None else {"lr": 1e-2, "foreach": foreach}
        opt, ref_opt = cls(pm.parameters(), **kw), cls(ref.parameters(), lr=1e-2, foreach=False)
        worst = 0.0
        for i in range(3):
            (pm(*inputs) ** 2).mean().backward()
            (ref(*inputs) ** 2).mean().backward()
            step_on_the_same_gradients(pm, ref, opt, ref_opt)
            opt.zero_grad()
            ref_opt.zero_grad()
            ref_params = dict(ref.named_parameters())
            worst = max([worst] + [(p.full_tensor() - ref_params[n]).abs().max().item() for n, p in pm.named_parameters()])
        group = opt.param_groups[0]
        out[name] = (worst, "fused" if group.get("fused") else "foreach" if group["foreach"] else "loop")
    return out


def test_optimizers_left_to_their_default_step_dtensors_by_fused_or_foreach(world2):
    """The fused and foreach paths dispatch DTensor's ops once for all parameters, not once per
    parameter (autoshard.runtime.optim); each optimizer steps the shares as the same path steps the whole
    tensors (the reference takes the parallel optimizer's path: cases.step_on_the_same_gradients;
    the fused kernel rounds apart from the for-loop path by processor)."""
    from autoshard.runtime.optim import FOREACH_SAFE, FUSED_SAFE
    names = [c.__name__ for c in FOREACH_SAFE]
    for default, chosen in zip(world2.run(optimizer_case, names, None), world2.run(optimizer_case, ["Adam"], False)):
        for name, (err, path) in default.items():
            want = "fused" if name in {c.__name__ for c in FUSED_SAFE} else "foreach"
            assert path == want and err <= 1e-6, (name, err, path)
        assert chosen["Adam"][1] == "loop" and chosen["Adam"][0] <= 1e-6     # the user's choice is kept


# ---- a mean loss over a split batch -----------------------------------------------------------------

def ignored_targets_case():
    """A GPT whose targets ignore (-100) a different number of tokens on each rank's share: the
    mean over the counted ones is the whole batch's. Its targets are an input (through a view),
    so each rank counts them whole, with no all-reduce."""
    torch.manual_seed(0)
    model = GPT()
    idx, targets = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    targets[0, :12] = -100          # the first rank's share is mostly ignored
    targets[3, 5] = -100
    ref = copy.deepcopy(model)
    pm = autoshard.parallelize(model, (idx, targets), pin={"idx": ("S(0)",), "targets": ("S(0)",)})
    loss, ref_loss = pm(idx, targets), ref(idx, targets)
    loss.backward()
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    grads = max(rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in pm.named_parameters())
    line = next(l for l in pm.program.splitlines() if "cross_entropy_mean" in l)
    ce = next(name for name, c in pm.plan.nodes.items() if c.op == "cross_entropy_loss.default")
    counts = [c for c in pm.plan.collectives if c.node == ce]          # what the plan prices for it
    return rel_err(loss, ref_loss), grads, line, len(counts)


def test_mean_loss_counts_ignored_targets_over_the_whole_batch(world4):
    for loss, grads, line, counts in world4.run(ignored_targets_case):
        assert loss <= 1e-5 and grads <= 1e-5, (loss, grads)
        assert "(0,), targets)" in line, line                 # counted on the whole targets
        assert counts == 0, counts                              # and the plan prices none


def test_complex_rotary_embeddings_run_split(world4):
    """Rotary embeddings through complex numbers (view_as_complex, a complex multiply,
    view_as_real) run on each rank's heads, exact, and nothing of the model falls back."""
    cov = autoshard.coverage(*_make("rope"), world=4)
    assert not cov.compute_fallbacks and "no rule" not in str(cov), cov
    for res in world4.run(train_case, "rope", ROPE_HEADS, "sgd"):
        _assert_exact(res)
        assert any("view_as_complex" in op for op in res["split_ops"]), res["split_ops"]
        assert any("view_as_real" in op for op in res["split_ops"]), res["split_ops"]


def test_a_llama_style_model_with_complex_rotary_embeddings_runs_split(world4):
    """A whole Llama-style decoder (embedding, RMSNorm, attention with complex rotary embeddings,
    SwiGLU, head, loss): nothing falls back, and under Megatron's layout, whose roles come from
    the graph, its rotary embeddings run on each rank's heads, exact against one device."""
    cov = autoshard.coverage(*_make("llama"), world=4)
    assert not cov.compute_fallbacks and "no rule" not in str(cov), cov
    for res in world4.run(train_case, "llama", "megatron", "sgd"):
        _assert_exact(res)
        assert any("view_as_complex" in op for op in res["split_ops"]), res["split_ops"]
        assert any("view_as_real" in op for op in res["split_ops"]), res["split_ops"]
