"""Plans kept on disk (autoshard.cache): a fresh group, as after a restart, takes rank 0's saved
plan instead of planning again, the same plan on every rank; other options or shapes plan anew;
the cache turned off or unwritable plans as before."""
import os

import torch

import autoshard
from autoshard.testing.launch import run_local
from models import GPT


def _gpt():
    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, heads=4, layers=2, seq=16)
    idx = torch.randint(0, 64, (8, 16))
    return model, (idx, torch.roll(idx, -1, dims=1))


def start(planning_allowed: bool, rows=8, **options):
    """One start of a training script: parallelize and a step. Where planning is not allowed,
    planning raises (a plan must come from the cache)."""
    from autoshard import api
    if not planning_allowed:
        def refuse(*args, **kwargs):
            raise AssertionError("planned although a saved plan was expected")
        api.plan_graph = refuse
    model, (idx, tgt) = _gpt()
    pm = autoshard.parallelize(model, (idx[:rows], tgt[:rows]), verbose=False, **options)
    loss = pm(idx[:rows], tgt[:rows])
    loss.backward()
    return pm.plan.to_json(), loss.item(), dict(pm.plan.params)


def test_a_restart_takes_the_saved_plan_and_other_options_plan_again(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_PLAN_CACHE", str(tmp_path))
    first = run_local(start, 2, True)
    assert len(os.listdir(tmp_path)) == 1
    again = run_local(start, 2, False)   # new processes: nothing but the file survives
    assert again == first and again[0] == again[1]
    # another option, another batch: planned again, and kept beside the first
    run_local(start, 2, True, bucket_bytes=1 << 16)
    run_local(start, 2, True, 4)
    assert len(os.listdir(tmp_path)) == 3


def test_off_or_unwritable_plans_as_before(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_PLAN_CACHE", "off")
    plain = run_local(start, 2, True)
    target = tmp_path / "file"
    target.write_text("not a directory")
    monkeypatch.setenv("AUTOSHARD_PLAN_CACHE", str(target))
    unwritable = run_local(start, 2, True)
    assert [r[1:] for r in unwritable] == [r[1:] for r in plain]   # the same loss and layout
    assert target.read_text() == "not a directory"


def test_a_mask_whose_mod_differs_is_planned_again():
    """Two attentions apart only in their FlexAttention mask's mod: one reads the batch index
    (``b < 1``), which makes splitting the batch wrong, the other does not. Their shapes and
    graphs agree but for the mod's region, which the key reads: a plan saved for one is never
    taken for the other (it was: the batch split of the first ran the second, silently wrong)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from autoshard import cache
    from autoshard.options import PlanOptions
    from autoshard.passes.capture import capture

    class Attention(torch.nn.Module):
        def forward(self, q, mask):
            return flex_attention(q, q, q, block_mask=mask)

    def window(b, h, q, kv):
        return (q >= kv) & (q - kv < 32)

    def first_row_whole(b, h, q, kv):
        return (q >= kv) & ((b < 1) | (q - kv < 32))

    # flex_attention captures through dynamo's cache of its kernel wrapper; after other modules' flex
    # calls in this process, torch 2.13 fails reporting why a cached entry does not fit (a TypeError
    # in dynamo's guard reasons), so the cache is emptied first
    torch.compiler.reset()
    q = torch.randn(4, 2, 256, 8)
    keys = {cache.key(capture(Attention(), (q, create_block_mask(mod, 4, None, 256, 256, device="cpu"))), (2,),
                      PlanOptions(training=False))
            for mod in (window, first_row_whole, window)}
    assert len(keys) == 2
