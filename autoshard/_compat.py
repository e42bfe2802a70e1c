"""The private torch APIs autoshard needs, in one place.

torch.utils._pytree flattens and rebuilds nested inputs and outputs exactly as torch.export saw
them (ExportedProgram.call_spec holds its TreeSpecs); torch has no public equivalent yet.
"""
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: F401
