"""examples/train.py as a torchrun user runs it, at world 2: the losses it prints against the same
training on one device (its ``single``: the same global batches in the same order, the forward on
bf16 copies of the fp32 parameters), through an epoch's ragged last batch; and a DCP checkpoint
taken mid-run, resumed by a fresh torchrun, going on as the run that was never interrupted."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train.py")
STEPS, SAVED = 10, 4   # at world 2 an epoch is 7 steps, its last of 2 rows a rank: both runs cross it
# a preset rather than the example's default (measure this machine): the same plan in both launches
# and no seconds of measuring; the plan of a model this small is data parallel either way
OPTIONS = ["--steps", str(STEPS), "--cluster", "a100-80gb-nvlink-ib"]
STEP = re.compile(r"^step +(\d+) \| loss ([\d.]+) \| .* \| +(\d+) tokens$", re.M)

pytestmark = pytest.mark.long("two torchrun launches at world 2 and a one-device run: about 35 s on 2 busy cores")


def torchrun(*options, cache):
    """The example under torchrun at world 2: {step: (loss, tokens)}, and what rank 0 printed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               AUTOSHARD_PLAN_CACHE=str(cache), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", EXAMPLE,
           *OPTIONS, *options]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return {int(s): (float(loss), int(tokens)) for s, loss, tokens in STEP.findall(done.stdout)}, done.stdout


def one_device():
    """The example's single-device losses for the global batches of a launch at world 2."""
    spec = importlib.util.spec_from_file_location("train_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as each rank runs; and the cores are shared
    try:
        return example.single(example.parse(OPTIONS + ["--world", "2"]), verbose=False)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    whole, printed = torchrun("--save", str(tmp / "ckpt"), "--save-every", str(SAVED), cache=tmp / "plans")
    resumed, printed_resumed = torchrun("--resume", str(tmp / "ckpt" / f"step-{SAVED}"), cache=tmp / "plans")
    return {"whole": whole, "printed": printed, "resumed": resumed, "printed_resumed": printed_resumed,
            "saved": sorted(os.listdir(tmp / "ckpt")), "single": one_device()}


def test_world_2_losses_are_one_devices_under_bf16(runs):
    whole, single = runs["whole"], runs["single"]
    assert sorted(whole) == list(range(1, STEPS + 1))
    losses = [whole[s][0] for s in sorted(whole)]
    # the first step: the same bf16 weights on the same rows, only summed in another order
    assert losses[0] == pytest.approx(single[0], rel=1e-3)
    # then bf16-sized: each side rounds its own gradients before AdamW (2^-7 is bf16's epsilon;
    # the two agree within 2e-4 on this machine)
    assert losses == pytest.approx(single, rel=1e-2)
    assert losses[-1] < 0.9 * losses[0], "it trains"


def test_the_ragged_last_batch_runs(runs):
    tokens = {s: t for s, (_, t) in runs["whole"].items()}
    assert tokens[7] == 2 * 2 * 32 and all(t == 2 * 8 * 32 for s, t in tokens.items() if s != 7), tokens
    assert re.search(r"^full batches: median [\d.]+ ms a step, \d+ tok/s", runs["printed"], re.M)


def test_resumed_from_a_checkpoint_as_never_interrupted(runs):
    assert runs["saved"] == sorted(f"step-{s}" for s in (SAVED, 2 * SAVED, STEPS))
    assert "resumed from " in runs["printed_resumed"]
    resumed, whole = runs["resumed"], runs["whole"]
    assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1))
    # the same program (the plan kept on disk) on the same rows from the same state
    for step in resumed:
        assert resumed[step][0] == pytest.approx(whole[step][0], rel=1e-5), step
