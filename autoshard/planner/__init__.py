"""The planner: the layout program's solver, its relaxations and bounds, the mesh search and its
descent, the forked copies that share it out, recomputation as a choice, repeated blocks."""
