"""The names of the events memguard writes beside its samples.

An event record in a JSONL run is ``{"type": "event", "event": <name>,
"t": <epoch s>, ...}``; the exporters, ``memguard report`` and the
TensorBoard exporter all read the names from here.
"""
from __future__ import annotations

import enum


class Event(str, enum.Enum):
    """An event's name, compared and written as its string value."""

    #: Guard.install: the budget, the room and whether the arena serves tensors
    INSTALL = "install"
    #: the live budget moved by more than 1/32 at a step boundary
    ROOM = "room"
    #: swapped-out pages of the process read back in after pressure eased
    SWAP_IN = "swap_in"
    #: a committed step, with the planner's inputs and decision
    STEP = "step"
    #: a step ran out of memory and is redone at a smaller micro-batch
    OOM_RECOVERED = "oom_recovered"
    #: a step ran out of memory at the smallest micro-batch and was rolled back
    OOM_GAVE_UP = "oom_gave_up"
    #: Guard.infer's own plan changed its micro-batch size (an out-of-memory
    #: error, the room, pressure, growth); the training plan is apart
    INFER_PLAN = "infer_plan"
    #: post_step raised after the step was committed
    POST_STEP_FAILED = "post_step_failed"
    #: blocks were checkpointed, or switched back off
    CHECKPOINT = "checkpoint"
    #: CRITICAL pressure with nothing left to shrink or checkpoint
    CRITICAL = "critical"
    #: a gc relief: collection, allocator trims, CUDA cache release
    RELIEVE = "relieve"
    #: the CUDA governor's advice on the device's allocator settings
    CUDA_ADVICE = "cuda_advice"
    #: PyTorch's CUDA allocator ran out of memory
    CUDA_OOM = "cuda_oom"
    #: tensors served past the soft tensor budget outside a guarded step
    OVERRUN = "overrun"
    #: advice, once per guard: the DataLoader workers (child processes) hold
    #: a tenth of the budget or more, or keep the step from its whole batch
    WORKERS = "workers"
    #: once per episode: the memory a run holds between steps grows, and at
    #: its rate reaches the budget within the horizon. Fields: ``step``,
    #: ``source`` (what was measured: "arena", "cuda", "rss"),
    #: ``level_bytes`` (the trend's value now), ``rate_bytes_per_step``,
    #: ``rate_bytes_per_epoch`` and ``epochs_left`` (``None`` where epochs
    #: are unknown), ``budget_bytes`` (what it reaches), ``steps_left``,
    #: ``reach_step``, ``seconds_left``, ``since_step`` (the trend's first
    #: step), ``growing`` (the census's largest growing groups, each
    #: ``{"what", "kind", "count", "added", "per_step", "bytes", "added_bytes"}``)
    #: and ``census_s`` (what the census cost)
    FORECAST = "forecast"
    #: once per guard: the whole batch peaks well below the budget. Fields:
    #: ``step``, ``source``, ``peak_bytes``, ``budget_bytes``, ``batch``,
    #: ``largest_batch`` (the largest the peak model predicts to fit, under
    #: ``multiple_of``/``divisor_of``), ``predicted_peak_bytes``, ``capped``
    #: (the model was not extrapolated further), ``queue`` (with
    #: ``divisor_of``: ``[{"batch", "queue"}]``, batches that fit with a queue
    #: size near the current one; else ``None``)
    HEADROOM = "headroom"

    def __str__(self) -> str:
        return self.value
