"""The command line: ``python -m autoshard plan MODULE:FACTORY`` and ``show``, and the ``autoshard``
console script."""
import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:   # Python 3.10
    import tomli as tomllib

import pytest

import autoshard
from autoshard import cli

ROOT = Path(__file__).resolve().parents[1]

FACTORY = '''
import torch
from models import GPT
made_on = []


def build():
    made_on.append(torch.empty(0).device.type)
    model = GPT(vocab=256, d=64, heads=4, layers=2, seq=32)
    idx = torch.zeros(16, 32, dtype=torch.long)
    return model, (idx, idx)


def not_a_pair():
    return 3
'''


@pytest.fixture(scope="module")
def factory(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "factories.py").write_text(FACTORY)
    sys.path.insert(0, str(Path(__file__).parent))   # the factory imports tests/models.py
    return d / "factories.py"


def run(*argv):
    out = io.StringIO()
    code = cli.main(list(argv), out=out)
    return code, out.getvalue()


def test_plan_prints_the_summary_and_saves_json_and_html(factory, tmp_path, capsys):
    js, page = tmp_path / "plan.json", tmp_path / "plan.html"
    code, text = run("plan", f"{factory}:build", "--mesh", "4", "--json", str(js), "--html", str(page),
                     "--explain", "blocks.0.fc.weight")
    assert code == 0, capsys.readouterr().err
    plan = autoshard.Plan.from_json(js.read_text())
    assert text.startswith(str(plan).splitlines()[0])   # the summary first
    assert "blocks.0-1 x2" in text and "largest collectives" in text
    assert plan.explain("blocks.0.fc.weight") in text
    assert page.read_text().startswith("<!DOCTYPE html>")
    assert plan.mesh_shape == (4,)
    mod = sys.modules["factories"]
    assert mod.made_on == ["meta"]                     # built on the meta device by default
    # show: the saved plan, as it was printed
    code, shown = run("show", str(js))
    assert code == 0 and shown.strip() == str(plan).strip()
    code, table = run("show", str(js), "--table")
    assert code == 0 and table.strip() == plan.table().strip()


def test_bad_input_says_what_to_pass(factory, capsys):
    for argv, words in [
        (["plan", f"{factory}:build"], "--world N, or --mesh"),
        (["plan", str(factory), "--world", "4"], "MODULE:FACTORY"),
        (["plan", f"{factory}:missing", "--world", "4"], "no function 'missing'"),
        (["plan", f"{factory}:not_a_pair", "--world", "4"], "must return (model, example_inputs)"),
        (["plan", "no/such/file.py:build", "--world", "4"], "no file"),
        (["show", "no-such-plan.json"], "No such file"),
    ]:
        code, _ = run(*argv)
        err = capsys.readouterr().err
        assert code == 2 and words in err, (argv, err)
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["plan", f"{factory}:build", "--mesh", "a,b"])
    assert "a mesh is axis sizes" in capsys.readouterr().err


def test_help_documents_every_option():
    ap = cli.parser()
    subs = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subs.choices.items():
        text = sub.format_help()
        for action in sub._actions:
            assert action.help, (name, action.dest)
            for flag in action.option_strings:
                assert flag in text
    out = subprocess.run([sys.executable, "-m", "autoshard", "plan", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "MODULE:FACTORY" in out.stdout and "--world" in out.stdout


def test_console_script():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, fn = scripts["autoshard"].partition(":")
    assert (module, fn) == ("autoshard.cli", "main")
    assert cli.main is getattr(__import__(module, fromlist=[fn]), fn)


def test_the_examples_factory_is_a_pair():
    sys.path.insert(0, str(ROOT / "examples"))
    import gpt_factory
    import torch
    with torch.device("meta"):
        model, inputs = gpt_factory.gpt_tiny()
    assert isinstance(model, torch.nn.Module) and len(inputs) == 2
    json.dumps(cli.EXAMPLES)   # the help's examples name it
    assert "examples/gpt_factory.py:gpt2_small" in cli.EXAMPLES


def test_the_readme_command_plans_the_examples_factory():
    """The README's command line, from the repository root in a fresh process: the factory's file
    is loaded by its path, and its own import of quickstart works."""
    done = subprocess.run([sys.executable, "-m", "autoshard", "plan", "examples/gpt_factory.py:gpt_tiny", "--mesh", "2,2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "mesh (2, 2)" in done.stdout, done.stdout


def test_the_quickstart_trains_as_one_device():
    """The demo's part 2: a tiny GPT on 4 gloo processes beside one device. The first loss (no
    optimizer step yet) is the same; after Adam steps, last-bit gradient differences may move a
    parameter by up to lr, so later losses agree to a looser bound."""
    sys.path.insert(0, str(ROOT / "examples"))
    import quickstart
    from autoshard.testing.launch import run_local
    for losses, shares in run_local(quickstart.train, 4, 3):
        (first, ref_first), *later = losses
        assert abs(first - ref_first) <= 1e-5 * abs(ref_first), losses
        assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in later), losses
        assert set(shares) == {"emb.weight", "blocks.0.qkv.weight", "blocks.0.fc2.weight"}   # what the demo prints

