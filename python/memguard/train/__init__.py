"""Training under a memory budget: the guard and its step transaction
(:mod:`~memguard.train.guard`, :mod:`~memguard.train.step`), the batch split
(:mod:`~memguard.train.batch`), accumulation, GradCache, checkpointing, the
batch-size finder and the ranks' agreement under DDP. These modules need
torch; ``import memguard`` loads them on first use."""
