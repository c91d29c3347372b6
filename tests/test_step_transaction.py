"""A guarded step is all or nothing, with real torch: faults injected into
the optimizer step (out-of-memory errors at any operation of the update,
the first step's state creation included), into ``post_step``, and into
every micro-batch (``KeyboardInterrupt`` and another exception), and a
non-finite loss. Each step ends committed or rolled back, and a user who
goes on (redoing a rolled-back batch, moving past a committed one) ends
with the parameters and optimizer state of an uninterrupted run (1e-5
relative). And the hooks upstream loops need: ``before_optimizer_step``
(per-parameter clipping, a frozen layer, under a scaler too) and
``pre_step`` (a momentum update once a step)."""
from __future__ import annotations

import contextlib
import copy

import pytest

torch = pytest.importorskip("torch")
from torch.utils._python_dispatch import TorchDispatchMode

from memguard import Guard
from memguard._common import size
from memguard.memory import arena as allocator
from memguard.train.transaction import (
    NonFiniteLossError,
    OptimizerOOMError,
    PostStepError,
)

F = torch.nn.functional
OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes"
BATCH, STEPS = 16, 4


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


WIDE = 16    # hidden width; the optimizer tests widen it to make the update's bytes count


def make(kind: str, wide: int = WIDE, norm: bool = True):
    """A small MLP (with BatchNorm, whose buffers a rolled-back step must
    restore; without, where a split must equal the unsplit step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, wide),
                                torch.nn.BatchNorm1d(wide) if norm else torch.nn.Identity(),
                                torch.nn.ReLU(), torch.nn.Linear(wide, 3))
    if kind.startswith("adamw"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=kind.endswith("foreach"))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                              foreach=kind.endswith("foreach"))
    return model, opt


def batches(n: int = STEPS) -> list:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(n)]


def loss_of(model):
    return lambda b: F.cross_entropy(model(b[0]), b[1])


def reference(kind: str, micro: int, wide: int = WIDE) -> tuple:
    """The uninterrupted run: every batch stepped once at ``micro``."""
    model, opt = make(kind, wide)
    g = Guard(budget=None, micro_batch=micro, allocator=False)
    for b in batches():
        g.step(b, loss_of(model), opt, restore=[model])
    return model, opt


def state_of(model, opt) -> tuple:
    """Copies of what a step may change: parameters, buffers, optimizer state."""
    return (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))


def assert_same(a: tuple, b: tuple, rtol: float = 1e-5) -> None:
    (ma, oa), (mb, ob) = a, b
    assert ma.keys() == mb.keys()
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k], rtol=rtol, atol=1e-7, msg=k)
    sa, sb = oa["state"], ob["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys(), i
        for k in sa[i]:
            torch.testing.assert_close(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k]),
                                       rtol=rtol, atol=1e-7, msg=f"{i}.{k}")


class FailAt(TorchDispatchMode):
    """Raise an out-of-memory error at the n-th tensor operation (1-based)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.count = n, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        if self.count == self.n:
            raise RuntimeError(OOM)
        return func(*args, **(kwargs or {}))


def ops_of_a_step(kind: str, first: bool, wide: int = WIDE) -> int:
    """How many tensor operations one optimizer step runs (the first, which
    creates the state, or a later one)."""
    model, opt = make(kind, wide)
    b = batches(1)[0]
    if not first:
        F.cross_entropy(model(b[0]), b[1]).backward()
        opt.step()
        opt.zero_grad()
    F.cross_entropy(model(b[0]), b[1]).backward()
    counter = FailAt(10**9)
    with counter:
        opt.step()
    return counter.count


def fail_step(opt, at: int, times: int) -> list:
    """Make the next ``times`` calls of ``opt.step`` run out of memory at
    their operation ``at``; returns the list the failures are logged in."""
    real = opt.step
    failures: list = []

    def step(*a, **kw):
        if len(failures) < times:
            failures.append(at)
            with FailAt(at):
                return real(*a, **kw)
        return real(*a, **kw)

    opt.step = step
    return failures


KINDS = ["adamw-foreach", "adamw-single", "sgd-foreach", "sgd-single"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", ["first", "later"])
@pytest.mark.parametrize("times", [1, 2])
def test_oom_in_the_optimizer_step(arena, kind, which, times):
    """Under a budget that leaves the update less than three times what it
    touches, an out-of-memory error at an operation in the middle of the
    update (after some of it was applied): once, the step is rolled back,
    memory relieved, and the step tried again; twice, OptimizerOOMError
    names the size and the step is rolled back whole; the user redoes the
    batch. The run ends as the uninterrupted one."""
    wide = 512                         # 0.5 MB of parameters, a MB of AdamW state
    want = state_of(*reference(kind, 8, wide))
    ops = ops_of_a_step(kind, first=which == "first", wide=wide)
    at = max(2, ops // 2)
    model, opt = make(kind, wide)
    g = Guard(budget=None, micro_batch=8, allocator=False)
    fault_step = 0 if which == "first" else 2
    i = 0
    errors = []
    data = batches()
    while i < len(data):
        if i == fault_step and not errors:
            before = state_of(model, opt)
            fail_step(opt, at, times)
            needed, _ = footprint_with_grads(model, opt)
            st = allocator.stats()
            allocator.set_budget(st["reserved_bytes.current"] - st["cached_bytes"] + 2 * needed)
        try:
            g.step(data[i], loss_of(model), opt, restore=[model])
        except OptimizerOOMError as exc:
            errors.append(exc)
            assert exc.needed_bytes > 0 and size(exc.needed_bytes) in str(exc)
            assert_same(state_of(model, opt), before, rtol=0)   # exactly as before
            assert all(p.grad is None for p in model.parameters())
            continue                                           # the user redoes the batch
        allocator.set_budget(None)
        i += 1
    assert len(errors) == (times - 1)
    assert_same(state_of(model, opt), want)


def footprint_with_grads(model, opt) -> tuple[int, int]:
    """What the next optimizer step touches: every parameter given a
    gradient for the count (and none again after)."""
    from memguard.train.transaction import footprint
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    out = footprint(opt)
    opt.zero_grad(set_to_none=True)
    return out


def test_adam_first_step_state_is_never_half_made():
    """Without a budget to pass, an out-of-memory error while Adam creates
    its state (before it updates anything) leaves no parameter with half a
    state: the next steps do not fail with KeyError, and the run ends as the
    uninterrupted one."""
    kind = "adamw-single"
    want = state_of(*reference(kind, 16))
    model, opt = make(kind)
    g = Guard(budget=None, micro_batch=16, allocator=False)
    data = batches()
    fail_step(opt, 3, 2)               # the third operation: inside state creation
    with pytest.raises(OptimizerOOMError):
        g.step(data[0], loss_of(model), opt, restore=[model])
    assert not opt.state
    for b in data:
        g.step(b, loss_of(model), opt, restore=[model])
    assert_same(state_of(model, opt), want)


@pytest.mark.parametrize("error", [KeyboardInterrupt, ValueError])
@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_an_interrupted_step_is_rolled_back(error, index):
    """KeyboardInterrupt or another exception in micro-batch ``index`` of 4:
    no gradient, no BatchNorm update, no optimizer state and no RNG draw of
    the step survives; redone, the run ends as the uninterrupted one."""
    want = state_of(*reference("adamw-foreach", 4))
    model, opt = make("adamw-foreach")
    g = Guard(budget=None, micro_batch=4, allocator=False)
    data = batches()
    g.step(data[0], loss_of(model), opt, restore=[model])
    before, rng = state_of(model, opt), torch.get_rng_state()
    calls = []

    def loss_fn(b):
        calls.append(1)
        if len(calls) == index + 1:
            raise error("stop")
        return loss_of(model)(b)

    with pytest.raises(error):
        g.step(data[1], loss_fn, opt, restore=[model])
    assert_same(state_of(model, opt), before, rtol=0)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    for b in data[1:]:
        g.step(b, loss_of(model), opt, restore=[model])
    assert_same(state_of(model, opt), want)


def test_an_oom_in_post_step_comes_after_the_commit(tmp_path):
    """post_step runs after the optimizer step: its error says the step is
    done; the step is counted and its event written; the user goes on with
    the next batch."""
    from memguard.telemetry import read_jsonl
    want = state_of(*reference("sgd-foreach", 8))
    model, opt = make("sgd-foreach")
    path = tmp_path / "run.jsonl"
    data = batches()
    with Guard(budget=None, micro_batch=8, allocator=False, telemetry=path) as g:
        for i, b in enumerate(data):
            def post(aux, i=i):
                if i == 1:
                    raise RuntimeError(OOM)
            if i == 1:
                with pytest.raises(PostStepError, match="step 1 was taken.*do not redo it"):
                    g.step(b, loss_of(model), opt, restore=[model], post_step=post)
                assert g.steps == 2
            else:
                g.step(b, loss_of(model), opt, restore=[model], post_step=post)
    _, _, events = read_jsonl(path)
    assert [e["step"] for e in events if e["event"] == "step"] == [0, 1, 2, 3]
    assert [e["step"] for e in events if e["event"] == "post_step_failed"] == [1]
    assert_same(state_of(model, opt), want)


def test_a_non_finite_loss_stops_the_step_before_the_update():
    model, opt = make("adamw-foreach")
    g = Guard(budget=None, micro_batch=8, allocator=False)
    data = batches()
    g.step(data[0], loss_of(model), opt, restore=[model])
    before = state_of(model, opt)
    with pytest.raises(NonFiniteLossError, match="loss is nan: the optimizer step was not "
                                                 "taken"):
        g.step(data[1], lambda b: loss_of(model)(b) * float("nan"), opt, restore=[model])
    assert_same(state_of(model, opt), before, rtol=0)
    assert all(p.grad is None for p in model.parameters())


# -- the hooks -------------------------------------------------------------------
def _dino_like(model, opt, frozen, clip, scaler=None):
    """DINO's between-backward-and-step: each parameter's gradient clipped
    to ``clip``, the last layer's dropped (frozen in the first epoch)."""
    def hook(optimizer):
        assert optimizer is opt
        for p in model.parameters():
            if p.grad is not None:
                norm = p.grad.norm()
                if norm > clip:
                    p.grad.mul_(clip / (norm + 1e-6))
        for p in frozen.parameters():
            p.grad = None
    return hook


@pytest.mark.parametrize(("micro", "amp", "bf16"), [
    (16, False, False), (4, False, False), (16, True, False), (4, True, False),
    (16, False, True), (16, True, True)])
def test_before_optimizer_step_clips_each_parameter_and_freezes_a_layer(micro, amp, bf16):
    """The DINO pattern through before_optimizer_step, split or not, in fp32,
    with a GradScaler (the hook sees unscaled gradients), and under bf16
    autocast (whole batches: bf16 rounds a split differently): equal to the
    plain unsplit loop doing the same by hand."""
    data = batches()
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else \
        contextlib.nullcontext

    def plain():
        model, opt = make("adamw-foreach", norm=False)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if amp else None
        hook = _dino_like(model, opt, model[3], clip=0.05)
        for x, y in data:
            with autocast():
                loss = F.cross_entropy(model(x), y)
            if scaler is None:
                loss.backward()
                hook(opt)
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                hook(opt)
                scaler.step(opt)
                scaler.update()
            opt.zero_grad(set_to_none=True)
        return model, opt

    def guarded():
        model, opt = make("adamw-foreach", norm=False)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if amp else None
        g = Guard(budget=None, micro_batch=micro, allocator=False)
        last = [p.detach().clone() for p in model[3].parameters()]

        def loss_fn(b):
            with autocast():
                return loss_of(model)(b)

        for b in data:
            g.step(b, loss_fn, opt, scaler=scaler, restore=[model],
                   before_optimizer_step=_dino_like(model, opt, model[3], clip=0.05))
        assert all(torch.equal(p, q) for p, q in zip(model[3].parameters(), last))   # frozen
        return model, opt

    assert_same(state_of(*guarded()), state_of(*plain()))


def test_pre_step_runs_once_a_step_before_the_first_micro_batch():
    """MoCo's momentum update of the key encoder: once a step, before the
    first forward (the keys of every micro-batch come from the moved
    encoder), not again when an out-of-memory error redoes the step; equal
    to the unsplit loop."""
    data = batches()

    def build():
        torch.manual_seed(0)
        q = torch.nn.Linear(6, 3)
        k = copy.deepcopy(q).requires_grad_(False)
        return q, k, torch.optim.SGD(q.parameters(), lr=0.1)

    def momentum(q, k):
        with torch.no_grad():
            for pk, pq in zip(k.parameters(), q.parameters()):
                pk.mul_(0.9).add_(pq, alpha=0.1)

    def loss(q, k, b):
        x, y = b
        return F.cross_entropy(q(x) + k(x), y)

    q0, k0, o0 = build()
    for b in data:
        momentum(q0, k0)
        loss(q0, k0, b).backward()
        o0.step()
        o0.zero_grad()

    q1, k1, o1 = build()
    g = Guard(budget=None, micro_batch=4, allocator=False)
    moves, calls = [], []

    def loss_fn(b):
        calls.append(1)
        if len(calls) == 6:            # step 1's second micro-batch: redone at 2
            raise RuntimeError(OOM)
        return loss(q1, k1, b)

    for b in data:
        g.step(b, loss_fn, o1, restore=[k1], pre_step=lambda: (moves.append(1),
                                                                momentum(q1, k1)))
    assert len(moves) == len(data) and g.ooms_recovered == 1
    for a, b in ((q0, q1), (k0, k1)):
        for pa, pb in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fail_first", [False, True])
def test_the_first_batch_does_not_cap_later_ones(fail_first):
    """A first batch of 1, then batches of 16: the steps run whole at 16 at
    once, also when that first batch ran out of memory (given up: nothing
    smaller than 1)."""
    from memguard import GuardOOMError
    model, opt = make("sgd-foreach", norm=False)
    g = Guard(budget=None, allocator=False)
    one = (torch.randn(1, 6), torch.randint(0, 3, (1,)))
    calls = []

    def loss_fn(b):
        calls.append(len(b[0]))
        if fail_first and len(calls) == 1:
            raise RuntimeError(OOM)
        return loss_of(model)(b)

    if fail_first:
        with pytest.raises(GuardOOMError):
            g.step(one, loss_fn, opt)
    else:
        g.step(one, loss_fn, opt)
    sizes = [g.step(b, loss_fn, opt).micro_batch for b in batches(3)]
    assert sizes == [BATCH] * 3


def test_a_buffer_changed_in_forward_is_warned_about_once():
    """A center updated inside the forward pass (DINO's DINOLoss) changes
    once per micro-batch when the step is split: one warning names it and
    points at post_step; BatchNorm's statistics (a documented difference)
    and an unsplit step say nothing."""
    class Centered(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8))
            self.register_buffer("center", torch.zeros(8))

        def forward(self, x):
            out = self.net(x)
            with torch.no_grad():
                self.center.mul_(0.9).add_(out.mean(0), alpha=0.1)
            return out - self.center

    torch.manual_seed(0)
    m = Centered()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(16, 6)

    def loss_fn(b):
        return m(b).pow(2).mean()

    import warnings as w
    with w.catch_warnings(record=True) as got:
        w.simplefilter("always")
        Guard(budget=None, micro_batch=16, allocator=False).step(x, loss_fn, opt, restore=[m])
        g = Guard(budget=None, micro_batch=4, allocator=False)
        for _ in range(3):
            g.step(x, loss_fn, opt, restore=[m])
    msgs = [str(r.message) for r in got if "memguard: buffer" in str(r.message)]
    assert len(msgs) == 1, msgs
    assert "Centered.center" in msgs[0] and "post_step" in msgs[0]
    assert "running_mean" not in msgs[0]


def test_what_pre_step_changed_is_rolled_back_with_a_failed_step():
    """A momentum update in pre_step, the key encoder's parameters listed in
    restore=: a step that fails (here, an error in its last micro-batch)
    leaves the encoder as it was; the redone step moves it once."""
    torch.manual_seed(0)
    q = torch.nn.Linear(6, 3)
    k = copy.deepcopy(q).requires_grad_(False)
    with torch.no_grad():
        k.weight.add_(1.0)               # unlike q, so a momentum update moves it
    opt = torch.optim.SGD(q.parameters(), lr=0.1)
    g = Guard(budget=None, micro_batch=4, allocator=False)
    before = [p.clone() for p in k.parameters()]

    def momentum():
        with torch.no_grad():
            for pk, pq in zip(k.parameters(), q.parameters()):
                pk.mul_(0.9).add_(pq, alpha=0.1)

    calls = []

    def loss_fn(b):
        calls.append(1)
        if len(calls) == 4:
            raise ValueError("the last micro-batch fails")
        return F.cross_entropy(q(b[0]) + k(b[0]), b[1])

    b = batches(1)[0]
    with pytest.raises(ValueError):
        g.step(b, loss_fn, opt, restore=[*k.parameters()], pre_step=momentum)
    assert all(torch.equal(p, s) for p, s in zip(k.parameters(), before))
    q_before = [p.detach().clone() for p in q.parameters()]   # pre_step sees these
    g.step(b, loss_fn, opt, restore=[*k.parameters()], pre_step=momentum)
    for pk, s, sq in zip(k.parameters(), before, q_before):
        torch.testing.assert_close(pk, 0.9 * s + 0.1 * sq)     # moved once, not twice
