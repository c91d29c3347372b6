"""memguard.integrations.lightning with real Lightning runs on CPU: a throttled run trains
like the unthrottled one, the callback logs through the trainer's loggers,
its state survives a checkpoint and resume, and pressure or a real
out-of-memory error inside a step shrinks the micro-batch without failing
the run. (2-process DDP: tests/test_lightning_ddp.py, and tests/test_examples.py
runs dreams_lightning.py.)"""
from __future__ import annotations

import csv
import json
import signal
import types
import warnings

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning.pytorch")

import memguard
from memguard.integrations.lightning import MemGuardCallback, MemGuardModule
from memguard.telemetry import Level

N, BATCH, D = 64, 16, 8


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, D, generator=g), torch.randn(N, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


class Plain(L.LightningModule):
    """An ordinary module written for automatic optimization, with a
    per-step scheduler and a logged loss."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = torch.nn.Sequential(torch.nn.Linear(D, width), torch.nn.Tanh(),
                                       torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Guarded(MemGuardModule, Plain):
    """The same module with the mixin in front: nothing else changes."""


def trainer(tmp_path, callbacks=(), **kw) -> L.Trainer:
    args = {"max_epochs": 2, "accelerator": "cpu", "devices": 1, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False,
            "log_every_n_steps": 1, "logger": L.loggers.CSVLogger(tmp_path, name="run")}
    args.update(kw)
    return L.Trainer(callbacks=list(callbacks), **args)


def csv_rows(t: L.Trainer) -> list[dict]:
    with open(f"{t.logger.log_dir}/metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("micro", [4, 16])
def test_throttled_run_trains_like_the_plain_one(tmp_path, micro):
    plain = Plain()
    trainer(tmp_path / "a").fit(plain, data())
    guarded = Guarded()
    cb = MemGuardCallback(budget=None, micro_batch=micro, allocator=False)
    t = trainer(tmp_path / "b", [cb])
    t.fit(guarded, data())
    for p, q in zip(plain.parameters(), guarded.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert t.global_step == 2 * N // BATCH                 # one optimizer step per batch
    assert cb.guard.steps == t.global_step
    assert t.lr_scheduler_configs[0].scheduler.get_last_lr() == \
        [0.1 * 0.5 ** (t.global_step // 2)]                # stepped per step, as configured
    assert all(r.micro_batch == micro for r in [cb.guard.last])


def test_callback_logs_through_the_trainers_logger(tmp_path):
    cb = MemGuardCallback(budget="4GiB", micro_batch=8, allocator=False)
    t = trainer(tmp_path, [cb], max_epochs=1)
    t.fit(Guarded(), data())
    rows = csv_rows(t)
    step_rows = [r for r in rows if r.get("memguard/micro_batch")]
    assert len(step_rows) == N // BATCH
    for r in step_rows:
        assert float(r["memguard/micro_batch"]) == 8
        assert float(r["memguard/budget_mib"]) == 4096
        if memguard.sample().rss_bytes is not None:       # a platform layer that sees RSS
            assert float(r["memguard/rss_mib"]) > 10       # a real sample of this process
        else:
            assert r.get("memguard/rss_mib") in (None, "")  # never a made-up figure
        assert float(r["memguard/pressure_level"]) in (0, 1, 2, 3)
        assert float(r["memguard/ooms_recovered"]) == 0
    # the user's own log, once per batch: the mean over its micro-batches
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert len(losses) == N // BATCH and all(v > 0 for v in losses)


def test_state_survives_checkpoint_and_resume(tmp_path):
    cb = MemGuardCallback(budget=None, allocator=False)
    t = trainer(tmp_path, [cb], max_epochs=1, enable_checkpointing=True,
                default_root_dir=tmp_path)
    model = Guarded()

    class Squeeze(L.Callback):       # pressure: the planner shrinks to 4
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx < 2:
                cb.guard.signals._on_sample(types.SimpleNamespace(level=Level.HIGH,
                                                          raw_level=Level.HIGH))

    t.callbacks.append(Squeeze())
    t.fit(model, data())
    assert cb.guard.micro_batch == 4 and cb.guard.steps == 4
    ckpt = t.checkpoint_callback.best_model_path
    state = torch.load(ckpt, weights_only=False)["callbacks"]
    saved = next(v for k, v in state.items() if "MemGuardCallback" in k)
    assert saved["micro_batch"] == 4 and saved["steps"] == 4

    cb2 = MemGuardCallback(budget=None, allocator=False)
    t2 = trainer(tmp_path / "resume", [cb2], max_epochs=2)
    seen = []

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(cb2.guard.micro_batch)

    t2.callbacks.append(Probe())
    t2.fit(Guarded(), data(), ckpt_path=ckpt)
    assert seen[0] == 4                     # resumed at the saved size, not the full batch
    assert cb2.guard.steps == 8 and t2.global_step == 8


@pytest.fixture(scope="module")
def one_epoch_checkpoint(tmp_path_factory):
    """A checkpoint after one epoch of a run with MemGuardCallback."""
    root = tmp_path_factory.mktemp("ckpt")
    t = trainer(root, [MemGuardCallback(budget=None, allocator=False)], max_epochs=1,
                enable_checkpointing=True, default_root_dir=root)
    t.fit(Guarded(), data())
    return t.checkpoint_callback.best_model_path


@pytest.mark.parametrize(("field", "value", "warning"), [
    ("version", 99, "not loaded: it has version 99"),
    ("micro_batch", -5, "not loaded .*micro_batch must be an integer .* not -5.*starts fresh"),
    ("steps", None, "not loaded .*steps must be an integer .* not None.*starts fresh"),
])
def test_a_resume_with_an_unusable_guard_state_warns_and_starts_the_guard_fresh(
        tmp_path, one_epoch_checkpoint, field, value, warning):
    """memguard never stops a run that would work without it: the model,
    optimizer and loop resume from the checkpoint; the guard starts fresh."""
    ckpt = torch.load(one_epoch_checkpoint, weights_only=False)
    key = next(k for k in ckpt["callbacks"] if "MemGuardCallback" in k)
    ckpt["callbacks"][key][field] = value
    path = tmp_path / "edited.ckpt"
    torch.save(ckpt, path)
    cb = MemGuardCallback(budget=None, allocator=False)
    t = trainer(tmp_path, [cb], max_epochs=2)
    with pytest.warns(UserWarning, match=warning):
        t.fit(Guarded(), data(), ckpt_path=path)
    assert t.global_step == 8                    # the second epoch, on from the checkpoint
    assert cb.guard.steps == 4                   # counted from a fresh guard
    assert cb.guard.micro_batch == BATCH         # planned afresh: the whole batch, no pressure


def test_a_state_given_before_setup_is_loaded_or_warned_about_at_setup():
    cb = MemGuardCallback(budget=None, allocator=False)
    state = cb.guard.state_dict()
    cb.load_state_dict(dict(state, steps=-7))      # before setup: kept for setup
    with pytest.warns(UserWarning, match="not loaded .*steps must be .* not -7"):
        cb.setup(None, None, "fit")
    try:
        assert cb.guard.installed and cb.guard.steps == 0
        cb.load_state_dict(dict(state, steps=12))  # after setup: loaded at once
        assert cb.guard.steps == 12
    finally:
        cb.teardown(None, None, "fit")


class Tokens(Guarded):
    """Each sample as 96 tokens through a wide layer: activations (384 KiB
    per sample and layer) outweigh the parameters, as in real models."""

    T = 96

    def loss(self, batch):
        x, y = batch
        x = x[:, None, :] * torch.linspace(0.5, 1.5, self.T)[None, :, None]
        return torch.nn.functional.mse_loss(self.net(x).mean(1), y)

    def training_step(self, batch, batch_idx):
        return self.loss(batch)


def test_out_of_memory_inside_a_step_is_recovered(tmp_path):
    """A real allocation failure: at the first batch memguard's arena budget
    is lowered to leave room for a half-size step but not a full one; the
    step is redone at a smaller size and the run finishes every step."""
    try:
        memguard.install()
    except RuntimeError as exc:
        pytest.skip(f"memguard's allocator cannot be installed here: {exc}")
    try:
        model = Tokens(width=1024)
        cb = MemGuardCallback(budget=None)

        def added_peak(module, batch):
            """What one plain forward and backward adds to the arena at its peak."""
            memguard.memory.arena.reset_peaks()
            base = memguard.stats()["allocated_bytes.current"]
            module.loss(batch).backward()
            module.zero_grad(set_to_none=True)
            return memguard.stats()["allocated_bytes.peak"] - base

        class Lower(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if batch_idx == 0 and trainer.current_epoch == 0:
                    full = added_peak(pl_module, batch)
                    half = added_peak(pl_module, [b[:BATCH // 2] for b in batch])
                    memguard.memory.arena.trim()      # small cached blocks stay reserved
                    memguard.memory.arena.set_budget(memguard.stats()["reserved_bytes.current"]
                                                  + (full + half) // 2 + (64 << 10))

        t = trainer(tmp_path, [cb, Lower()], max_epochs=1)
        t.fit(model, data())
        assert t.global_step == N // BATCH                # no step lost
        assert cb.guard.ooms_recovered >= 1
        assert cb.guard.micro_batch < BATCH
        assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        memguard.memory.arena.set_budget(None)
        memguard.uninstall()


def test_bf16_mixed_precision_with_micro_batches(tmp_path):
    cb = MemGuardCallback(budget=None, micro_batch=4, allocator=False)
    t = trainer(tmp_path, [cb], max_epochs=1, precision="bf16-mixed")
    model = Guarded()
    t.fit(model, data())
    assert t.global_step == N // BATCH
    assert cb.guard.last.n_micro == BATCH // 4
    assert all(torch.isfinite(p).all() for p in model.parameters())


class Masked(Guarded):
    """A masked loss (the samples with a positive target) returned with its
    count as the weight, and logged; lr 0 keeps the parameters fixed so the
    expected logs are computable."""

    def masked(self, batch):
        x, y = batch
        mask = (y[:, 0] > 0).float()
        err = (self.net(x)[:, 0] - y[:, 0]).pow(2)
        count = mask.sum()
        return (err * mask).sum() / count.clamp(min=1), count

    def training_step(self, batch, batch_idx):
        loss, count = self.masked(batch)
        self.log("masked_loss", loss)
        return {"loss": loss, "weight": count}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_logs_are_weighted_like_the_loss(tmp_path):
    """self.log values are averaged over the micro-batches with the weights
    training_step returns (not the sample counts): the logged masked loss is
    the whole batch's."""
    model = Masked()
    cb = MemGuardCallback(budget=None, micro_batch=4, allocator=False)
    t = trainer(tmp_path, [cb], max_epochs=1)
    t.fit(model, data())
    logged = [float(r["masked_loss"]) for r in csv_rows(t) if r.get("masked_loss")]
    with torch.no_grad():
        expected = [float(model.masked(b)[0]) for b in data()]
    assert len(logged) == len(expected) == N // BATCH
    assert logged == pytest.approx(expected, rel=1e-5)
    # and the micro-batches' counts differ, so sample weights would not do
    counts = [[float(model.masked((x[i:i + 4], y[i:i + 4]))[1]) for i in range(0, BATCH, 4)]
              for x, y in data()]
    assert any(len(set(c)) > 1 for c in counts)


def test_module_without_callback_uninstalls_its_own_guard(tmp_path):
    """Without a MemGuardCallback the module makes its guard at the first
    step; the run's end uninstalls it (sampler, gc hooks, allocator)."""
    seen = {}

    class Peek(L.Callback):
        def on_train_end(self, trainer, pl_module):
            seen["guard"] = pl_module.memguard
            seen["allocator"] = memguard.memory.arena.installed()
            seen["sampler"] = pl_module.memguard.sampler

    was = memguard.memory.arena.installed()
    model = Guarded()
    trainer(tmp_path, [Peek()], max_epochs=1).fit(model, data())
    g = seen["guard"]
    assert g.steps == N // BATCH
    assert not g.installed and g.sampler is None and not seen["sampler"].running
    assert "_memguard_own" not in model.__dict__
    assert memguard.memory.arena.installed() == was
    if g.allocator_error is None and not was:
        assert seen["allocator"]          # it was routed during the run


def test_bad_inputs():
    with pytest.raises(ValueError, match="12 parsecs"):
        MemGuardCallback(budget="12 parsecs")
    with pytest.raises(ValueError, match="log_every_n_steps"):
        MemGuardCallback(log_every_n_steps=0)
    with pytest.raises(ValueError, match="automatic_optimization"):
        Guarded().automatic_optimization = True


def test_training_step_returning_none_skips_the_batch(tmp_path):
    """Lightning's way to skip a batch: the step is rolled back whole (the
    micro-batches before the None leave no gradient), no optimizer step is
    taken, and the run goes on; the parameters are those of a run that
    never saw that batch. The None comes from the third of the skipped
    batch's four micro-batches: two backward passes have run before it."""
    skip, micro, none_at = 2, 4, 2
    calls = {}                # batch_idx -> training_step calls (micro-batches)
    grads = {}                # what the parameters' gradients were at two moments

    def have_grads(module) -> list[bool]:
        return [p.grad is not None and bool(p.grad.abs().sum()) for p in module.parameters()]

    class Skipping(Guarded):
        def training_step(self, batch, batch_idx):
            i = calls[batch_idx] = calls.get(batch_idx, 0) + 1
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            if batch_idx == skip and i == none_at + 1:
                grads["at_none"] = have_grads(self)   # the earlier micro-batches' backward
                return None
            return loss

    class Rolled(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == skip:
                grads["after"] = have_grads(pl_module)

    class Without(Plain):
        def training_step(self, batch, batch_idx):
            return None if batch_idx == skip else super().training_step(batch, batch_idx)

    skipped = Skipping()
    cb = MemGuardCallback(budget=None, micro_batch=micro)
    trainer(tmp_path, [cb, Rolled()], max_epochs=1, logger=False).fit(skipped, data())
    plain = Without()
    trainer(tmp_path, max_epochs=1, logger=False).fit(plain, data())
    # every batch in 4 micro-batches; the skipped one stopped at its third
    assert calls == {0: BATCH // micro, 1: BATCH // micro, skip: none_at + 1, 3: BATCH // micro}
    assert grads["at_none"] == [True] * 4      # the case: gradients were there to roll back
    assert grads["after"] == [False] * 4 and cb.guard.steps == N // BATCH - 1
    # no optimizer step for the skipped batch (Lightning's own loop counts
    # the empty step in global_step; its parameters do not move either)
    assert skipped.trainer.global_step == N // BATCH - 1
    for (name, a), b in zip(skipped.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_an_oom_as_adam_creates_its_state_under_lightning_is_rolled_back_and_retried(tmp_path):
    """Through Lightning's optimizer wrapper too, an out-of-memory error
    before the update writes anything (here, as Adam creates its state at
    the first step) drops the state it made and retries: the run equals the
    plain one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Adam(Plain):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    class GuardedAdam(MemGuardModule, Adam):
        def on_train_start(self):
            inner = self.optimizers().optimizer
            real, failed = inner.step, []

            class FailFirst(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    if not failed:
                        failed.append(func)
                        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you "
                                           "tried to allocate 4096 bytes")
                    return func(*args, **(kwargs or {}))

            def step(*a, **kw):
                with FailFirst():
                    return real(*a, **kw)

            inner.step = step
            self.failed = failed

    plain = Adam()
    trainer(tmp_path / "a", max_epochs=1).fit(plain, data())
    guarded = GuardedAdam()
    cb = MemGuardCallback(budget=None, micro_batch=16, allocator=False)
    trainer(tmp_path / "b", [cb], max_epochs=1).fit(guarded, data())
    assert guarded.failed and cb.guard.steps == N // BATCH
    for p, q in zip(plain.parameters(), guarded.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


class _Boom(RuntimeError):
    pass


class RaisesAt(Guarded):
    """Raises from the training step of batch ``at`` (a bad batch)."""

    at = 2

    def training_step(self, batch, batch_idx):
        if batch_idx == self.at:
            raise _Boom("a bad batch")
        return Plain.training_step(self, batch, batch_idx)


class RaisingCallback(L.Callback):
    """A callback that stops the run with the exception given (an Optuna
    prune, a failed resume)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def on_train_batch_end(self, *args) -> None:
        raise self.exc


@pytest.mark.parametrize("how", ["training_step", "callback", "interrupt"])
def test_a_fit_that_raises_uninstalls_the_guard_and_the_next_fit_runs(tmp_path, how):
    cb = MemGuardCallback(budget=None, tensor_budget="256MiB", micro_batch=4)
    model, callbacks = (RaisesAt(), [cb]) if how == "training_step" else (Guarded(), [cb])
    if how != "training_step":
        exc = KeyboardInterrupt() if how == "interrupt" else _Boom("pruned")
        callbacks.append(RaisingCallback(exc))
    t = trainer(tmp_path / "a", callbacks)
    if how == "interrupt":         # Lightning's graceful shutdown: sys.exit(1)
        sigint = signal.getsignal(signal.SIGINT)
        try:
            with pytest.raises(SystemExit):
                t.fit(model, data())
        finally:                   # Lightning ignores SIGINT from there on
            signal.signal(signal.SIGINT, sigint)
    else:
        with pytest.raises(_Boom):
            t.fit(model, data())
    assert not cb.guard.installed
    assert memguard.memory.arena.stats()["budget_bytes"] == 0     # the budget went with it
    again = MemGuardCallback(budget=None, micro_batch=4)
    t = trainer(tmp_path / "b", [again])
    t.fit(Guarded(), data())
    assert again.guard.steps == t.global_step == 2 * N // BATCH
    assert not again.guard.installed


def test_a_module_without_callback_ends_its_guard_when_the_fit_raises(tmp_path):
    model = RaisesAt()
    with pytest.raises(_Boom):
        trainer(tmp_path / "a").fit(model, data())
    assert "_memguard_own" not in model.__dict__
    t = trainer(tmp_path / "b")
    t.fit(Guarded(), data())             # would find the first guard still installed
    assert t.global_step == 2 * N // BATCH


class WideMLP(L.LightningModule):
    """256 -> 4096 -> 1, trained at batch 64 and validated at 8192: the
    validation forward allocates 128 MiB at once. Not a MemGuardModule:
    nothing guards its steps (tests/test_lightning_eval.py has the
    MemGuardModule's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 4096), torch.nn.ReLU(),
                                       torch.nn.Linear(4096, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def wide_data(n: int, batch: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 256, generator=g),
                                        torch.randn(n, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=batch)


def test_validation_past_the_tensor_budget_is_served_and_reported(tmp_path):
    """The budget refuses inside guarded steps only: the validation forward
    of a module that is not a MemGuardModule (128 MiB under a 200 MiB
    budget beside the model) is served, with a warning naming the stage and
    an event."""
    events = tmp_path / "t.jsonl"
    cb = MemGuardCallback(budget=None, tensor_budget="200MiB", telemetry=str(events))
    t = trainer(tmp_path, [cb], max_epochs=1, num_sanity_val_steps=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t.fit(WideMLP(), wide_data(256, 64), wide_data(8192, 8192))
    assert t.global_step == 4 and cb.guard.steps == 0
    assert "val_loss" in t.callback_metrics
    if cb.guard.allocator_error is not None:
        return    # no arena here (the POSIX layer): no budget to pass, nothing to report
    said = [str(w.message) for w in seen if w.category is memguard.BudgetOverrunWarning]
    assert len(said) == 1 and "validate stage" in said[0], said
    overruns = [r for r in map(json.loads, events.read_text().splitlines())
                if r.get("event") == "overrun"]
    assert overruns and overruns[0]["where"] == "in Lightning's validate stage"
    assert overruns[0]["last_bytes"] >= 128 << 20
    assert cb.guard.ooms_recovered == 0
