"""Factories for the command line: each returns ``(model, example_inputs)``.

    autoshard plan examples/gpt_factory.py:gpt2_small --world 256 --json plan.json --html plan.html
    autoshard show plan.json --explain blocks.0.qkv.weight

The command line calls a factory under ``torch.device("meta")``, so these build shapes only.
"""
import torch

from quickstart import GPT


def gpt2_small(batch=512, seq=1024, vocab=50304):
    """GPT-2 small's shape (12 blocks, d=768, 12 heads), a batch of 512 sequences of 1024 tokens."""
    model = GPT(vocab=vocab, d=768, heads=12, layers=12, seq=seq)
    idx = torch.randint(0, vocab, (batch, seq))
    return model, (idx, idx)


def gpt_tiny():
    """Four small blocks: plans in seconds."""
    model = GPT(vocab=1024, d=256, heads=4, layers=4, seq=128)
    idx = torch.randint(0, 1024, (64, 128))
    return model, (idx, idx)
