"""The whole Lightning run guarded, not only its training step: a
MemGuardModule's validation_step, test_step and predict_step run on the
guard's inference plan, split where memory is short, and what they log and
return is what the unsplit steps log and return; trainer.validate / test /
predict run without a fit; memory is released when each loop ends; a run
without a logger logs nothing. Real Lightning on CPU."""
from __future__ import annotations

import json
import warnings

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning.pytorch")

import memguard
from memguard.lightning import MemGuardCallback, MemGuardModule
from tests.test_lightning import WideMLP as PlainWide
from tests.test_lightning import wide_data

N, BATCH, D = 48, 16, 8


def data(n: int = N, batch: int = BATCH) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, D, generator=g), torch.randn(n, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


class Plain(L.LightningModule):
    """Validation logs a mean (the default reduction) and a count summed
    over the epoch; test logs with its own batch_size; predict returns a
    dict of per-sample values, a number and a string."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = torch.nn.Sequential(torch.nn.Linear(D, 32), torch.nn.Tanh(),
                                       torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        err = self.net(x) - y
        self.log("val_loss", err.pow(2).mean())
        self.log("val_pos", (err > 0).sum().float(), reduce_fx="sum")
        self.log("val_max", err.abs().max(), reduce_fx="max")
        return {"loss": err.pow(2).mean(), "err": err, "count": float(len(x)), "tag": "v"}

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.l1_loss(self.net(x), y), batch_size=len(x))

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return {"y": self.net(x), "scale": 2.0, "name": "pred"}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Guarded(MemGuardModule, Plain):
    """The same module, its steps run through the guard."""


def trainer(callbacks=(), **kw) -> L.Trainer:
    args = {"accelerator": "cpu", "devices": 1, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False, "logger": False,
            "max_epochs": 1}
    args.update(kw)
    return L.Trainer(callbacks=list(callbacks), **args)


def events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_validate_test_and_predict_without_fit_split_as_the_unsplit_steps(tmp_path):
    """At micro-batch 4 (16 per batch): the logged metrics (mean, sum, max)
    and the predictions equal the unsplit module's, each loop ends with a
    release, and no fit ran."""
    plain = Plain()
    ref = trainer()
    val, test = ref.validate(plain, data())[0], ref.test(plain, data())[0]
    pred = ref.predict(plain, data())

    telemetry = tmp_path / "t.jsonl"
    cb = MemGuardCallback(budget=None, micro_batch=4, allocator=False, telemetry=str(telemetry))
    t = trainer([cb])
    guarded = Guarded()
    got_val, got_test = t.validate(guarded, data())[0], t.test(guarded, data())[0]
    logged = dict(t.callback_metrics)
    got_pred = t.predict(guarded, data())

    for k in ("val_loss", "val_pos", "val_max"):
        assert got_val[k] == pytest.approx(val[k], rel=1e-6, abs=1e-7), k
    assert got_test["test_loss"] == pytest.approx(test["test_loss"], rel=1e-6)
    assert logged["memguard/test_micro_batch"] == 4 and "memguard/test_rss_mib" in logged
    assert len(got_pred) == len(pred) == N // BATCH
    for p, q in zip(pred, got_pred):
        torch.testing.assert_close(q["y"], p["y"], rtol=1e-6, atol=1e-7)
        assert (q["scale"], q["name"]) == (2.0, "pred")
    assert cb.guard.steps == 0 and cb.guard.micro_batch_changes == 0
    released = [e for e in events(telemetry) if e.get("reason") == "evaluate"]
    assert len(released) == 3                     # one per loop: validate, test, predict


def test_a_split_validation_step_returns_what_the_unsplit_one_does(tmp_path):
    """What on_validation_batch_end receives: per-sample tensors
    concatenated, the 0-d loss and the number averaged by micro-batch size,
    the string kept."""
    seen = []

    class Keep(L.Callback):
        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx,
                                    dataloader_idx=0):
            seen.append(outputs)

    plain = Plain()
    trainer([Keep()]).validate(plain, data())
    whole, seen[:] = list(seen), []
    trainer([Keep(), MemGuardCallback(budget=None, micro_batch=4, allocator=False)]).validate(
        Guarded(), data(n=24, batch=12))         # micro-batches of 4: three of them
    assert len(whole) == N // BATCH and len(seen) == 2
    for out in seen:
        assert set(out) == {"loss", "err", "count", "tag"}
        assert out["err"].shape == (12, 1) and out["count"] == 4.0 and out["tag"] == "v"
    x, y = data(n=24, batch=12).dataset.tensors
    with torch.no_grad():
        err = Plain().net(x[:12]) - y[:12]
    torch.testing.assert_close(seen[0]["err"], err)
    torch.testing.assert_close(seen[0]["loss"], err.pow(2).mean(), rtol=1e-6, atol=0)


class Odd(Guarded):
    """A validation_step whose return the test sets."""

    returns = None

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        self.net(x)
        return type(self).returns(x) if callable(type(self).returns) else type(self).returns


@pytest.mark.parametrize("returns", [
    None,
    {"acc": torch.tensor(0.5), "n": 3, "p": None},
    lambda x: {"first": float(x[0, 0])},
    "done",
    lambda x: [f"id{i}" for i in range(len(x))],
])
def test_odd_validation_returns_are_handled_as_lightning_handles_them(returns):
    Odd.returns = returns
    cb = MemGuardCallback(budget=None, micro_batch=4, allocator=False)
    trainer([cb]).validate(Odd(), data())


def test_a_validation_return_that_depends_on_the_split_is_refused_naming_it():
    Odd.returns = staticmethod(lambda x: f"rows {len(x)}")
    cb = MemGuardCallback(budget=None, micro_batch=4, allocator=False)
    with pytest.raises(TypeError, match=r"out is 'rows 4' in one micro-batch and 'rows 2' in "
                                        r"another.*memguard_combine"):
        trainer([cb]).validate(Odd(), data(n=20, batch=10))   # 4, 4, 2: the values differ


def test_memguard_combine_sets_the_rule(tmp_path):
    """A count returned per batch, summed by the user's rule."""
    seen = []

    class Counted(Guarded):
        memguard_combine = {"validation_step": {"n": "sum"}}  # noqa: RUF012 - as users write it

        def validation_step(self, batch, batch_idx):
            return {"n": torch.tensor(float(len(batch[0])))}

    class Keep(L.Callback):
        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx,
                                    dataloader_idx=0):
            seen.append(float(outputs["n"]))

    trainer([Keep(), MemGuardCallback(budget=None, micro_batch=4, allocator=False)]).validate(
        Counted(), data())
    assert seen == [BATCH] * (N // BATCH)


class WideMLP(MemGuardModule, PlainWide):
    """256 -> 4096 -> 1 validated at 8192 (its forward allocates 128 MiB at
    once), guarded."""


def test_fit_validates_past_the_tensor_budget_by_splitting(tmp_path):
    """The first user's Lightning case: a validation batch whose forward
    needs 128 MiB at once beside a 200 MiB tensor budget. The fit finishes
    with its validation logged as the unsplit validation logs it; the
    validation was split (an inference plan event), not served past the
    budget."""
    telemetry = tmp_path / "t.jsonl"
    cb = MemGuardCallback(budget=None, tensor_budget="200MiB", telemetry=str(telemetry))
    t = trainer([cb], num_sanity_val_steps=0)
    model = WideMLP()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t.fit(model, wide_data(256, 64), wide_data(8192, 8192))
    assert t.global_step == 4 and cb.guard.steps == 4
    plain = PlainWide()
    plain.load_state_dict(model.state_dict())
    unsplit = trainer().validate(plain, wide_data(8192, 8192))[0]["val_loss"]
    assert float(t.callback_metrics["val_loss"]) == pytest.approx(unsplit, rel=1e-6)
    assert not [w for w in seen if w.category is memguard.BudgetOverrunWarning]
    if cb.guard.allocator_error is not None:
        return    # no arena here (the POSIX layer): no budget, nothing to split for
    plans = [e for e in events(telemetry) if e.get("event") == "infer_plan"]
    assert plans and plans[0]["failed_micro_batch"] == 8192
    assert 0 < cb.guard.inference.micro < 8192


def test_no_logger_no_warnings_about_it(tmp_path):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t = trainer([MemGuardCallback(budget=None, micro_batch=8, allocator=False)],
                    log_every_n_steps=1)
        t.fit(Guarded(), data(), data())
    said = [str(w.message) for w in seen if "no logger configured" in str(w.message)]
    assert said == []
    assert "memguard/micro_batch" in t.callback_metrics      # still there for callbacks


def test_validate_without_a_callback_makes_and_ends_its_own_guard():
    """A MemGuardModule validated with no MemGuardCallback: its guard is made
    at the first validation step and uninstalled when the loop's run ends."""
    seen = {}

    class Peek(L.Callback):
        def on_validation_end(self, trainer, pl_module):
            seen["guard"] = pl_module.memguard

    model = Guarded()
    got = trainer([Peek()]).validate(model, data())[0]
    assert got["val_loss"] > 0
    assert not seen["guard"].installed and "_memguard_own" not in model.__dict__
