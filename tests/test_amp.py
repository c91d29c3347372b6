"""float16 mixed precision on the CPU (memguard.train.amp): a guarded step
whose parameters are all on the CPU warns once, naming the script's line,
where it uses float16 autocast (around the step or inside ``loss_fn``) or a
GradScaler; never for bfloat16 or float32. Lightning's ``16-mixed`` on the
CPU is bfloat16 (Lightning switches it), an explicit float16 precision
plugin is warned about."""
from __future__ import annotations

import contextlib
import pathlib
import warnings

import pytest

torch = pytest.importorskip("torch")

import memguard
from memguard.train import amp
from tests.test_step_cost import Reads

F = torch.nn.functional

pytestmark = pytest.mark.usefixtures("one_thread")


def setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def autocast(dtype):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=dtype)


X, Y = torch.randn(8, 6), torch.randn(8, 3)
F16, BF16 = torch.float16, torch.bfloat16


@pytest.mark.parametrize(("around", "inside", "scaled", "said"), [
    (F16, None, False, "float16 autocast"),
    (None, F16, False, "float16 autocast"),
    (None, None, True, "a GradScaler"),
    (None, F16, True, "float16 autocast with a GradScaler"),
    (BF16, None, False, None),
    (None, BF16, False, None),
    (None, None, False, None),
])
def test_float16_on_the_cpu_is_warned_once(around, inside, scaled, said):
    """Three steps, two of them split: one warning (none for bfloat16 or
    float32), naming the line that called ``Guard.step``."""
    model, opt = setup()
    scaler = torch.amp.GradScaler("cpu") if scaled else None

    def loss_fn(b):
        with autocast(inside):
            return F.mse_loss(model(b[0]), b[1])

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        guard = memguard.Guard(budget=None, micro_batch=4, allocator=False)
        with autocast(around):
            for _ in range(3):
                guard.step((X, Y), loss_fn, opt, scaler=scaler)    # the line warned at
    got = [w for w in seen if "saves nothing" in str(w.message)]
    if said is None:
        assert got == []
        return
    assert len(got) == 1, [str(w.message) for w in got]
    msg = str(got[0].message)
    assert msg.startswith(f"memguard: {said} in a step") and "bfloat16" in msg
    assert got[0].filename == __file__ and "the line warned at" in \
        pathlib.Path(__file__).read_text().splitlines()[got[0].lineno - 1]


def test_a_parameter_off_the_cpu_or_a_disabled_scaler_is_not_warned_about():
    """float16 is what a GPU accelerates: one parameter off the CPU (here on
    the meta device, beside one on the CPU) rules the warning out; so does
    a disabled scaler."""
    meta = torch.optim.SGD([torch.nn.Parameter(torch.empty(2)),
                            torch.nn.Parameter(torch.empty(2, device="meta"))], lr=0.1)
    _, cpu = setup()
    on = torch.amp.GradScaler("cpu")
    off = torch.amp.GradScaler("cpu", enabled=False)
    assert amp.cpu_fp16(None, on, meta) is None
    assert amp.cpu_fp16(None, off, cpu) is None
    assert amp.cpu_fp16(None, on, cpu) == "a GradScaler"
    with torch.autocast("cpu", dtype=F16):
        assert amp.cpu_fp16(None, None, meta) is None
        assert amp.cpu_fp16(None, None, cpu) == "float16 autocast"


def test_the_check_reads_no_value_and_runs_once_per_guard():
    """A guard's first float16 step (the one that checks, loss_fn's graph
    included) reads the device as often as the same step of a guard whose
    check is done, and the check is not run again."""
    reads, warned = {}, {}
    for checked in (False, True):
        model, opt = setup()
        scaler = torch.amp.GradScaler("cpu")
        guard = memguard.Guard(budget=None, micro_batch=4, allocator=False)
        if checked:
            guard._warned.add("amp")     # the check done, as after a first step

        def loss_fn(b, model=model):
            with autocast(F16):
                return F.mse_loss(model(b[0]), b[1])

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with Reads(list(model.parameters())) as r:
                guard.step((X, Y), loss_fn, opt, scaler=scaler)
            guard.step((X, Y), loss_fn, opt, scaler=scaler)
        assert "amp" in guard._warned
        reads[checked] = r.reads
        warned[checked] = len([w for w in seen if "saves nothing" in str(w.message)])
    assert warned == {False: 1, True: 0}
    assert reads[False] == reads[True], reads


def _lightning_run(tmp_path, **kw):
    """A MemGuardModule's two steps on the CPU under ``kw``'s precision;
    the warnings seen and the dtypes autocast gave inside training_step."""
    L = pytest.importorskip("lightning.pytorch")
    from memguard.integrations.lightning import MemGuardCallback, MemGuardModule

    dtypes = []

    class Module(MemGuardModule, L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(6, 3)

        def training_step(self, batch, batch_idx):
            out = self.net(batch[0])
            dtypes.append(out.dtype)
            return F.mse_loss(out.float(), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ds = torch.utils.data.TensorDataset(torch.randn(16, 6), torch.randn(16, 3))
    t = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False,
                  callbacks=[MemGuardCallback(budget=None, micro_batch=4, allocator=False)], **kw)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t.fit(Module(), torch.utils.data.DataLoader(ds, batch_size=8))
    assert t.global_step == 2
    return [str(w.message) for w in seen], set(dtypes)


def test_lightning_16_mixed_on_the_cpu_is_bfloat16_and_not_warned_about(tmp_path):
    """Lightning runs ``precision="16-mixed"`` on the CPU as bf16-mixed (it
    says so itself): no float16, so memguard adds nothing."""
    said, dtypes = _lightning_run(tmp_path, precision="16-mixed")
    assert dtypes == {torch.bfloat16}
    assert not [m for m in said if "saves nothing" in m]


def test_lightning_float16_precision_plugin_on_the_cpu_is_warned_once(tmp_path):
    """An explicit float16 MixedPrecision plugin on the CPU (autocast around
    training_step, its scaler in manual_backward): one warning."""
    pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    said, dtypes = _lightning_run(tmp_path, plugins=[plugin])
    assert dtypes == {torch.float16}
    got = [m for m in said if "saves nothing" in m]
    assert len(got) == 1 and got[0].startswith("memguard: float16 autocast in a step"), said
