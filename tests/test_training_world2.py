"""The ways people train, at world 2 (the other modules run them at world 4): a bf16 policy,
the caller's autocast, checkpoint regions, recomputed blocks and no_sync accumulation, each on
Megatron's (2,) plan (every block's linears split over both ranks), against one device. One
gloo group for the module; the cases are the world-4 modules' own."""
import pytest

from test_accumulate import accumulate_case
from test_precision import autocast_case, bf16_tol, checkpoint_case, policy_case
from test_recompute import exact_case

MESH = (2,)


def _within(grads: dict, tol: float) -> dict:
    return {n: e for n, e in grads.items() if e > tol}


@pytest.fixture(scope="module")
def runs(world2):
    return {"policy": world2.run(policy_case, "megatron", MESH),
            "autocast": world2.run(autocast_case, "megatron", MESH),
            "checkpoint": world2.run(checkpoint_case, True, MESH),
            "plain": world2.run(checkpoint_case, False, MESH),
            "blocks": world2.run(exact_case, "blocks", MESH, None),
            "no_sync": world2.run(accumulate_case, "gpt", None, MESH, True)}


def test_policy_bf16_at_world2(runs):
    for res in runs["policy"]:
        assert res["split"]
        assert res["dtypes"] == {"torch.float32"} and res["loss_dtype"] == "torch.bfloat16"
        for ref in ("policy", "autocast"):
            assert res[ref]["loss"] <= bf16_tol(res), (ref, res[ref]["loss"], res["noise"])
            assert not _within(res[ref]["grads"], bf16_tol(res)), (ref, res["noise"])


def test_user_autocast_at_world2(runs):
    for res in runs["autocast"]:
        assert res["split"] and res["precision"] == {"policy": None, "autocast": "bfloat16"}
        assert res["loss"] <= bf16_tol(res) and not _within(res["grads"], bf16_tol(res)), res["noise"]


def test_user_checkpoint_regions_at_world2(runs):
    for plain, ckpt in zip(runs["plain"], runs["checkpoint"]):
        assert ckpt["split"]
        assert not _within(plain["grads"], 1e-5) and not _within(ckpt["grads"], 1e-5)
        assert ckpt["held"] < 0.6 * plain["held"]   # the regions' activations gone after forward
        assert ckpt["again"] > 0 and plain["again"] == 0   # and made again in backward


def test_recomputed_blocks_at_world2(runs):
    for res in runs["blocks"]:
        assert res["loss"] <= 1e-5 and res["grad"] <= 1e-5, res
        assert res["regions"] == 4 and "all_reduce" in res["kinds"]


def test_no_sync_at_world2(runs):
    for diff, empty, _ in runs["no_sync"]:
        assert diff <= 1e-5 and empty


def preset_warnings():
    """A fresh process: the first parallelize on CPUs under the default cluster warns that it
    plans for A100 GPUs and what to pass; the next does not, nor one given a cluster."""
    import warnings
    import torch
    import autoshard
    from autoshard.api import PresetWarning
    from models import MLP
    x = torch.randn(8, 32)
    said = []
    for cluster in (None, None, "a100-80gb-nvlink-ib"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            autoshard.parallelize(MLP(), (x,), cluster=cluster, verbose=False)
        said.append([str(w.message) for w in caught if w.category is PresetWarning])
    planned = autoshard.plan(MLP(), (x,), mesh=(2,))
    return said, (planned.cluster.name, planned.cluster.name in str(planned))


def test_a_cpu_group_planned_for_the_default_gpus_is_told_once_what_to_pass():
    from autoshard.testing.launch import run_local
    for said, priced_on in run_local(preset_warnings, 2):
        assert len(said[0]) == 1 and said[1:] == [[], []], said
        assert "A100 GPUs" in said[0][0] and 'cluster="measure"' in said[0][0]
        assert priced_on == ("a100-80gb-nvlink-ib", True)   # and the summary says so
