"""The command line: plan a model, or read a saved plan.

    python -m autoshard plan MODULE:FACTORY --world 256 [--mesh 32,8] [--cluster NAME]
                             [--json plan.json] [--html plan.html]
    python -m autoshard show plan.json [--table] [--explain NAME] [--html plan.html]

``FACTORY`` is a function of the module (an importable dotted name, or a path to a ``.py`` file)
that returns ``(model, example_inputs)``; it runs under ``torch.device("meta")`` unless
``--device`` says otherwise, so a model of any size is planned without its memory. The same is
installed as the ``autoshard`` console script.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

EXAMPLES = """examples:
  autoshard plan examples/gpt_factory.py:gpt2_small --world 256 --json plan.json --html plan.html
  autoshard plan mypkg.models:gpt_12 --mesh 32,8 --cluster h100-80gb-nvlink-ib --memory-budget 60
  autoshard show plan.json --explain blocks.0.qkv.weight
"""


def parser() -> argparse.ArgumentParser:
    from autoshard.machine.cluster import PRESETS
    ap = argparse.ArgumentParser(prog="autoshard", description="Plan how a PyTorch model is laid out across "
                                 "devices, and read the plan.", epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="{plan,show}")
    p = sub.add_parser("plan", help="plan a model built by a factory and print the plan's summary",
                       description="Plan a model built by MODULE:FACTORY and print the plan's summary.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("factory", metavar="MODULE:FACTORY",
                   help="a function returning (model, example_inputs): MODULE is a dotted module name "
                        "(importable from here) or a path to a .py file, FACTORY a function in it")
    p.add_argument("--world", type=int, help="devices to plan for; without --mesh, the mesh shape is searched")
    p.add_argument("--mesh", type=_mesh, help="the mesh's axis sizes, outermost first, e.g. 32,8 (their product "
                   "is the world)")
    p.add_argument("--cluster", default=None, help=f"a preset ({', '.join(sorted(PRESETS))}) or a cluster saved "
                   "with Cluster.save (a .json path); default: the default preset")
    p.add_argument("--memory-budget", type=float, metavar="GB", help="gigabytes per device the plan must fit "
                   "(default: the cluster's device memory)")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S", help="seconds the solver may take per "
                   "mesh (default 60)")
    p.add_argument("--inference", action="store_true", help="plan the forward only (default: a training step)")
    p.add_argument("--reshard-after-forward", action="store_true", help="free gathered parameters after "
                   "forward and gather them again for backward, as FSDP does")
    p.add_argument("--outputs", choices=("whole", "dtensor"), default="whole", help="the outputs made whole on "
                   "every rank (default), or handed back in their planned layouts as DTensors, their gather not priced")
    p.add_argument("--inputs", choices=("whole", "local"), default="whole", help="every rank passes the whole "
                   "batch (default), or its own rows of it (DDP's loader), their conversion to the plan's layouts priced")
    p.add_argument("--device", default="meta", help="device the factory builds the model on (default meta: "
                   "no memory, no weights)")
    p.add_argument("--json", metavar="PATH", help="save the plan as JSON (read it back with 'show' or "
                   "autoshard.Plan.from_json)")
    p.add_argument("--html", metavar="PATH", help="save the plan as one self-contained web page")
    _reading(p)
    p.add_argument("--quiet", action="store_true", help="no progress on stderr while planning, where the "
                   "planner reports it")
    s = sub.add_parser("show", help="print a plan saved as JSON",
                       description="Print a plan saved with 'plan --json' or Plan.to_json.")
    s.add_argument("path", metavar="PLAN.json", help="the saved plan")
    s.add_argument("--html", metavar="PATH", help="save the plan as one self-contained web page")
    _reading(s)
    return ap


def _reading(p) -> None:
    p.add_argument("--table", action="store_true", help="print every node of the graph, not the summary")
    p.add_argument("--explain", action="append", default=[], metavar="NAME", help="why a parameter (by its "
                   "name in the model) or a graph node is laid out as it is; may be given several times")


def _mesh(text: str) -> tuple:
    try:
        mesh = tuple(int(v) for v in text.replace("x", ",").split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"a mesh is axis sizes separated by commas, e.g. 32,8; got {text!r}")
    if not mesh:
        raise argparse.ArgumentTypeError("a mesh has at least one axis, e.g. --mesh 256")
    return mesh


def load_factory(spec: str):
    """The function ``MODULE:FACTORY`` names."""
    if ":" not in spec:
        raise ValueError(f"name the factory as MODULE:FACTORY (e.g. mymodels:build_gpt or path/models.py:build), "
                         f"got {spec!r}")
    module_name, _, attr = spec.rpartition(":")
    if module_name.endswith(".py") or os.sep in module_name:
        if not os.path.exists(module_name):
            raise ValueError(f"no file {module_name!r}: give a path to a .py file or an importable module")
        name = os.path.splitext(os.path.basename(module_name))[0]
        loaded = importlib.util.spec_from_file_location(name, module_name)
        module = importlib.util.module_from_spec(loaded)
        sys.modules[name] = module   # as an import would: pickling and the module's own imports find it
        sys.path.insert(0, os.path.dirname(os.path.abspath(module_name)))
        loaded.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_name)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{module_name} has no function {attr!r}; it needs one that returns (model, example_inputs)")
    return fn


def build(spec: str, device: str):
    import torch
    fn = load_factory(spec)
    with torch.device(device):
        made = fn()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise ValueError(f"{spec} must return (model, example_inputs), a torch.nn.Module and its inputs; "
                         f"got {type(made).__name__}")
    return made


def _cluster(text):
    if text and text.endswith(".json"):
        from autoshard.machine.cluster import Cluster
        return Cluster.load(text)
    return text


def read(plan, args, out) -> None:
    """Print the plan as the reading options say."""
    print(plan.table() if args.table else str(plan), file=out)
    for name in args.explain:
        print("", file=out)
        print(plan.explain(name), file=out)
    if args.html:
        plan.to_html(args.html)
        print(f"\nwrote {args.html}", file=out)


def main(argv=None, out=None) -> int:
    import autoshard
    out = out or sys.stdout
    args = parser().parse_args(argv)
    try:
        if args.command == "show":
            with open(args.path) as f:
                plan = autoshard.Plan.from_json(f.read())
            read(plan, args, out)
            return 0
        if args.world is None and args.mesh is None:
            raise ValueError("say how many devices to plan for: --world N, or --mesh A,B")
        model, inputs = build(args.factory, args.device)
        kwargs = dict(world=args.world, mesh=args.mesh, cluster=_cluster(args.cluster), training=not args.inference,
                      time_limit=args.time_limit, reshard_after_forward=args.reshard_after_forward,
                      outputs=args.outputs, inputs=args.inputs, verbose=not args.quiet)
        if args.memory_budget is not None:
            kwargs["memory_budget"] = args.memory_budget * 1e9
        plan = autoshard.plan(model, inputs, **kwargs)
        if args.json:
            with open(args.json, "w") as f:
                f.write(plan.to_json())
        read(plan, args, out)
        if args.json:
            print(f"wrote {args.json}", file=out)
        return 0
    except (ValueError, TypeError, KeyError, OSError, ImportError) as e:
        print(f"autoshard: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
