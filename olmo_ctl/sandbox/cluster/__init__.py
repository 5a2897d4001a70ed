"""A test cluster driven by causes: the world says what happens (capacity, a container's exit, a
lost node); the controllers' rules, ported from JobSet v0.10.1, Kueue v0.17.1 and batch/v1 Jobs,
say what follows. See docs/test-cluster.md."""

from olmo_ctl.sandbox.cluster.world import World

__all__ = ["World"]
