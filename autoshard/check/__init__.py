"""Checks of the SBP rules against the real ops, on ranks simulated in one process:
``validate`` runs every signature a rule offers through the rewriter's lowerings, ``opinfo`` over
torch's own OpInfo samples."""
