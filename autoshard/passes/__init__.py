"""The stages, in the order a model flows through them:
capture -> annotate -> solve -> rewrite -> schedule."""
