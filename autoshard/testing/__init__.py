"""Running many ranks without torchrun: a local gloo group of processes, and every rank simulated
in one process for larger worlds."""
