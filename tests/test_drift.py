"""The drift forecast (a slow growth of the memory held between steps, named)
and the headroom (memory the whole batch leaves unused).

Real leaks through real guards: a list that keeps an activation with its
autograd graph every step, a dict cache of detached features; a flat run of
a transformers ViT; a run at a small share of its budget, whose named batch
is then tried. The trend's reading is also fed synthetic floors (noise,
one-off jumps, a slow leak over thousands of steps) to show what it ignores.
"""
from __future__ import annotations

import mmap
import random
import warnings

import pytest

import memguard
from memguard._common import MiB
from memguard.telemetry import Event, read_jsonl
from memguard.train import drift as drift_mod
from memguard.train.drift import Drift, ForecastWarning
from memguard.train.headroom import Headroom

torch = pytest.importorskip("torch")

HIDDEN = 4096


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, 4))


def _batch(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 32), torch.randint(0, 4, (n,))


def _run(tmp_path, keep, steps: int, **guard_kw):
    """``steps`` guarded steps whose loss_fn hands its hidden activation
    to ``keep``; the forecast warnings and the run's events."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_fn(b):
        x, y = b
        h = model[1](model[0](x))
        keep(h)
        return torch.nn.functional.cross_entropy(model[2](h), y)

    path = tmp_path / "run.jsonl"
    guard = memguard.Guard(telemetry=str(path), **guard_kw)
    with guard, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            guard.step(_batch(), loss_fn, opt)
    events = read_jsonl(path)[2]
    return guard, [w for w in caught if issubclass(w.category, ForecastWarning)], events


def _forecasts(events):
    return [e for e in events if e["event"] == Event.FORECAST]


def test_a_list_that_keeps_graphs_is_forecast_within_80_steps_and_named(tmp_path):
    kept: list = []
    guard, warned, events = _run(tmp_path, kept.append, 80, tensor_budget="256MiB")
    assert len(warned) == 1 and len(_forecasts(events)) == 1
    f = _forecasts(events)[0]
    assert f["step"] < 80
    assert f["rate_bytes_per_step"] >= HIDDEN * 64 * 4          # at least the activation a step
    assert 0 < f["steps_left"] <= f["horizon_steps"]
    assert f["reach_step"] == f["step"] + f["steps_left"]
    top = f["growing"][0]["what"]
    assert f"(64, {HIDDEN}) float32" in top and "autograd graph" in top and "+1 a step" in top
    assert top in str(warned[0].message)
    now = guard.summary()["forecast"]              # followed since the event
    assert now["step"] >= f["step"] and now["reach_step"] == now["step"] + now["steps_left"]


def test_a_dict_cache_of_detached_features_is_forecast_and_named(tmp_path):
    cache: dict = {}
    _, warned, events = _run(tmp_path, lambda h: cache.__setitem__(len(cache), h.detach().clone()),
                             80, tensor_budget="256MiB")
    assert len(warned) == 1
    top = _forecasts(events)[0]["growing"][0]["what"]
    assert f"(64, {HIDDEN}) float32" in top and "graph" not in top


def test_a_leak_outside_the_arena_is_forecast_from_the_footprint(tmp_path):
    """Bytes the arena does not serve (a list of buffers kept a step) grow
    the process's footprint, not the arena's floor: forecast against the
    process's budget. The sampler's period is a minute: the footprint is
    read at each boundary, not taken from its newest sample (which, where
    steps are short, stays the same for many of them)."""
    kept: list = []

    def keep(_):
        buf = mmap.mmap(-1, 2 * MiB)     # its own mapping: given back whole when the test ends
        buf[::4096] = b"x" * (2 * MiB // 4096)
        kept.append(buf)

    held = memguard.sample().footprint_bytes or memguard.sample().rss_bytes
    _, warned, events = _run(tmp_path, keep, 80, budget=held + 300 * MiB, interval_ms=60000)
    assert len(warned) == 1
    f = _forecasts(events)[0]
    assert f["source"] == "footprint" and f["step"] < 80
    assert 1.5 * MiB <= f["rate_bytes_per_step"] <= 3.5 * MiB    # 2 MiB a step, and the rest's noise
    for buf in kept:
        buf.close()


def test_a_leak_far_from_the_budget_is_not_forecast_within_the_horizon(tmp_path):
    kept: list = []
    _, warned, events = _run(tmp_path, kept.append, 40, tensor_budget="256MiB",
                             forecast_horizon=50)
    assert warned == [] and _forecasts(events) == []


def test_forecast_horizon_none_turns_it_off(tmp_path):
    kept: list = []
    guard, warned, _ = _run(tmp_path, kept.append, 40, tensor_budget="256MiB",
                            forecast_horizon=None)
    assert warned == [] and guard.boundary.drift.trend is None


def test_a_flat_transformers_vit_run_of_200_steps_is_not_forecast(tmp_path):
    """Random init, no download; CPU; without memguard's arena, so the floor
    is the process's RSS, with glibc's and PyTorch's ordinary noise."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=32,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=64, num_labels=10)
    model = transformers.ViTForImageClassification(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loss_fn(b):
        return model(pixel_values=b[0], labels=b[1]).loss

    batches = [(torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))) for _ in range(8)]
    guard = memguard.Guard(budget="auto", allocator=False)
    with guard, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(200):
            guard.step(batches[i % 8], loss_fn, opt)
    assert guard.peak_source == "rss"
    assert [str(w.message) for w in caught if issubclass(w.category, ForecastWarning)] == []
    assert guard.boundary.drift.forecast is None


# -- the trend's reading, on synthetic floors ----------------------------------------

@pytest.fixture
def no_census(monkeypatch):
    """Synthetic floors have nothing behind them to count."""
    class _C:
        def __init__(self, step):
            self.step, self.seconds = step, 0.0
    monkeypatch.setattr(drift_mod, "_census", _C)
    monkeypatch.setattr("memguard.telemetry.census.growing", lambda a, b, top=2: [])


def _feed(floors, budget=4 << 30, horizon=1000):
    events = []
    d = Drift(horizon, event=lambda name, **f: events.append(f))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for step, y in enumerate(floors):
            d.observe(step, [("arena", int(y), budget)], 0)
    return d, events


def test_noise_and_one_off_jumps_are_not_a_trend(no_census):
    rnd = random.Random(1)
    base = 800 * MiB
    floors = [base + rnd.gauss(0, 8 * MiB) for _ in range(3000)]
    for at in (300, 1200, 2500):                # an evaluation, a save: one-off levels
        floors[at:] = [y + 300 * MiB for y in floors[at:]]
    _, events = _feed(floors, budget=2 << 30)
    assert events == []


def test_a_slow_leak_under_noise_is_seen_at_a_longer_scale(no_census):
    """200 KiB a step under 4 MiB of noise: invisible step to step, clear
    over blocks of steps; forecast once, with the rate within a fifth."""
    rnd = random.Random(2)
    rate = 200 << 10
    floors = [500 * MiB + rate * i + rnd.gauss(0, 4 * MiB) for i in range(6000)]
    budget = 1536 * MiB
    _, events = _feed(floors, budget=budget)
    assert len(events) == 1
    f = events[0]
    assert f["rate_bytes_per_step"] == pytest.approx(rate, rel=0.2)
    reached = next(i for i, y in enumerate(floors) if y >= budget)
    assert abs(f["reach_step"] - reached) <= 0.2 * (reached - f["step"])


def test_an_episode_warns_once_and_ends_when_the_growth_stops(no_census):
    leak = [100 * MiB + MiB * i for i in range(200)]
    flat = [leak[-1]] * 200
    _, events = _feed(leak + flat + [leak[-1] + MiB * i for i in range(200)], budget=1 << 30)
    assert len(events) == 2                       # the second leak is a second episode
    assert events[1]["step"] > 400


def test_the_forecast_follows_its_trend_after_the_one_warning(no_census):
    """The growth slows to a quarter after the forecast: one event, with
    the first reading; ``forecast`` (the summary's, the metrics') reads the
    slower rate and the later reach."""
    floors = [100 * MiB + MiB * i for i in range(100)]
    floors += [floors[-1] + MiB // 4 * i for i in range(1, 400)]
    d, events = _feed(floors, budget=1 << 30)
    assert len(events) == 1 and events[0]["rate_bytes_per_step"] == pytest.approx(MiB)
    assert d.forecast["rate_bytes_per_step"] == pytest.approx(MiB / 4, rel=0.1)
    assert d.forecast["reach_step"] > events[0]["reach_step"] + 1000


def test_epochs_are_counted_where_known(no_census):
    d = Drift("2 epochs", steps_per_epoch=100)
    assert d.horizon_steps() == 200
    assert Drift("auto", steps_per_epoch=1000).horizon_steps() == 3000
    assert Drift("auto").horizon_steps() == 1000
    events = []
    d = Drift("auto", steps_per_epoch=50, event=lambda name, **f: events.append(f))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for i in range(60):
            d.observe(i, [("arena", 100 * MiB + MiB * i, 400 * MiB)], 0)
    f = events[0]
    assert f["rate_bytes_per_epoch"] == pytest.approx(50 * MiB, rel=0.05)
    assert f["epochs_left"] == pytest.approx(f["steps_left"] / 50)


@pytest.mark.parametrize("bad", [0, -5, "3 weeks", "epochs", True, 2.5, "0 epochs"])
def test_a_bad_forecast_horizon_is_named(bad):
    with pytest.raises(ValueError, match="forecast_horizon") as e:
        memguard.Guard(forecast_horizon=bad)
    assert repr(bad) in str(e.value)


@pytest.mark.parametrize("name,bad", [("headroom", 1.5), ("headroom", 0), ("headroom", True),
                                      ("steps_per_epoch", 0)])
def test_bad_headroom_and_epoch_options_are_named(name, bad):
    with pytest.raises(ValueError, match=name) as e:
        memguard.Guard(**{name: bad})
    assert repr(bad) in str(e.value)


# -- headroom ---------------------------------------------------------------------

def test_a_run_at_a_tenth_of_its_budget_is_told_a_batch_that_fits(tmp_path):
    """One headroom event and log line; the batch named, tried, runs whole
    under the same budget."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_fn(b):
        return torch.nn.functional.cross_entropy(model(b[0]), b[1])

    path = tmp_path / "run.jsonl"
    budget = 64 * MiB
    guard = memguard.Guard(tensor_budget=budget, telemetry=str(path), multiple_of=8)
    with guard:
        for _ in range(12):
            guard.step(_batch(16), loss_fn, opt)
        found = guard.boundary.headroom.found
        assert found is not None and found["peak_bytes"] < 0.1 * budget
        big = found["largest_batch"]
        assert big > 16 and big % 8 == 0
        res = guard.step(_batch(big), loss_fn, opt)
    assert res.n_micro == 1 and res.retries == 0 and res.peak_bytes <= budget
    events = [e for e in read_jsonl(path)[2] if e["event"] == Event.HEADROOM]
    assert len(events) == 1 and events[0]["largest_batch"] == big


class _Line:
    """A planner whose model is the line ``a + b * x``."""

    def __init__(self, a: int, b: int) -> None:
        self.a, self.b = a, b

    def predict(self, x: int) -> int:
        return self.a + self.b * x

    def state(self) -> dict:
        return {"margin": 0.03}


def test_with_a_queue_batches_come_with_a_queue_near_it():
    """Seed 002: a queue of 65536 allows only powers of two, and 128 does
    not fit; with the queue resized, batch 96 with queue 65568 does."""
    opts = {"min_micro": 1, "multiple_of": 1, "divisor_of": 65536, "margin": 0.03}
    budget = 8 << 30
    slope = int((budget * 0.97 - 1e9) / 100)            # the line reaches the budget at 100
    f = Headroom(0.6, opts).fields(5, 64, int(1e9) + 64 * slope, budget,
                                   _Line(int(1e9), slope), "cuda")
    assert f["largest_batch"] == 64
    assert {"batch": 96, "queue": 65568} in f["queue"]
    assert all(p["queue"] % p["batch"] == 0 and p["batch"] <= 100 for p in f["queue"])
    assert "batch 96 with queue 65,568" in memguard.train.headroom.message(f)


def test_headroom_none_says_nothing(tmp_path):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = memguard.Guard(tensor_budget=64 * MiB, headroom=None)
    with guard:
        for _ in range(8):
            guard.step(_batch(16), lambda b: torch.nn.functional.cross_entropy(model(b[0]), b[1]),
                       opt)
    assert guard.boundary.headroom.found is None


# -- Lightning -----------------------------------------------------------------------

def test_lightning_logs_the_drift_per_epoch_and_the_forecast_in_epochs(tmp_path):
    """A MemGuardModule whose training step keeps its activation: the epoch
    metrics carry the growth per epoch and, once forecast, the epochs left."""
    L = pytest.importorskip("lightning.pytorch")
    from memguard.lightning import MemGuardCallback, MemGuardModule

    class Leaky(MemGuardModule, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.kept = _mlp(), []

        def training_step(self, batch, batch_idx):
            h = self.net[1](self.net[0](batch[0]))
            self.kept.append(h)
            return torch.nn.functional.cross_entropy(self.net[2](h), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(20 * 64, 32, generator=g),
                                        torch.randint(0, 4, (20 * 64,), generator=g))
    cb = MemGuardCallback(budget="auto", tensor_budget="384MiB")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ForecastWarning)
        trainer.fit(Leaky(), torch.utils.data.DataLoader(ds, batch_size=64))
    m = trainer.callback_metrics
    assert cb.guard.boundary.drift.steps_per_epoch == 20
    assert float(m["memguard/drift_mib_per_epoch"]) == pytest.approx(
        20 * float(m["memguard/drift_mib_per_step"]))
    assert float(m["memguard/drift_mib_per_step"]) >= 1.0        # the 1 MiB activation a step
    f = cb.guard.summary()["forecast"]
    assert f is not None and f["epochs_left"] == pytest.approx(f["steps_left"] / 20, abs=0.05)
    assert float(m["memguard/forecast_epochs_left"]) == pytest.approx(f["epochs_left"])
    assert float(m["memguard/headroom_batch"]) > 64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_kept_per_step_are_forecast_and_named(tmp_path):
    """On the device: the floor is CUDA's allocated bytes, the budget the
    device's (cuda_budget); the kept tensors are named on cuda:0."""
    model = _mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept: list = []

    def loss_fn(b):
        h = model[1](model[0](b[0]))
        kept.append(h)
        return torch.nn.functional.cross_entropy(model[2](h), b[1])

    guard = memguard.Guard(budget=None, cuda_budget="384MiB")
    with guard, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(80):
            x, y = _batch()
            guard.step((x.cuda(), y.cuda()), loss_fn, opt)
    assert guard.peak_source == "cuda"
    warned = [w for w in caught if issubclass(w.category, ForecastWarning)]
    assert len(warned) == 1
    f = guard.summary()["forecast"]
    assert f["step"] < 80
    assert f"(64, {HIDDEN}) float32 on cuda:0 that hold autograd graphs" in f["growing"][0]["what"]
