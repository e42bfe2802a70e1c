"""Reading a plan: the summary at a glance with repeated blocks folded, the full per-op table."""
import torch

import autoshard
from autoshard.report import summary
from models import GPT


def gpt_meta(layers, d=256, heads=4, vocab=1024, seq=128, batch=64):
    with torch.device("meta"):
        model = GPT(vocab=vocab, d=d, heads=heads, layers=layers, seq=seq)
        idx = torch.empty(batch, seq, dtype=torch.long)
        return model, (idx, idx)


def test_summary_of_a_12_layer_gpt_at_256_reads_at_a_glance():
    model, inputs = gpt_meta(layers=12)
    plan = autoshard.plan(model, inputs, mesh=(256,))
    text = str(plan)
    lines = text.splitlines()
    assert len(lines) <= 150, len(lines)
    assert lines[0].startswith("autoshard plan: 256 devices as mesh (256,) on a100-80gb-nvlink-ib (8 per node, 32 nodes)")
    assert "axis 0: 256 devices 1 apart, across 32 nodes" in text
    assert "(estimated, per step) = compute" in text and "exposed communication" in text
    assert "hidden communication" in text
    assert f"of a {summary.fmt_bytes(plan.memory['budget'])} budget" in text
    assert "solver: OPTIMAL" in text and "optimality gap" in text
    # every block laid out alike: one folded row for the twelve, with a row per module inside
    assert sum(line.startswith("blocks.") for line in lines) == 1
    assert any(line.startswith("blocks.0-11 x12") for line in lines)
    for sub in ("ln1", "qkv", "proj", "ln2", "fc", "fc2"):
        assert any(line.startswith(f"  {sub} ") for line in lines), sub
    assert "largest collectives" in text
    # the full table has every node
    table = plan.table()
    for name, n in plan.nodes.items():
        if n.kind != "output":
            assert name in table
    assert len(table.splitlines()) > len(lines)


def test_folded_names():
    assert summary._indices(list(range(12))) == "0-11"
    assert summary._indices([0, 2, 4, 6, 8, 10]) == "0,2,..,10"
    assert summary._indices([1, 4]) == "1,4"
    assert summary._unit("blocks.3.attn.qkv") == ("blocks", 3, "attn.qkv")
    assert summary._unit("model.layers.10") == ("model.layers", 10, "")
    assert summary._unit("head") == ("head", None, "")
