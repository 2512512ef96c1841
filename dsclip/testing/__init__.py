"""Fixtures the test suite and bench/ share (as torch.testing is for torch): neither imports the other.

- gloo_world: run a function on N gloo ranks in fresh processes forked from a pre-imported server.
- gradcache: the tiny model, its seeded batch and run config behind the gradient-cache equality suite.

Nothing in dsclip's training path imports this package.
"""
