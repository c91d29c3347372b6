"""Memory the process holds, and how it is given back: the CPU arena
(:mod:`~memguard.memory.arena`), CUDA (:mod:`~memguard.memory.cuda`), gc
hooks that relieve pressure (:mod:`~memguard.memory.gc_hooks`), the live
budget a guard plans against (:mod:`~memguard.memory.room`), telling an
out-of-memory error apart (:mod:`~memguard.memory.oom`), and real memory
limits for tests and demos (:mod:`~memguard.memory.limits`)."""
