"""``from memguard.lightning import MemGuardCallback, MemGuardModule``: the
Lightning integration (:mod:`memguard.integrations.lightning`) under its
short name."""
from memguard.integrations.lightning import MemGuardCallback, MemGuardModule

__all__ = ["MemGuardCallback", "MemGuardModule"]
