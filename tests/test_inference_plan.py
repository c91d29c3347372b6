"""Guard.infer plans its micro-batches apart from the training step: an
inference that runs out of memory leaves the training plan as it was, each
starts from its own last size, and inference shrinks for a room that fell
before it runs out of memory. Real torch; where a budget refuses, memguard's
arena under a real ``tensor_budget``."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import memguard
from memguard import Guard, GuardOOMError
from memguard.cli.report import scan
from memguard.memory import arena as allocator
from memguard.telemetry import read_jsonl

MiB = 2**20
N = 64
CPU_OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes"


pytestmark = pytest.mark.usefixtures("one_thread")


def hog(sizes: list[int]):
    """An inference holding 1 MiB a sample while it runs, recording each
    size it is given."""
    def fn(mb: torch.Tensor) -> torch.Tensor:
        sizes.append(len(mb))
        return torch.ones(len(mb), MiB // 4).sum(1) + mb[:, 0]
    return fn


def above(limit: int, sizes: list[int]):
    """An inference that runs out of memory on more than ``limit`` samples
    (as PyTorch's CPU allocator says it), recording each size it is given."""
    def fn(mb: torch.Tensor) -> torch.Tensor:
        sizes.append(len(mb))
        if len(mb) > limit:
            raise RuntimeError(CPU_OOM)
        return mb.sum(1)
    return fn


class Trainer:
    """A tiny regression and its optimizer, stepped by a guard."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.x, self.y = torch.randn(N, 4), torch.randn(N, 1)

    def loss(self, b: tuple) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.model(b[0]), b[1])

    def steps(self, guard: Guard, k: int, fail_above: int | None = None) -> list[int]:
        """``k`` steps; their sizes. ``fail_above``: the first step runs out
        of memory on more samples than that."""
        def loss_fn(b: tuple) -> torch.Tensor:
            if fail_above is not None and len(b[0]) > fail_above and not sizes:
                raise RuntimeError(CPU_OOM)
            return self.loss(b)
        sizes: list[int] = []
        for _ in range(k):
            sizes.append(guard.step((self.x, self.y), loss_fn, self.opt).micro_batch)
        return sizes


def test_training_after_a_refused_inference_runs_at_its_own_size(arena, tmp_path):
    """The reproduction: trained whole, then an inference that memguard's
    budget refuses above 8 samples; the training steps after it run whole
    still (they ran at 8 when both shared one plan), and telemetry tells
    the inference's decisions from the steps."""
    t, path = Trainer(), tmp_path / "run.jsonl"
    room = memguard.stats()["reserved_bytes.current"] + 12 * MiB    # 8 MiB fit, 16 do not
    with Guard(budget=None, tensor_budget=room, telemetry=path) as guard:
        if guard.allocator_error is not None:
            pytest.skip(guard.allocator_error)
        assert t.steps(guard, 2) == [N, N]
        x, sizes = torch.randn(N, 4), []
        with guard.evaluate():
            out = guard.infer(x, hog(sizes))
        torch.testing.assert_close(out, MiB // 4 + x[:, 0])
        assert sizes[:4] == [N, N // 2, N // 4, N // 8] and max(sizes[3:]) <= 8
        assert guard.ooms_recovered == 3 and guard.plan()["failed"] == 0
        assert t.steps(guard, 3) == [N, N, N]
    _, _, events = read_jsonl(path)
    assert [e["step"] for e in events if e["event"] == "step"] == [0, 1, 2, 3, 4]
    oom = [e for e in events if e["event"] == "infer_plan" and e["reason"] == "oom"]
    assert [(e["failed_micro_batch"], e["micro_batch"]) for e in oom] == \
        [(N, N // 2), (N // 2, N // 4), (N // 4, N // 8)]
    assert not any(e["event"] == "oom_recovered" for e in events)     # that is a step's
    run = scan(path)                     # memguard report: steps apart from the inference
    summary = run.summary(path)
    assert (summary.steps, summary.micro_batch_changes, summary.ooms_recovered) == (5, 0, 0)
    # every inference decision drawn (pressure on a busy host may add one)
    assert len(run.event_lines["infer_plan"]) == \
        sum(e["event"] == "infer_plan" for e in events) >= 3


def test_an_inference_oom_leaves_the_training_plan_its_ceiling_and_model(arena):
    """The training plan shrank once (a ceiling at 64) and learnt its peaks;
    an inference that runs out of memory above 8 samples, and whose peaks
    the inference plan learns, changes none of it."""
    t, guard = Trainer(), Guard(budget=None)
    assert t.steps(guard, 2, fail_above=32) == [32, 32]
    plan, changes = guard.plan(), guard.micro_batch_changes
    assert plan["failed"] == 64
    model = [guard.planner.planner.predict(m) for m in (8, 32, 64)]
    assert None not in model
    sizes: list[int] = []
    guard.infer(torch.randn(N, 4), above(8, sizes))
    assert sizes[:4] == [64, 32, 16, 8] and guard.inference.state()["failed"] == 16
    assert guard.inference.planner.predict(8) is not None    # it learnt, apart
    assert guard.plan() == plan and guard.micro_batch == 32
    assert [guard.planner.planner.predict(m) for m in (8, 32, 64)] == model
    assert guard.micro_batch_changes == changes
    assert t.steps(guard, 1) == [32]


def test_each_plan_starts_from_its_own_last_size():
    """Training shrank to 32; the first inference starts whole (not at 32)
    and settles at 16; the next one starts at 16, and training stays at
    32. (No growth: ``grow_after`` is past the test's boundaries.)"""
    t, guard = Trainer(), Guard(budget=None, allocator=False, grow_after=64)
    assert t.steps(guard, 1, fail_above=32) == [32]
    x, sizes = torch.randn(N, 4), []
    guard.infer(x, above(16, sizes))
    assert sizes == [64, 32, 16, 16, 16, 16]
    sizes.clear()
    guard.infer(x, above(16, sizes))
    assert sizes == [16] * 4
    assert guard.summary()["infer_micro_batch"] == 16 and guard.micro_batch == 32
    assert t.steps(guard, 1) == [32]


def test_infer_shrinks_for_a_room_that_fell_before_running_out(arena, tmp_path):
    """The first inference ran whole, and its peak was learnt; the room
    then falls below it (the tensor budget lowered between two calls): the
    next call starts at a size the model says fits, with no out-of-memory
    error, and says so in an ``infer_plan`` event."""
    x, sizes, path = torch.randn(N, 4), [], tmp_path / "run.jsonl"
    room = memguard.stats()["reserved_bytes.current"] + 256 * MiB
    with Guard(budget=None, tensor_budget=room, telemetry=path) as guard:
        if guard.allocator_error is not None:
            pytest.skip(guard.allocator_error)
        guard.infer(x, hog(sizes))
        assert sizes == [N]
        # the free part of slabs other tests' tensors keep counts against
        # the budget, not in the peaks: the room is 24 MiB above both
        st = memguard.stats()
        guard.room.tensor_budget = st["reserved_bytes.current"] - st["cached_bytes"] + 24 * MiB
        sizes.clear()
        refused = allocator.stats()["num_ooms"]
        out = guard.infer(x, hog(sizes))
        torch.testing.assert_close(out, MiB // 4 + x[:, 0])
        assert guard.ooms_recovered == 0 and allocator.stats()["num_ooms"] == refused
        assert sum(sizes) == N and max(sizes) < 24
        assert allocator.stats()["budget_bytes"] == guard.room.tensor_budget   # 64 MiB did not fit
    _, _, events = read_jsonl(path)
    infer = [e for e in events if e["event"] == "infer_plan"]
    # (HIGH, where the host itself runs short, shrinks to the same fit)
    assert [(e["action"], e["from_micro_batch"], e["sample"]) for e in infer] == \
        [("shrink", N, 0)] and infer[0]["reason"] in ("room", "high", "critical")
    assert not any(e["event"] == "step" for e in events)


def test_an_inference_that_cannot_fit_gets_inference_advice():
    """Giving up, an inference's error says what helps an inference (no
    activations to checkpoint: it holds no graph), and the training
    planner saw none of it."""
    guard, sizes = Guard(budget=None, allocator=False, min_micro_batch=2), []
    with pytest.raises(GuardOOMError) as info:
        guard.infer(torch.zeros(8, 4), above(0, sizes))
    err, msg = info.value, str(info.value)
    assert "checkpoint" not in msg
    assert err.inference and err.tried == sizes == [8, 4, 2]
    assert "for this inference (8, 4, 2; min_micro_batch=2): lower min_micro_batch or raise " \
           "the budget (an inference runs one micro-batch at a time" in msg
    assert guard.plan()["ooms"] == 0
    assert "checkpoint activations" in str(GuardOOMError([8], 1))     # a step's advice


def test_a_smallest_size_refused_by_memguards_budget_goes_on_past_it(arena):
    """One sample needs more than memguard's tensor budget (the machine
    has it): the inference goes on past the budget at the smallest size,
    reported as an overrun when the loop ends, where giving up would end
    a run the plain loop finishes. A refusal that is not the budget's still
    gives up (test above)."""
    room = memguard.stats()["reserved_bytes.current"] + MiB // 2      # less than one sample
    with Guard(budget=None, tensor_budget=room, min_micro_batch=1) as guard:
        if guard.allocator_error is not None:
            pytest.skip(guard.allocator_error)
        x, sizes = torch.randn(4, 4), []
        with pytest.warns(memguard.BudgetOverrunWarning, match="passed the tensor budget"), \
                guard.evaluate():
            out = guard.infer(x, hog(sizes))
        torch.testing.assert_close(out, MiB // 4 + x[:, 0])
        # down to 1 (from 4, or at once where the room read small), refused
        # there once, then the 4 samples served past the budget
        assert sizes[sizes.index(1):] == [1] * 5 and guard.inference.micro == 1
        assert allocator.stats()["num_overruns"] > 0


def test_an_inference_caches_no_more_than_its_working_set_bound(arena):
    """A forward frees blocks of many sizes, each of its own class: kept
    cached, the process would hold their sum. While an inference runs the
    cache is held to a quarter of its metered peak plus 64 MiB (64 MiB
    before one), and the limit there was before comes back after it."""
    def layers(mb: torch.Tensor) -> torch.Tensor:
        for i in range(1, 9):            # 8, 16, ... 64 MiB, each freed before the next
            t = torch.ones(i * 2 * MiB)
            del t
        return mb.sum(1)

    with Guard(budget=None, tensor_budget="4GiB") as guard:
        if guard.allocator_error is not None:
            pytest.skip(guard.allocator_error)
        for _ in range(2):               # the first before any peak, the second after
            allocator.trim()
            allocator.reset_peaks()
            guard.infer(torch.zeros(4, 4), layers)
            st = allocator.stats()
            held = st["reserved_bytes.peak"] - st["allocated_bytes.peak"]
            assert held <= 0.25 * guard.inference.arena_peak + 64 * MiB + 8 * MiB, held
            assert st["cached_bytes"] <= held
        assert guard.inference.arena_peak >= 64 * MiB
        assert st["cache_limit_bytes"] == 0      # none after it, as before
