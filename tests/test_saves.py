"""Checkpoint saves are never refused by a guard's tensor budget: outside
the step's attempts the budget is soft (memguard.train.overruns), so a save
between steps, in ``post_step`` or in a Lightning hook (``ModelCheckpoint``
in ``on_train_batch_end``) is served past a budget nearly all taken, and
reported. ``torch.save`` itself allocates no tensor memory for CPU tensors
(each storage is written in place, to a file or a ``BytesIO`` alike, a
non-contiguous view's whole storage included); what allocates is a save
that copies: a state dict cloned (EMA weights, a ``copy.deepcopy``), a
``on_save_checkpoint`` hook adding copies, CUDA storages copied to the host
by ``torch.save``. With the budget made hard, the same saves are refused:
the soft budget is what lets them through."""
from __future__ import annotations

import io
import warnings

import pytest

torch = pytest.importorskip("torch")

import memguard
from memguard import BudgetOverrunWarning
from memguard._common import MiB
from memguard.memory import arena
from memguard.memory.oom import is_oom
from memguard.train.transaction import PostStepError

F = torch.nn.functional
BUDGET = 64 * MiB
ROOM = 2 * MiB       # left free once the ballast is allocated; a copy of the weights needs 4


def _model_and_opt():
    """A head trained over a frozen backbone: the steps need little of the
    budget (the head's 64 KiB of gradients), a copy of the weights 4 MiB."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024).requires_grad_(False),
                                torch.nn.Linear(1024, 16))
    return model, torch.optim.SGD(model[1].parameters(), lr=0.01, momentum=0.9)


def _step(guard, model, opt, **kw):
    x = torch.randn(8, 1024)
    return guard.step(x, lambda b: model(b).square().mean(), opt, **kw)


def _fill(room: int = ROOM) -> list[torch.Tensor]:
    """A ballast taking all of the budget but ``room`` bytes (up to a block
    more), in blocks of 1 MiB, each measured by what the arena reserved for
    it (its size class and header)."""
    arena.trim()
    ballast, left = [], lambda: arena.stats()["budget_bytes"] - arena.stats()["reserved_bytes.current"]
    block = MiB
    while left() - block >= room:
        before = left()
        ballast.append(torch.empty(MiB, dtype=torch.uint8))
        block = before - left()
    assert room - block <= left() < room + block, (left(), block)
    return ballast


def _copying_save(model, opt) -> bytes:
    """A checkpoint with a copy of the weights (as an EMA's): 4 MiB of new
    tensors, twice the room left."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "ema": {k: v.detach().clone() for k, v in model.state_dict().items()}}, buf)
    return buf.getvalue()


@pytest.fixture
def guard():
    with memguard.Guard(budget=None, tensor_budget=BUDGET, micro_batch=8) as g:
        if g.allocator_error is not None:
            pytest.skip(g.allocator_error)
        yield g


def test_torch_save_of_cpu_tensors_allocates_no_tensor_memory(guard, tmp_path):
    """A model's and an optimizer's state (and a transposed view) written to
    a file and to a BytesIO: no arena allocation, so no budget can refuse
    it, hard or soft."""
    model, opt = _model_and_opt()
    _step(guard, model, opt)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "view": model[0].weight.t()}
    ballast = _fill()
    arena.set_soft(False)
    try:
        before = arena.stats()["num_allocs"]
        torch.save(state, tmp_path / "ckpt.pt")
        torch.save(state, io.BytesIO())
        assert arena.stats()["num_allocs"] == before
    finally:
        arena.set_soft(True)
    del ballast
    loaded = torch.load(tmp_path / "ckpt.pt")
    assert torch.equal(loaded["view"], model[0].weight.t())


@pytest.mark.parametrize("soft", [True, False])
def test_a_save_that_copies_is_served_past_the_budget_between_steps(guard, soft):
    """Between two steps, with 2 MiB of the budget left: the save's 4 MiB
    of copies are served and reported, and the next step runs. The control:
    with the budget hard, the same save is refused."""
    model, opt = _model_and_opt()
    _step(guard, model, opt)
    ballast = _fill()
    arena.set_soft(soft)
    try:
        if not soft:
            with pytest.raises(RuntimeError) as refused:
                _copying_save(model, opt)
            assert is_oom(refused.value)
            return
        before = arena.stats()["num_overruns"]
        with pytest.warns(BudgetOverrunWarning, match="outside a guarded step"):  # noqa: PT031
            data = _copying_save(model, opt)
            guard.boundary.overruns.check()      # unless the sampler's thread was first
        assert arena.stats()["num_overruns"] > before
    finally:
        arena.set_soft(True)
    del ballast
    ema = torch.load(io.BytesIO(data))["ema"]
    assert torch.equal(ema["0.weight"], model[0].weight)
    assert _step(guard, model, opt).n_micro == 1


@pytest.mark.parametrize("soft", [True, False])
def test_a_save_in_post_step_is_served_past_the_budget(guard, soft):
    """``post_step`` runs after the commit, outside the step's strict
    section: a save there, with 2 MiB of the budget left, is served. The
    control: with the budget hard, it is refused (a PostStepError, the step
    committed)."""
    model, opt = _model_and_opt()
    _step(guard, model, opt)
    saved: list[bytes] = []
    ballast = _fill()
    before = arena.stats()["num_overruns"]
    arena.set_soft(soft)
    try:
        if not soft:
            with pytest.raises(PostStepError) as refused:
                _step(guard, model, opt, post_step=lambda aux: saved.append(
                    _copying_save(model, opt)))
            assert is_oom(refused.value.__cause__) and guard.steps == 2
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BudgetOverrunWarning)
            _step(guard, model, opt, post_step=lambda aux: saved.append(_copying_save(model, opt)))
    finally:
        arena.set_soft(True)
    del ballast
    assert len(saved) == 1 and arena.stats()["num_overruns"] > before
    assert torch.equal(torch.load(io.BytesIO(saved[0]))["ema"]["0.weight"], model[0].weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_save_of_cuda_tensors_copies_them_through_the_host_arena(guard):
    """torch.save copies each CUDA storage to the host: through memguard's
    arena, past a CPU tensor budget nearly all taken, served."""
    model = torch.nn.Linear(1024, 1024).cuda()        # 4 MiB copied to the host
    ballast = _fill()
    before = arena.stats()["num_allocs"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BudgetOverrunWarning)
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
    assert arena.stats()["num_allocs"] > before
    del ballast
    buf.seek(0)
    assert torch.equal(torch.load(buf)["weight"], model.weight)


def test_lightning_model_checkpoint_in_on_train_batch_end_is_served(tmp_path):
    """A MemGuardModule under a 64 MiB tensor budget nearly all taken by a
    ballast, saved by ModelCheckpoint after every batch (its
    ``on_train_batch_end``) with an ``on_save_checkpoint`` adding an EMA
    copy (4 MiB, twice the room): every save is written, the run goes on,
    the overrun is reported in the train stage."""
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import ModelCheckpoint

    from memguard.integrations.lightning import MemGuardCallback, MemGuardModule

    class Module(MemGuardModule, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, _ = _model_and_opt()
            self.ballast: list = []

        def on_train_start(self):
            self.ballast = _fill()

        def training_step(self, batch, batch_idx):
            return self.model(batch[0]).square().mean()

        def on_save_checkpoint(self, checkpoint):
            checkpoint["ema"] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

        def configure_optimizers(self):
            return torch.optim.SGD(self.model[1].parameters(), lr=0.01, momentum=0.9)

    cb = MemGuardCallback(budget=None, tensor_budget=BUDGET, micro_batch=8)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    ds = torch.utils.data.TensorDataset(torch.randn(24, 1024))
    t = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, ckpt])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t.fit(Module(), torch.utils.data.DataLoader(ds, batch_size=8))
    if cb.guard.allocator_error is not None:
        pytest.skip(cb.guard.allocator_error)
    assert t.global_step == 3 and cb.guard.steps == 3
    assert len(list(tmp_path.glob("*.ckpt"))) == 3
    said = [str(w.message) for w in seen if w.category is BudgetOverrunWarning]
    assert said and "train stage" in said[0], said
    last = torch.load(max(tmp_path.glob("*.ckpt")), weights_only=False)
    assert torch.equal(last["ema"]["0.weight"], last["state_dict"]["model.0.weight"])
