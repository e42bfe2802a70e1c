"""Compiled autoshard trains exactly as eager autoshard and the single-device model do, in real gloo
groups: ``parallelize(..., compile=True)`` (the program compiled whole by inductor), and a user's own
``torch.compile`` of the parallel module (which compiles the same program) or of a function calling it
(which traces the whole call), with no graph break (the runtime's collectives traced as functional
collectives, its buckets and parameters as plain autograd); with
recomputed blocks, and with dropout that draws the masks eager autoshard draws. The compiled code
issues each collective ahead of compute that does not need it and waits after that compute.

The user's own compile runs with ``backend="aot_eager"``: the point there is dynamo's and
AOTAutograd's tracing of the runtime (graph breaks, the collectives' autograd, the partition into
forward and backward), which inductor's code generation, shown by ``compile=True`` and by one
user's compile with ``mode="max-autotune"``, does not change."""
import copy
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import autoshard
from autoshard._compat import generated_code, graphs_compiled, guards_built
from cases import by_case, rel_err, run_each, step_on_the_same_gradients
from models import GPT

pytestmark = pytest.mark.long("inductor compiles each plan's program, forward and backward, on every rank: "
                              "about 30 s a plan on 2 cores")

TOL = 1e-5   # cases.rel_err: compiled kernels reorder float sums, no more
BF16_TOL = 2e-2   # the bf16 policy: eager and compiled round their bf16 copies' products apart


def _pins(scheme, model, inputs, mesh):
    if scheme == "dp":   # the batch split, every parameter whole
        return {"idx": ("S(0)",), "targets": ("S(0)",), **{n: ("B",) * len(mesh) for n, _ in model.named_parameters()}}
    if scheme == "2d":   # Megatron on the last axis, the batch on the first
        return autoshard.schemes.megatron(model, inputs, mesh)
    return getattr(autoshard.schemes, scheme)(model, inputs, mesh)


def _case(scheme, mesh, *, compile_option=False, backend=None, mode=None, policy=None, recompute=None,
          dropout=0.0, bucket_bytes=None, method=False, nested=False):
    """Loss and every gradient of one compiled step against eager autoshard and one device, the
    graph breaks of a user's compile, and a second step (no recompile for the same shapes).
    ``dropout``: every module draws from the same seed (autoshard's shared generator, one
    device's default one). ``compile_option``: the order of the compiled code's collectives
    (``_overlap``). ``bucket_bytes``: the plan's gradient buckets that small. ``method``: the
    user's compile is ``module.compile(backend=...)`` (inductor: the order of its code too).
    ``nested``: the user compiles a function that calls the module, which dynamo then traces
    whole, the feed included."""
    torch.manual_seed(0)
    model = GPT(dropout=dropout)
    inputs = (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    pin = _pins(scheme, model, inputs, mesh)
    kw = {"mp_policy": policy} if policy is not None else {}
    if recompute is not None:
        kw["recompute"] = recompute
    ref, eager = copy.deepcopy(model), copy.deepcopy(model)
    if bucket_bytes is not None:
        plan = autoshard.plan(model, inputs, mesh=mesh, pin=pin, verbose=False, **kw)
        plan.schedule["bucket_bytes"] = bucket_bytes
        pm = autoshard.parallelize(model, plan=plan, compile=compile_option)
        pe = autoshard.parallelize(eager, plan=plan)
    else:
        pm = autoshard.parallelize(model, inputs, mesh=mesh, pin=pin, verbose=False, compile=compile_option, **kw)
        pe = autoshard.parallelize(eager, inputs, mesh=mesh, pin=pin, verbose=False, **kw)
    out = {}
    run = pm
    if backend is not None:
        torch._dynamo.reset()
        explained = torch._dynamo.explain(_calling(pm) if nested else pm)(*inputs)
        out["breaks"] = explained.graph_break_count
        out["graphs"] = explained.graph_count
        torch._dynamo.reset()
        if method:
            pm.compile(backend=backend, fullgraph=True)
            run = pm
        else:
            run = torch.compile(_calling(pm) if nested else pm, backend=backend, mode=mode, fullgraph=True)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)

    def seed(s):
        pm.manual_seed(s)
        pe.manual_seed(s)
        torch.manual_seed(s)

    def step():
        seed(7)
        losses = [m(*inputs) for m in (run, pe, ref)]
        for loss in losses:
            loss.backward()
        return losses

    trees = []
    if compile_option or method:
        with guards_built(trees):
            losses, code = generated_code(step)
        out["order"] = [_overlap(c) for c in code]
        out["slice_backward"] = sum(c.count("slice_backward") for c in code)
    else:
        with guards_built(trees):
            losses = step()
    # the checks dynamo runs in Python at every call on a DTensor parameter's spec
    out["spec_guards"] = sum(str(manager).count("__dtensor_spec") for manager, _ in trees)
    ref_params, eager_params = dict(ref.named_parameters()), dict(pe.named_parameters())
    out["loss"] = (rel_err(losses[0], losses[2]), rel_err(losses[0], losses[1]))
    out["grads"] = {n: (rel_err(p.grad.full_tensor(), ref_params[n].grad),
                        rel_err(p.grad.full_tensor(), eager_params[n].grad.full_tensor()))
                    for n, p in pm.named_parameters()}
    if dropout:   # the masks matter: another seed, another loss
        pe.manual_seed(8)
        out["other_seed"] = rel_err(pe(*inputs), losses[1])
    step_on_the_same_gradients(pm, ref, opt, ref_opt)
    opt.zero_grad()
    ref_opt.zero_grad()
    seed(9)
    got = run(*inputs)
    torch.manual_seed(9)
    out["again"] = rel_err(got, ref(*inputs))   # after a step, the same compiled program
    out["programs"] = len(pm._programs)
    out["passes"] = pm.program.splitlines()[0]
    out["recomputed"] = pm.program.count("= self.recompute_")
    return out


def _calling(pm):
    """A user's function that calls the parallel module (a training step's forward, compiled whole)."""
    def forward(*batch):
        return pm(*batch)
    return forward


# inductor's generated Python: a collective's start (``bufN = ..._c10d_functional.all_gather...(x``
# or in place ``..._c10d_functional.all_reduce_.default(bufN``), its ``wait_tensor(bufN)``, and the
# kernels it runs (C++ or Triton kernels, extern matmuls, aten fallbacks)
_START = re.compile(r"^\s*(?:(\w+) = )?torch\.ops\._c10d_functional\.(\w+?)\.default\((?:reinterpret_tensor\()?(\w+)")
_WAIT = re.compile(r"^\s*(?:\w+ = )?torch\.ops\._c10d_functional\.wait_tensor\.default\((?:reinterpret_tensor\()?(\w+)")
_KERNEL = re.compile(r"^\s*(?:\w+ = )?(extern_kernels\.\w+|cpp_fused_\w+|triton_\w+|torch\.ops\.aten\.\w+)")


def _overlap(code: str) -> list:
    """Each collective of one compiled program, in the order started: (its op, the kernels the
    program runs between its start and its wait)."""
    started, out = {}, []
    for line in code[code.index("def call("):].splitlines():
        if line.lstrip().startswith("#"):
            continue
        if (w := _WAIT.match(line)) is not None:
            started.pop(w.group(1), None)
        elif (s := _START.match(line)) is not None:
            out.append((s.group(2), []))
            started[s.group(3) if s.group(2).endswith("_") else s.group(1)] = len(out) - 1
        elif (k := _KERNEL.match(line)) is not None:
            for i in started.values():
                out[i][1].append(k.group(1))
    return out


def _compile_option(scheme, **kw):
    return _case(scheme, (dist.get_world_size(),), compile_option=True, **kw)


def _user_compile(scheme, mesh, policy=None, recompute=None, **kw):
    return _case(scheme, mesh, backend="aot_eager", policy=policy, recompute=recompute, **kw)


def _max_autotune(scheme):
    """A user's compile with inductor's ``mode="max-autotune"``, which on a CPU tunes its C++ GEMM
    templates and runs."""
    return _case(scheme, (dist.get_world_size(),), backend="inductor", mode="max-autotune")


def _saved(scheme, recompute):
    """The bytes a user's compiled forward keeps for backward (its first call, which compiles)."""
    torch.manual_seed(0)
    model = GPT()
    inputs = (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    mesh = (dist.get_world_size(),)
    pm = autoshard.parallelize(model, inputs, mesh=mesh, pin=_pins(scheme, model, inputs, mesh), verbose=False,
                               recompute=recompute)
    torch._dynamo.reset()
    run = torch.compile(pm, backend="aot_eager", fullgraph=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        loss = run(*inputs)
    loss.backward()
    return {"bytes": sum(kept), "recomputed": pm.program.count("= self.recompute_")}


def _shapes():
    """How often each compile compiles over calls of repeated and new input shapes, each call's
    loss against one device's: ``compile=True`` (dynamo's count of graphs compiled),
    ``module.compile`` and a user's ``torch.compile(module, fullgraph=True)`` (the graphs handed
    to their backend); and a user's ``fullgraph=True`` compile of a function that calls the
    module, which asks for one uncompiled call with a new shape."""
    torch.manual_seed(0)
    model = GPT()
    shapes = [(4, 16), (4, 16), (2, 16), (2, 16), (4, 16)]
    batches = [(torch.randint(0, 64, s), torch.randint(0, 64, s)) for s in shapes]
    pin, ref = _pins("dp", model, batches[0], (2,)), copy.deepcopy(model)
    made = [autoshard.parallelize(copy.deepcopy(model), batches[0], pin=pin, verbose=False, compile=c)
            for c in (True, False, False, False)]
    graphs = []

    def counting(gm, example_inputs):   # a backend that counts the graphs it is given
        graphs.append(gm)
        return gm.forward

    def step(m, batch):
        loss = m(*batch)
        loss.backward()
        return rel_err(loss, ref(*batch))

    out = {"option": [], "method": [], "user": [], "errs": []}
    torch.compiler.reset()
    for b in batches:
        before = graphs_compiled()
        out["errs"].append(step(made[0], b))
        out["option"].append(graphs_compiled() - before)
    for key, run in (("method", made[1]), ("user", made[2])):
        torch.compiler.reset()   # dynamo keeps what it compiled by the code: each program's
        graphs.clear()
        if key == "method":
            made[1].compile(backend=counting)
        else:
            run = torch.compile(made[2], backend=counting, fullgraph=True, dynamic=False)
        for b in batches:
            out["errs"].append(step(run, b))
            out[key].append(len(graphs))
    torch.compiler.reset()
    strict = torch.compile(_calling(made[3]), backend=counting, fullgraph=True, dynamic=False)
    out["errs"].append(step(strict, batches[0]))
    try:
        step(strict, batches[2])
        out["strict"] = "ran"
    except Exception as e:  # noqa: BLE001 - the error's text is the result
        out["strict"] = str(e)
    made[3](*batches[2])   # once uncompiled: the program for the new shape
    before = len(graphs)
    out["errs"].append(step(strict, batches[2]))
    out["strict_graphs"] = len(graphs) - before
    out["programs"] = [len(m._programs) for m in made]
    return out


def _users_shares(nested=False):
    """A user's compile (a backend that records its graph's inputs) of data parallel, a step; then
    one parameter frozen in the module and in the model on one device, and another step.
    ``nested``: the user compiles a function that calls the module."""
    torch.manual_seed(0)
    model = GPT()
    inputs = (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    ref = copy.deepcopy(model)
    pm = autoshard.parallelize(model, inputs, pin=_pins("dp", model, inputs, (2,)), verbose=False)
    kinds = []   # per graph, how many of its inputs are DTensors

    def recording(gm, example_inputs):
        kinds.append(sum(isinstance(x, DTensor) for x in example_inputs))
        return gm.forward

    torch._dynamo.reset()
    run = torch.compile(_calling(pm) if nested else pm, backend=recording, fullgraph=True)
    out = {}
    for step, frozen in enumerate((None, "blocks.0.fc.weight")):
        if frozen is not None:
            pm.get_parameter(frozen).requires_grad_(False)
            ref.get_parameter(frozen).requires_grad_(False)
        for m in (pm, ref):
            m.zero_grad()
        losses = [m(*inputs) for m in (run, ref)]
        for loss in losses:
            loss.backward()
        ref_params = dict(ref.named_parameters())
        out[step] = {"loss": rel_err(*losses), "frozen": frozen and pm.get_parameter(frozen).grad,
                     "grads": max(rel_err(p.grad.full_tensor(), ref_params[n].grad)
                                  for n, p in pm.named_parameters() if n != frozen)}
    out["kinds"] = kinds
    return out


SCHEMES = ["dp", "megatron", "fsdp"]
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# world 2, by key: compile=True and a user's compile on each scheme; recomputed blocks (whole, and
# selectively), dropout, gradient buckets small enough to be several. Cases share a compile where
# they can (inductor's compiles are the module's minutes): compile=True on data parallel runs with
# dropout and small buckets, a user's compile of data parallel and FSDP recomputes every block
# (world 4 compiles both with every activation kept, and Megatron under compile=True recomputed)
WORLD2 = {**{("option", s): (_compile_option, s) for s in SCHEMES},
          **{("user", s): (_user_compile, s, (2,)) for s in SCHEMES},
          ("autotune", "megatron"): (_max_autotune, "megatron"),
          ("method", "megatron"): (_case, "megatron", (2,)),
          ("option", "fsdp", "blocks"): (_case, "fsdp", (2,)),
          ("shapes",): (_shapes,),
          ("user", "megatron", "selective"): (_user_compile, "megatron", (2,), None, "selective"),
          ("user", "megatron", "dropout", "blocks"): (_user_compile, "megatron", (2,), None, "blocks"),
          ("shares",): (_users_shares,),
          ("shares", "nested"): (_users_shares, True),
          ("nested", "fsdp"): (_user_compile, "fsdp", (2,)),
          ("saved", "dp", "none"): (_saved, "dp", "none"),
          ("saved", "dp", "blocks"): (_saved, "dp", "blocks")}
WORLD2_KW = {("option", "dp"): {"bucket_bytes": 20_000, "dropout": 0.3},
             ("user", "dp"): {"recompute": "blocks"},
             ("user", "fsdp"): {"recompute": "blocks"},
             ("nested", "fsdp"): {"nested": True},
             ("method", "megatron"): {"backend": "inductor", "method": True},
             ("option", "fsdp", "blocks"): {"compile_option": True, "recompute": "blocks"},
             ("user", "megatron", "dropout", "blocks"): {"dropout": 0.3}}
# world 4, a user's compile: a 2-D plan, FSDP under the bf16 policy, data parallel, Megatron under
# the bf16 policy with every block recomputed; compile=True: a 2-D plan under the bf16 policy with
# every block recomputed
WORLD4 = [("user", "2d", (2, 2), None, None), ("user", "fsdp", (4,), BF16, None), ("user", "dp", (4,), None, None),
          ("user", "megatron", (4,), BF16, "blocks"), ("option", "2d", (2, 2), BF16, "blocks")]


def _call(fn, *args, **kw):
    return fn(*args, **kw)


def _keyed(key):
    fn, *args = WORLD2[key]
    return _call(fn, *args, **WORLD2_KW.get(key, {}))


def _world_run(n, fn, cases):
    # one group per size for the module, given the minutes inductor's compiles take on 2 cores
    from autoshard.testing.launch import LocalWorld
    with LocalWorld(n, timeout_s=900) as world:
        return world.run(run_each, fn, cases)


@pytest.fixture(scope="module")
def world2_results():
    return by_case(list(WORLD2), _world_run(2, _keyed, [(k,) for k in WORLD2]))


def _world4_case(kind, scheme, mesh, policy, recompute):
    if kind == "option":
        return _case(scheme, mesh, compile_option=True, policy=policy, recompute=recompute)
    return _user_compile(scheme, mesh, policy, recompute)


@pytest.fixture(scope="module")
def world4_results():
    return _world_run(4, _world4_case, WORLD4)


def _check(r, tol=TOL):
    assert "error" not in r, r.get("error")
    assert max(r["loss"]) <= tol, r["loss"]
    for n, (vs_ref, vs_eager) in r["grads"].items():
        assert vs_ref <= tol and vs_eager <= tol, (n, vs_ref, vs_eager)
    assert r["again"] <= tol, r["again"]
    assert r["programs"] == 1   # the same shapes again: no new program, nothing compiled again


@pytest.mark.parametrize("scheme", SCHEMES)
def test_compile_option_matches_eager_and_single_device(world2_results, scheme):
    for r in world2_results[("option", scheme)]:
        _check(r)
        assert r["passes"].endswith("compile"), r["passes"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_users_compile_has_no_graph_break_and_matches(world2_results, scheme):
    for r in world2_results[("user", scheme)]:
        _check(r)
        assert r["breaks"] == 0 and r["graphs"] == 1, (r["breaks"], r["graphs"])
        assert r["spec_guards"] == 0, r["spec_guards"]   # the program compiled: no DTensor to guard


def test_users_function_calling_the_module_traces_it_whole(world2_results):
    """A user's compiled function that calls the module (FSDP: its parameters gathered again in
    backward) traces the call whole, the feed included: no graph break, exact."""
    for r in world2_results[("nested", "fsdp")]:
        _check(r)
        assert r["breaks"] == 0 and r["graphs"] == 1, (r["breaks"], r["graphs"])


def test_users_max_autotune(world2_results):
    for r in world2_results[("autotune", "megatron")]:
        _check(r)
        assert r["breaks"] == 0 and r["graphs"] == 1, (r["breaks"], r["graphs"])


@pytest.mark.parametrize("key", [("option", "fsdp", "blocks"), ("user", "dp"), ("user", "megatron", "selective"),
                                 ("user", "fsdp")], ids="-".join)
def test_recomputed_blocks_compile_and_match(world2_results, key):
    """``recompute`` under compile=True and a user's compile: every block checkpointed, traced
    with no graph break, exact."""
    for r in world2_results[key]:
        _check(r)
        assert r["recomputed"] == 2, r["recomputed"]   # the GPT's two blocks
        if key[0] == "user":
            assert r["breaks"] == 0 and r["graphs"] == 1, (r["breaks"], r["graphs"])


@pytest.mark.parametrize("nested", [False, True], ids=["module", "function"])
def test_users_compile_feeds_plain_shares(world2_results, nested):
    """A user's ``torch.compile`` of the module compiles its program, which takes each parameter's
    share, a plain tensor made outside the trace, as ``compile=True`` does, not the DTensor
    parameter (whose traced backward would wrap every gradient back into a DTensor); a parameter
    frozen after the compile is fed frozen (one more graph). A compiled function that calls the
    module traces the feed too: it feeds the same shares, and the frozen parameter's DTensor,
    read without a gradient. Every other gradient is one device's."""
    for r in world2_results[("shares", "nested") if nested else ("shares",)]:
        assert "error" not in r, r.get("error")
        assert r["kinds"] == ([0, 1] if nested else [0, 0]), r["kinds"]
        for step in (0, 1):
            assert r[step]["loss"] <= TOL and r[step]["grads"] <= TOL, r[step]
        assert r[1]["frozen"] is None


def test_recomputed_blocks_keep_less_when_compiled(world2_results):
    """Compiled, the recomputed blocks keep only their inputs (and what draws at random) for
    backward: the forward saves less than with every activation kept."""
    kept, recomputed = world2_results[("saved", "dp", "none")], world2_results[("saved", "dp", "blocks")]
    for a, b in zip(kept, recomputed):
        assert "error" not in a and "error" not in b, (a.get("error"), b.get("error"))
        assert b["recomputed"] == 2 and a["recomputed"] == 0
        assert b["bytes"] < 0.7 * a["bytes"], (b["bytes"], a["bytes"])


@pytest.mark.parametrize("key", [("option", "dp"), ("user", "megatron", "dropout", "blocks")],
                         ids="-".join)
def test_dropout_draws_the_masks_eager_draws(world2_results, key):
    """Dropout compiled draws from the generator every rank shares, as eager autoshard does: from
    one seed, compiled, eager and one device drop the same units (recomputed blocks too), and
    the masks matter (another seed, another loss)."""
    for r in world2_results[key]:
        _check(r)
        assert r["other_seed"] > 1e-3, r["other_seed"]


def _hidden(order):
    """How many of a program's collectives have a matmul between their start and their wait."""
    return sum(any(k.startswith("extern_kernels.") and k.endswith("mm") for k in between) for _, between in order)


def test_compiled_megatron_waits_after_the_weight_gradients(world2_results):
    """A Megatron backward's all-reduce of the input gradient starts, the weight gradient's matmul
    (which does not need it) runs, then it is waited on: inductor's comm passes (compile=True)."""
    for r in world2_results[("option", "megatron")]:
        forward, backward = r["order"]
        assert [op for op, _ in backward] == ["all_reduce_"] * 5, backward
        assert _hidden(backward) >= 3, backward


def test_module_compile_reorders_collectives(world2_results):
    """``module.compile()`` (inductor) compiles the programs as compile=True does, with its comm
    passes: the Megatron backward's all-reduces wait after the weight gradients, as in
    test_compiled_megatron_waits_after_the_weight_gradients; exact. Its compiled graphs take the
    parameters' shares as plain tensors, so no call checks a parameter's layout."""
    for r in world2_results[("method", "megatron")]:
        _check(r)
        assert r["passes"].endswith("compile"), r["passes"]   # the program made at parallelize, compiled
        assert r["spec_guards"] == 0, r["spec_guards"]
        assert r["breaks"] == 0 and r["graphs"] == 1, (r["breaks"], r["graphs"])
        forward, backward = r["order"]
        assert [op for op, _ in backward] == ["all_reduce_"] * 5, backward
        assert _hidden(backward) >= 3, backward


def test_compiled_fsdp_packs_its_bucket_gradients_by_one_cat(world2_results):
    """FSDP compiled: the gather bucket's parameters are cut from the gathered buffer by one split,
    so its backward puts their gradients back by one cat, as eager's; none is written into a
    zeroed whole buffer of its own (``slice_backward``), a kernel that read the buffer once per
    parameter (80 ms of a 330 ms step at d=256, ``benchmarks/compile.py``)."""
    for r in world2_results[("option", "fsdp")]:
        forward, backward = r["order"]
        assert [op for op, _ in forward] == ["all_gather_into_tensor", "all_reduce_"], forward
        assert [op for op, _ in backward] == ["reduce_scatter_tensor"], backward
        assert r["slice_backward"] == 0, r["slice_backward"]


def test_compiled_gradient_buckets_overlap_backward(world2_results):
    """Data parallel with several gradient buckets: each bucket's all-reduce but the last runs
    beside the backward matmuls of the layers before it, as the schedule starts them."""
    for r in world2_results[("option", "dp")]:
        _check(r)
        forward, backward = r["order"]
        buckets = [b for op, b in backward]
        assert len(buckets) >= 4, backward
        assert _hidden(backward) >= len(buckets) - 2, backward


@pytest.mark.parametrize("index", range(len(WORLD4)),
                         ids=[f"{c[0]}-{c[1]}-{'x'.join(map(str, c[2]))}-{'bf16' if c[3] else 'fp32'}-{c[4] or 'kept'}"
                              for c in WORLD4])
def test_compile_world4(world4_results, index):
    kind, _, _, policy, recompute = WORLD4[index]
    for rank in world4_results:
        r = rank[index]
        _check(r, BF16_TOL if policy is not None else TOL)
        if kind == "user":
            assert r["breaks"] == 0 and r["graphs"] == 1, (r["breaks"], r["graphs"])
        else:
            assert r["passes"].endswith("compile"), r["passes"]
        if recompute is not None:
            assert r["recomputed"] == 2, r["recomputed"]


def test_same_shape_compiles_nothing_new_shape_once(world2_results):
    """Calls of shapes (4, 16), (4, 16), (2, 16), (2, 16), (4, 16): compile=True compiles one graph
    (forward and backward) on the first call of each new shape, nothing else; so do ``module.compile``
    and a user's ``torch.compile(module, fullgraph=True)``, which hand their backend each new
    shape's program. A user's ``fullgraph=True`` compile of a function that calls the module asks
    for one uncompiled call at a new shape (its program is made outside the trace), after which it
    runs compiled. Every loss is one device's."""
    for r in world2_results[("shapes",)]:
        assert "error" not in r, r.get("error")
        assert r["option"] == [1, 0, 1, 0, 0], r["option"]
        assert r["method"] == [1, 1, 2, 2, 2], r["method"]
        assert r["user"] == [1, 1, 2, 2, 2], r["user"]
        assert "call the parallel module once uncompiled" in r["strict"], r["strict"]
        assert r["strict_graphs"] == 1, r["strict_graphs"]
        assert r["programs"] == [2, 2, 2, 2], r["programs"]
        assert max(r["errs"]) <= TOL, r["errs"]


def test_compile_is_checked():
    with pytest.raises(TypeError, match="compile is True or False"):
        autoshard.parallelize(GPT(), compile="yes")
