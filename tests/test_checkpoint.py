"""Switchable activation checkpointing: the same gradients whatever is
checkpointed, less peak memory the more is, state_dict untouched."""
from __future__ import annotations

import copy

import pytest
import torch

import memguard
from memguard.train import checkpoint

DIM, DEPTH = 64, 6


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.attn = torch.nn.MultiheadAttention(DIM, 4, dropout=0.1, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm(x))


class Vit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = torch.nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(1))


def grads(model: torch.nn.Module, x: torch.Tensor, seed: int = 5) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)           # the same dropout masks in every run
    model(x).pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def vit():
    torch.manual_seed(0)
    return Vit().train()


@pytest.mark.parametrize("n_on", [1, 3, DEPTH])
def test_gradients_equal_with_blocks_checkpointed_and_dropout_on(vit, n_on):
    x = torch.randn(4, 16, DIM)
    plain = grads(vit, x)
    ckpt = checkpoint.wrap(vit.blocks)
    assert ckpt.set(n_on) == n_on == ckpt.n_on
    got = grads(vit, x)
    for a, b in zip(got, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # a different dropout seed gives different gradients: masks really matter here
    other = grads(vit, x, seed=6)
    assert any(not torch.allclose(a, b) for a, b in zip(other, plain))


def test_state_dict_and_module_tree_are_untouched(vit):
    before = {k: v.clone() for k, v in vit.state_dict().items()}
    names = [n for n, _ in vit.named_modules()]
    ckpt = checkpoint.wrap(vit.blocks)
    ckpt.set(DEPTH)
    assert [n for n, _ in vit.named_modules()] == names
    assert list(vit.state_dict()) == list(before)
    clone = copy.deepcopy(vit)            # a wrapped model still deep-copies
    clone.load_state_dict(before)
    ckpt.unwrap()
    assert "forward" not in vit.blocks[0].__dict__
    checkpoint.wrap(vit.blocks)           # and can be wrapped again after unwrap


def test_bad_inputs(vit):
    with pytest.raises(TypeError, match="int"):
        checkpoint.wrap([vit.blocks[0], 3])
    with pytest.raises(ValueError, match="no blocks"):
        checkpoint.wrap([])
    ckpt = checkpoint.wrap(vit.blocks)
    with pytest.raises(ValueError, match="already wrapped"):
        checkpoint.wrap(vit.blocks[0])
    with pytest.raises(TypeError, match="'two'"):
        ckpt.set("two")
    assert ckpt.set(99) == DEPTH and ckpt.fewer(2) == DEPTH - 2 and ckpt.more() == DEPTH - 1
    assert ckpt.set(-3) == 0


def test_no_grad_runs_blocks_plainly(vit):
    ckpt = checkpoint.wrap(vit.blocks)
    ckpt.set(DEPTH)
    vit.eval()
    x = torch.randn(2, 8, DIM)
    with torch.no_grad():
        out = vit(x)
    ckpt.set(0)
    with torch.no_grad():
        torch.testing.assert_close(vit(x), out, rtol=0, atol=0)


def _step_peak(model: torch.nn.Module, x: torch.Tensor) -> int:
    memguard.memory.arena.reset_peaks()
    base = memguard.stats()["allocated_bytes.current"]
    model(x).pow(2).mean().backward()
    peak = memguard.stats()["allocated_bytes.peak"] - base
    model.zero_grad(set_to_none=True)
    return peak


def test_peak_memory_falls_as_more_blocks_are_checkpointed(vit):
    try:
        memguard.install()
    except RuntimeError as exc:
        pytest.skip(f"memguard's allocator cannot be installed here: {exc}")
    try:
        x = torch.randn(16, 64, DIM)
        ckpt = checkpoint.wrap(vit.blocks)
        _step_peak(vit, x)                      # warm up: grads and caches exist
        peaks = {}
        for n in (0, 2, 4, DEPTH):
            ckpt.set(n)
            peaks[n] = _step_peak(vit, x)
        print("peak bytes by checkpointed blocks:", peaks)
        assert peaks[0] > peaks[2] > peaks[4] > peaks[DEPTH]
        assert peaks[DEPTH] < 0.5 * peaks[0]
    finally:
        memguard.uninstall()


def _levels_then_steps(guard, vit, opt, levels):
    """One step per level, each after a sample at that level (what the
    sampler's on_sample callback hands the guard)."""
    import types

    x = torch.randn(8, 4, DIM)
    out = []
    for lv in levels:
        guard.signals._on_sample(types.SimpleNamespace(level=lv, raw_level=lv))
        res = guard.step(x, lambda b: vit(b).pow(2).mean(), opt)
        out.append((res.micro_batch, guard.checkpoints.n_on))
    return out


def test_escalation_ladder_and_de_escalation(vit):
    """Shrink to the minimum first, then checkpoint more blocks while HIGH
    stays; on_critical once when nothing is left; when calm, switch the
    checkpoints off before the micro-batch grows again."""
    from memguard.telemetry import Level

    calls = []
    opt = torch.optim.SGD(vit.parameters(), lr=1e-3)
    guard = memguard.Guard(budget=None, allocator=False, min_micro_batch=2, grow_after=2,
                           checkpoint=vit.blocks, on_critical=calls.append)
    ok, high, crit = Level.OK, Level.HIGH, Level.CRITICAL
    levels = [ok, high, high, high, high, crit, crit, crit, crit, crit, ok, crit, ok,
              ok, ok, ok, ok, ok, ok, ok, ok, ok, ok, ok, ok, ok]
    got = _levels_then_steps(guard, vit, opt, levels)
    want = [
        (8, 0),                       # start
        (4, 0), (2, 0),               # HIGH: shrink to the minimum first
        (2, 1), (2, 2),               # still HIGH at the minimum: checkpoint more
        (2, 3), (2, 4), (2, 5), (2, 6),   # CRITICAL: the rest, one block (6 // 4) a step
        (2, 6),                       # nothing left: on_critical
        (2, 6), (2, 6),               # OK, then CRITICAL again: a new episode
        (2, 6), (2, 5), (2, 5), (2, 4), (2, 4), (2, 3), (2, 3), (2, 2), (2, 2), (2, 1),
        (2, 1), (2, 0),               # calm: checkpoints off first, one every 2 calm steps
        (2, 0), (4, 0),               # then the planner's own 2 calm steps and a grow
    ]
    assert got == want
    assert calls == [guard, guard]    # once per CRITICAL episode, the run alive
    assert guard.summary()["checkpointed_blocks"] == 0


def test_ladder_on_a_replayed_swap_storm(vit):
    """A recorded laptop swap storm (tests/fixtures/traces/swap_storm.jsonl),
    replayed sample by sample through the sampler's own pressure model into
    a guard, one step per sample: the micro-batch shrinks to its minimum
    before any block is checkpointed; blocks are checkpointed only at HIGH
    or above; on_critical runs once, when nothing is left; once calm, every
    checkpoint is switched off before the micro-batch grows back."""
    import types

    from memguard import _C
    from memguard.telemetry import Level, Sample, read_jsonl
    from tests.conftest import FIXTURES

    _, samples, _ = read_jsonl(FIXTURES / "traces" / "swap_storm.jsonl")
    model = _C.PressureModel(pressure=None)
    replayed = []
    for s in samples:
        d = s.to_dict()
        d.pop("level"), d.pop("raw_level")
        replayed.append(Sample.from_dict(model.update(d)))
    assert max(s.level for s in replayed) == Level.CRITICAL   # the trace is a storm

    calls = []
    opt = torch.optim.SGD(vit.parameters(), lr=1e-3)
    guard = memguard.Guard(budget=None, allocator=False, min_micro_batch=2, grow_after=2,
                           checkpoint=vit.blocks, on_critical=calls.append)
    x = torch.randn(8, 4, DIM)
    got = []
    for s in replayed:
        guard.signals._on_sample(types.SimpleNamespace(level=s.level, raw_level=s.raw_level))
        res = guard.step(x, lambda b: vit(b).pow(2).mean(), opt)
        got.append((int(s.raw_level), res.micro_batch, guard.checkpoints.n_on))

    micro = [m for _, m, _ in got]
    n_on = [c for _, _, c in got]
    first_ckpt = n_on.index(1)
    assert micro[first_ckpt - 1] == 2 and set(micro[first_ckpt:n_on.index(DEPTH)]) == {2}
    for i in range(1, len(got)):
        if n_on[i] > n_on[i - 1]:
            assert got[i][0] >= Level.HIGH, got[i]    # escalation only under pressure
    assert max(n_on) == DEPTH
    assert calls == [guard]                           # one CRITICAL episode, the run alive
    first_grow = next(i for i in range(first_ckpt, len(got)) if micro[i] > micro[i - 1])
    assert n_on[first_grow - 1] == 0 and all(c == 0 for c in n_on[first_grow:])
    assert micro[-1] == 8 and n_on[-1] == 0           # back to full speed
