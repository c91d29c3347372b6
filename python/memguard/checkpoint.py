"""``from memguard.checkpoint import wrap``: activation checkpointing that
the guard switches on and off (:mod:`memguard.train.checkpoint`) under its
short name."""
from memguard.train.checkpoint import Checkpoints, wrap

__all__ = ["Checkpoints", "wrap"]
