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
import gc

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


# tiny tensors: intra-op thread handoffs would cost more than the ops
pytestmark = pytest.mark.usefixtures("one_thread")


WIDE = 16    # hidden width; the optimizer tests widen it to make the update's bytes count


class Bank(torch.nn.Module):
    """Adds the mean of ``n`` parameters, in two tensors, to its input:
    parameters (and so an optimizer's temporaries) far larger than the
    step's activations, and than the backward's temporaries (one
    gradient's at a time)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(n // 2) * 0.01)
        self.b = torch.nn.Parameter(torch.randn(n // 2) * 0.01)

    def forward(self, x):
        return x + self.a.mean() + self.b.mean()


def make(kind: str, wide: int = WIDE, norm: bool = True, bank: int = 0):
    """A small MLP (with BatchNorm, whose buffers a rolled-back step must
    restore; without, where a split must equal the unsplit step), and a
    :class:`Bank` of ``bank`` parameters where given."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, wide),
                                torch.nn.BatchNorm1d(wide) if norm else torch.nn.Identity(),
                                torch.nn.ReLU(), torch.nn.Linear(wide, 3),
                                Bank(bank) if bank else torch.nn.Identity())
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


def reference(kind: str, micro: int, wide: int = WIDE, bank: int = 0) -> tuple:
    """The uninterrupted run: every batch stepped once at ``micro``."""
    model, opt = make(kind, wide, bank=bank)
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


def count_steps(opt, calls: list) -> None:
    """Log each call of ``opt.step`` in ``calls``."""
    real = opt.step

    def step(*a, **kw):
        calls.append(1)
        return real(*a, **kw)
    opt.step = step


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


def run_with_fault(kind: str, fault_step: int, room_of, fault=None, wide: int = 512,
                   bank: int = 0, most: bool = False):
    """The reference run of ``kind`` whose step ``fault_step`` has its
    update under a budget that leaves it ``room_of(needed, backup)`` bytes
    (``None``: no budget; ``most``: counting the arena's free slab blocks,
    which only allocations of their size class reuse, else not), set once
    the gradients are there, and
    ``fault(opt)`` armed (see :func:`fail_step`); redone as a user would (a
    rolled-back step again, the budget lifted) until it commits. Returns
    (errors raised at that step, the state before it, the model, the
    optimizer); an error that was not rolled back ends the run there."""
    model, opt = make(kind, wide, bank=bank)
    g = Guard(budget=None, micro_batch=8, allocator=False)
    errors, before, data, i = [], None, batches(), 0

    def tighten(optimizer):
        needed, backup = need_and_backup(g, opt)
        room = room_of(needed, backup)
        if room is not None:
            gc.collect()                         # no garbage for a relief to find
            st = allocator.stats()
            held = st["allocated_bytes.current"] if most else \
                st["reserved_bytes.current"] - st["cached_bytes"]
            allocator.set_budget(held + room)

    while i < len(data):
        hook = None
        if i == fault_step and not errors:
            before, hook = state_of(model, opt), tighten
            if fault is not None:
                fault(opt)
        try:
            g.step(data[i], loss_of(model), opt, restore=[model], before_optimizer_step=hook)
        except OptimizerOOMError as exc:
            errors.append(exc)
            allocator.set_budget(None)
            if not exc.rolled_back:
                return errors, before, model, opt
            assert_same(state_of(model, opt), before, rtol=0)   # exactly as before
            assert all(p.grad is None for p in model.parameters())
            continue                                           # the user redoes the batch
        allocator.set_budget(None)
        i += 1
    return errors, before, model, opt


def need_and_backup(g, opt) -> tuple[int, int]:
    """What the next optimizer step allocates as the guard reckons it, and
    the bytes of its backup (parameters and the state they have)."""
    from memguard.train.transaction import footprint
    params = [p for grp in opt.param_groups for p in grp["params"] if p.grad is not None]
    needed, _, _ = g.update_need.of(opt, params)
    written, _ = footprint(opt)
    fresh = sum(2 * p.nbytes for p in params if not opt.state.get(p))
    return needed, written - fresh


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("times", [1, 2])
def test_an_oom_part_way_through_a_backed_up_update_is_rolled_back(arena, kind, times):
    """The first step (state created) with room for the update and its
    backup but short of twice the update: a backup is taken, and an
    out-of-memory error in the middle of the update (after some of it was
    written) puts it back. Once: relieved and tried again; twice:
    OptimizerOOMError, rolled back whole, and the user redoes the batch.
    The run ends as the uninterrupted one."""
    # every tensor a large block: freed, it is cached, and the room counts
    # it (a block of a slab, 256 KiB and less, is neither)
    wide = 65536
    want = state_of(*reference(kind, 8, wide))
    at = max(2, ops_of_a_step(kind, first=True, wide=wide) // 2)
    errors, _, model, opt = run_with_fault(
        kind, 0, lambda needed, backup: (backup + 3 * needed) // 2,   # mid-band
        lambda opt: fail_step(opt, at, times), wide=wide)
    assert [e.rolled_back for e in errors] == [True] * (times - 1), [str(e) for e in errors]
    assert_same(state_of(model, opt), want)


@pytest.mark.parametrize("kind", ["adamw-foreach", "adamw-single"])
def test_an_update_that_cannot_fit_is_never_begun(arena, kind):
    """A later step whose update (measured at the steps before) is larger
    than the room the budget leaves, relieved or not: it is refused before
    it begins, with everything as before, by a real refusal of the budget,
    and the message says what it needs, what was held and the budget.
    The user raises the budget and the run ends as the uninterrupted one."""
    want = state_of(*reference(kind, 8, bank=1 << 22))
    errors, _, model, opt = run_with_fault(kind, 2, lambda needed, backup: needed // 2,
                                           wide=WIDE, bank=1 << 22, most=True)
    assert len(errors) == 1 and errors[0].rolled_back and errors[0].__cause__ is None
    e = errors[0]
    assert e.budget_bytes and e.held_bytes and e.needed_bytes > e.room_bytes
    for figure in (e.needed_bytes, e.held_bytes, e.budget_bytes, e.room_bytes):
        assert size(figure) in str(e)
    assert_same(state_of(model, opt), want)


@pytest.mark.parametrize("kind", ["adamw-single", "sgd-single"])
@pytest.mark.parametrize("which", ["first", "later"])
def test_an_oom_at_any_operation_of_a_for_loop_update_without_a_backup(kind, which):
    """No budget, so no backup. An out-of-memory error at each operation of
    a for-loop update in turn: before the update wrote a parameter or a
    state tensor it had (version counters tell), the state it created is
    dropped and it is retried once, and the run ends as the uninterrupted
    one; after, it cannot be undone, and it is never called again on top of
    itself (the bug this guards against: a double update reported as a
    normal step). (The fault is injected by a TorchDispatchMode, under
    which torch's foreach in-place operations do not count versions:
    foreach updates are swept by a real budget below.)"""
    step = 0 if which == "first" else 2
    want = state_of(*reference(kind, 8))
    after = committed_after(kind, step)
    outcomes = set()
    for at in range(1, ops_of_a_step(kind, first=which == "first") + 1):
        calls: list = []

        def fault(opt, at=at, calls=calls):
            fail_step(opt, at, 1)
            count_steps(opt, calls)

        errors, before, model, opt = run_with_fault(kind, step, lambda n, b: None, fault,
                                                    wide=WIDE)
        outcomes.add(check_outcome(errors, before, after, model, opt, want, calls))
    assert outcomes == {"undone", "not undone"}


@pytest.mark.parametrize("kind", KINDS)
def test_a_first_update_under_any_room_commits_or_is_undone_or_says_it_is_not(arena, kind):
    """Adam's or SGD's first step (its state created) under a real budget
    that leaves the update a room from none to more than all it needs, in
    12 steps:
    the update commits, or is rolled back exactly, or (out of memory
    part-way, with no room for a backup) says it could not be rolled back
    and was never run twice."""
    want = state_of(*reference(kind, 8, 512))
    after = committed_after(kind, 0, 512)
    outcomes = set()
    for k in range(12):
        calls: list = []
        errors, before, model, opt = run_with_fault(
            kind, 0, lambda needed, backup, k=k: needed * k // 10,
            lambda opt, calls=calls: count_steps(opt, calls), wide=512)
        outcomes.add(check_outcome(errors, before, after, model, opt, want, calls))
    assert "undone" in outcomes


def check_outcome(errors, before, after, model, opt, want, calls: list) -> str:
    """A step that met a fault ended rolled back (and the run, redone, as
    the uninterrupted one), or not, saying so, and then its update ran once
    (``calls``): for a for-loop update, every parameter with its state at
    their values before the step (state just created, or not yet recorded,
    counts as before) or after one update, but the one whose update the
    error stopped half-way (a foreach update writes every parameter at
    each of its operations)."""
    if not errors or errors[-1].rolled_back:
        assert_same(state_of(model, opt), want)
        return "undone"
    assert "could NOT be rolled back" in str(errors[-1])
    assert len(calls) == 1                 # never run again on top of itself
    if opt.defaults["foreach"]:
        return "not undone"
    (_, ob), (_, oa) = before, after
    now = opt.state_dict()["state"]

    def same(a, b):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))

    def close(a, b):
        return torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=1e-6, atol=1e-8)

    neither = []
    for i, (p, b, a) in enumerate(zip(model.parameters(), before_params(before),
                                      before_params(after))):
        st, was, then = now.get(i, {}), ob["state"].get(i), oa["state"][i]
        at_before = same(p, b) and all(
            same(v, was[k]) if was else not torch.as_tensor(v).any() for k, v in st.items())
        at_after = close(p, a) and all(close(v, then[k]) for k, v in st.items())
        if not (at_before or at_after):
            neither.append(i)
    assert len(neither) <= 1, neither
    return "not undone"


def before_params(state: tuple) -> list:
    return [v for k, v in state[0].items() if not k.endswith(("running_mean", "running_var",
                                                              "num_batches_tracked"))]


def committed_after(kind: str, step: int, wide: int = WIDE) -> tuple:
    """The state after step ``step`` of the uninterrupted run."""
    model, opt = make(kind, wide)
    g = Guard(budget=None, micro_batch=8, allocator=False)
    for b in batches()[:step + 1]:
        g.step(b, loss_of(model), opt, restore=[model])
    return state_of(model, opt)


def test_an_optimizer_outside_torch_optim_is_not_retried_blind():
    """An optimizer of a third party may write through ``.data``, which no
    version counter sees: after an out-of-memory error in its update
    without a backup, memguard does not call it again, and says it could
    not roll the step back."""
    class DataSGD(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        def step(self, closure=None):
            self.calls = getattr(self, "calls", 0) + 1
            for g in self.param_groups:
                for i, p in enumerate(g["params"]):
                    if i == 2:
                        raise RuntimeError(OOM)
                    p.data.add_(p.grad, alpha=-g["lr"])

    model, _ = make("sgd-single")
    opt = DataSGD(model.parameters())
    g = Guard(budget=None, micro_batch=8, allocator=False)
    with pytest.raises(OptimizerOOMError, match="not one of torch.optim's") as got:
        g.step(batches(1)[0], loss_of(model), opt)
    assert not got.value.rolled_back and g.steps == 0 and opt.calls == 1


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


@pytest.mark.parametrize("budget_mib", [240, 330, 400])
def test_adamw_on_48_mib_of_linears_runs_where_the_plain_loop_does(arena, budget_mib):
    """48 MiB of Linear layers, AdamW, batch 64: a plain loop runs 3 steps
    under memguard's arena at 240, 330 and 400 MiB. Guarded with the same
    tensor budget, the 3 steps run too (no backup crowds the update out),
    and the parameters equal the plain loop's (within float rounding where
    the planner split a step)."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(3)])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    g0 = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, 2048, generator=g0), torch.randn(64, 2048, generator=g0))
            for _ in range(3)]

    def loss_of(model):
        return lambda b: F.mse_loss(model(b[0]), b[1])

    plain, opt = build()
    gc.collect()
    allocator.trim()
    allocator.set_budget(allocator.stats()["reserved_bytes.current"] + (budget_mib << 20))
    for b in data:
        opt.zero_grad(set_to_none=True)
        loss_of(plain)(b).backward()
        opt.step()
    allocator.set_budget(None)
    model, opt = build()
    gc.collect()
    allocator.trim()
    held = allocator.stats()["reserved_bytes.current"]
    with Guard(budget=None, tensor_budget=held + (budget_mib << 20)) as g:
        sizes = [g.step(b, loss_of(model), opt).micro_batch for b in data]
    assert g.steps == 3
    for p, q in zip(model.parameters(), plain.parameters()):
        if sizes == [64] * 3:
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_an_error_keeps_nothing_of_memguards_alive(arena):
    """A step that ends in an error (an OptimizerOOMError after a backup,
    a GuardOOMError after snapshots of a large buffer and aux outputs):
    while the error lives, memguard holds none of its backup, snapshot or
    aux (it held about 140 MiB in the AdamW case): what is allocated is
    what deleting the error leaves, within a MiB."""
    from memguard import GuardOOMError

    class Queue(torch.nn.Module):              # a MoCo-like queue: a 16 MiB buffer
        def __init__(self):
            super().__init__()
            self.register_buffer("queue", torch.zeros(1 << 22))

    def held_with_and_without(step) -> tuple[int, int]:
        gc.collect()
        try:
            step()
        except (OptimizerOOMError, GuardOOMError) as exc:
            err = exc
        gc.collect()
        with_error = allocator.stats()["allocated_bytes.current"]
        del err
        gc.collect()
        return with_error, allocator.stats()["allocated_bytes.current"]

    wide, kind = 65536, "adamw-single"
    model, opt = make(kind, wide)
    g = Guard(budget=None, micro_batch=8, allocator=False)
    at = max(2, ops_of_a_step(kind, first=True, wide=wide) // 2)

    def tighten(optimizer):
        needed, backup = need_and_backup(g, opt)
        st = allocator.stats()
        allocator.set_budget(st["reserved_bytes.current"] - st["cached_bytes"]
                             + (backup + 3 * needed) // 2)

    fail_step(opt, at, 2)
    a, b = held_with_and_without(lambda: g.step(batches(1)[0], loss_of(model), opt,
                                                restore=[model], before_optimizer_step=tighten))
    allocator.set_budget(None)
    assert a - b < 1 << 20, (a, b)

    queue = Queue()

    calls = []

    def loss_fn(mb):                           # 16 fails; at 8, the second one fails
        calls.append(len(mb[0]))
        if len(mb[0]) == 16 or len(calls) == 3:
            raise RuntimeError(OOM)            # (its own frame holds nothing)
        out = model(mb[0])
        return memguard_output(F.cross_entropy(out, mb[1]), out.repeat(1, 4096))

    g = Guard(budget=None, micro_batch=16, min_micro_batch=8, allocator=False)
    a, b = held_with_and_without(lambda: g.step(batches(1)[0], loss_fn, opt,
                                                restore=[model, queue]))
    assert calls == [16, 8, 8]
    assert a - b < 1 << 20, (a, b)


def memguard_output(loss, aux):
    from memguard import Output
    return Output(loss=loss, aux=aux)


# -- restore= by name, and what pre_step wrote --------------------------------------
class Counting(torch.nn.Module):
    """A forward that reassigns its buffers instead of writing into them: a
    count of samples seen (``self.seen = self.seen + n``) and a MoCo-like
    queue rebuilt with ``torch.cat``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("queue", torch.zeros(32, 3))

    def forward(self, x):
        out = self.lin(x)
        self.seen = self.seen + len(x)
        self.queue = torch.cat([out.detach(), self.queue])[:32]
        return out


def oom_on_call(n: int, loss_fn):
    """``loss_fn`` whose ``n``-th call runs out of memory (after the forward)."""
    calls = []

    def fn(b):
        calls.append(1)
        out = loss_fn(b)
        if len(calls) == n:
            raise RuntimeError(OOM)
        return out
    return fn


def test_restore_puts_back_buffers_the_forward_reassigned():
    """restore=[module] keeps buffers by name: a redone step (an OOM in its
    second micro-batch) counts its 16 samples once (it counted 32), and its
    queue holds the last micro-batches' outputs once; a failed step leaves
    the count at 0 and the queue as it was (it left 16). The module holds
    its original buffer tensors again, not orphans."""
    torch.manual_seed(0)
    m = Counting()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    b = batches(1)[0]
    seen0, queue0 = m.seen, m.queue
    g = Guard(budget=None, micro_batch=8, allocator=False)

    def loss(mb):
        return F.cross_entropy(m(mb[0]), mb[1])

    with pytest.raises(ValueError):
        g.step(b, _fails_on(2, loss), opt, restore=[m])
    assert int(m.seen) == 0 and not m.queue.any()
    assert m.seen is seen0 and m.queue is queue0
    lin = copy.deepcopy(m.lin)
    with pytest.warns(UserWarning, match="Counting.seen changed"):
        res = g.step(b, oom_on_call(2, loss), opt, restore=[m])
    assert g.ooms_recovered == 1 and int(m.seen) == 16
    with torch.no_grad():                       # the redo's micro-batches, newest first
        parts = [lin(x) for x in b[0].split(res.micro_batch)]
        assert torch.equal(m.queue, torch.cat([*reversed(parts), torch.zeros(16, 3)]))


def test_pre_step_with_its_targets_in_restore_is_kept_by_a_redo_and_undone_by_a_failure():
    """MoCo's momentum update reassigning .data, its targets listed in
    restore= (as the docs advised): a redone step keeps the update, done
    once (it was lost: 0.0 where 1.0 is right); a failed step undoes it."""
    _pre_step_case(listed=True, how="data")


@pytest.mark.parametrize("how", ["data", "inplace", "data_inplace"])
def test_pre_step_is_undone_by_a_failed_step_without_restore(how):
    """The same update, written three ways (reassigned .data; in-place on
    the parameter; in-place on .data, as MoCo v3), not listed in restore=:
    a failed step undoes it all the same, a redo keeps it once."""
    _pre_step_case(listed=False, how=how)


def _pre_step_case(listed: bool, how: str) -> None:
    torch.manual_seed(0)
    q = torch.nn.Linear(6, 3)
    k = copy.deepcopy(q).requires_grad_(False)
    with torch.no_grad():
        for p in k.parameters():
            p.zero_()
    opt = torch.optim.SGD(q.parameters(), lr=0.1)

    def momentum():
        for pk, pq in zip(k.parameters(), q.parameters()):
            if how == "data":
                pk.data = pk.data * 0.5 + pq.data * 0.5
            elif how == "inplace":
                with torch.no_grad():
                    pk.mul_(0.5).add_(pq, alpha=0.5)
            else:
                pk.data.mul_(0.5).add_(pq.data * 0.5)

    def moved_once(before_q):
        return [bk * 0.5 + bq * 0.5 for bk, bq in zip(k_before, before_q)]

    restore = [*k.parameters()] if listed else ()
    g = Guard(budget=None, micro_batch=8, allocator=False, model=q)
    b = batches(1)[0]

    def loss(mb):
        return F.cross_entropy(q(mb[0]) + k(mb[0]), mb[1])

    k_before = [p.detach().clone() for p in k.parameters()]
    with pytest.raises(ValueError):
        g.step(b, _fails_on(2, loss), opt, restore=restore, pre_step=momentum)
    for p, s in zip(k.parameters(), k_before):
        assert torch.equal(p, s)                           # undone
    q_before = [p.detach().clone() for p in q.parameters()]
    g.step(b, oom_on_call(2, loss), opt, restore=restore, pre_step=momentum)
    assert g.ooms_recovered == 1
    for p, want in zip(k.parameters(), moved_once(q_before)):
        assert torch.equal(p, want)                        # kept, once


def _fails_on(n: int, loss_fn):
    calls = []

    def fn(b):
        calls.append(1)
        if len(calls) == n:
            raise ValueError("the second micro-batch fails")
        return loss_fn(b)
    return fn


# -- the last micro-batch keeps the constraints --------------------------------------
def test_a_batchnorm_model_never_gets_a_micro_batch_of_one():
    """Batch 13 at micro-batch 4 was 4, 4, 4 and 1, and BatchNorm raises on
    one sample where the plain loop runs: now 4, 4, 3 and 2, and the step
    runs."""
    model, opt = make("sgd-foreach")
    g = Guard(budget=None, micro_batch=4, allocator=False)
    x, y = torch.randn(13, 6), torch.randint(0, 3, (13,))
    sizes = []

    def loss_fn(b):
        sizes.append(len(b[0]))
        return loss_of(model)(b)

    res = g.step((x, y), loss_fn, opt, restore=[model])
    assert sizes == [4, 4, 3, 2] and res.n_micro == 4


@pytest.mark.parametrize(("n", "multiple_of", "want"), [(8, 2, [2] * 4), (7, 2, [2, 2, 3])])
def test_pairs_stay_pairs(n, multiple_of, want):
    """A pair-wise loss (multiple_of=2) never sees a lone sample: a batch
    of 8 at 2 is pairs; a batch of 7 (odd itself) puts its odd sample in
    the last micro-batch, with a warning that says so, once."""
    model, opt = make("sgd-foreach", norm=False)
    g = Guard(budget=None, micro_batch=2, multiple_of=multiple_of, allocator=False)
    x, y = torch.randn(n, 6), torch.randint(0, 3, (n,))
    sizes = []

    def loss_fn(b):
        sizes.append(len(b[0]))
        return loss_of(model)(b)

    import warnings as w
    with w.catch_warnings(record=True) as got:
        w.simplefilter("always")
        for _ in range(2):
            g.step((x, y), loss_fn, opt)
    assert sizes == want * 2
    msgs = [str(r.message) for r in got if "remainder" in str(r.message)]
    assert len(msgs) == (n % multiple_of != 0)
    assert not msgs or "batch of 7 split at 2" in msgs[0] and "(3 samples)" in msgs[0]


def test_pre_step_that_cannot_be_recorded_runs_as_in_a_plain_loop():
    """pre_step writing a sparse tensor in place (no storage of its own to
    copy): it runs as it would without memguard, and a rolled-back step
    says that what pre_step did was kept."""
    model, opt = make("sgd-foreach", norm=False)
    sparse = torch.eye(3).to_sparse()
    g = Guard(budget=None, micro_batch=8, allocator=False)

    def pre_step():
        sparse.mul_(2)

    with pytest.warns(UserWarning, match="what pre_step did was kept"), \
            pytest.raises(ValueError):
        g.step(batches(1)[0], _fails_on(2, loss_of(model)), opt, pre_step=pre_step)
    assert torch.equal(sparse.to_dense(), 2 * torch.eye(3))
    g.step(batches(1)[0], loss_of(model), opt, pre_step=pre_step)
    assert g.steps == 1 and torch.equal(sparse.to_dense(), 4 * torch.eye(3))


def test_data_reassigned_by_two_threads_pre_steps_is_logged_apart():
    """Two guards run pre_step on two threads at once: each undo log holds
    its own thread's reassignments, and torch.Tensor.data is the C
    descriptor again once both are done."""
    import threading

    from memguard.train.snapshot import PreStepUndo

    a, b = torch.zeros(3), torch.zeros(3)
    undos = [PreStepUndo(), PreStepUndo()]
    barrier = threading.Barrier(2)

    def run(undo, t):
        def pre_step():
            barrier.wait()
            t.data = t.data + 1
            barrier.wait()
        undo.run(pre_step)

    import torch.utils._python_dispatch as dispatch
    flag = dispatch._is_in_torch_dispatch_mode   # torch's own, process-wide and racy
    threads = [threading.Thread(target=run, args=(u, t)) for u, t in zip(undos, (a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dispatch._is_in_torch_dispatch_mode = flag
    assert [[x for x, _ in u._data] for u in undos] == [[a], [b]]
    assert "data" not in torch.Tensor.__dict__
    assert undos[0].undo() and torch.equal(a, torch.zeros(3)) and torch.equal(b, torch.ones(3))
