"""Guard.step on a CUDA device: a real CUDA out-of-memory error inside a
step is recovered, and Lightning's 16-mixed precision works through the
mixin. Skipped where torch sees no CUDA device."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

GiB = 1 << 30


def wide_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.GELU(),
                               torch.nn.Linear(width, width), torch.nn.GELU(),
                               torch.nn.Linear(width, 8)).cuda()


def test_cuda_oom_inside_a_step_is_recovered():
    """The process may reserve only a little more than a half-size step
    needs (torch.cuda.set_per_process_memory_fraction): the full batch raises
    torch.OutOfMemoryError, the guard redoes the step at half the size, and
    the parameters equal an uninterrupted step at that size."""
    import memguard

    batch, width = 8192, 8192       # 256 MiB per activation tensor at the full batch
    x = torch.randn(batch, 256, device="cuda")
    y = torch.randn(batch, 8, device="cuda")
    model = wide_model(width)
    ref = wide_model(width)

    def loss_fn(b, m=model):
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    def reserved_peak(n):
        """What a plain step at n adds to the reserved bytes at its peak."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_reserved()
        loss_fn((x[:n], y[:n]), ref).backward()
        ref.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_reserved() - base

    full, half = reserved_peak(batch), reserved_peak(batch // 2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    for i in range(0, batch, batch // 2):   # the reference: two half-size micro-batches
        (loss_fn((x[i:i + batch // 2], y[i:i + batch // 2]), ref) * 0.5).backward()
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    allowed = torch.cuda.memory_reserved() + (full + half) // 2
    torch.cuda.set_per_process_memory_fraction(allowed / total)
    try:
        guard = memguard.Guard(budget=None, allocator=False)
        with guard:
            try:
                res = guard.step((x, y), loss_fn, opt)
            except memguard.GuardOOMError as exc:
                pytest.fail(f"{exc}; full {full >> 20} MiB, half {half >> 20} MiB, allowed "
                            f"{allowed >> 20} MiB\n{torch.cuda.memory_summary(abbreviated=True)}")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert res.retries >= 1 and res.tried[0] == batch
    assert res.micro_batch == batch // 2
    assert guard.peak_source == "cuda"
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_lightning_16_mixed_through_the_mixin(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from memguard.integrations.lightning import MemGuardCallback, MemGuardModule

    class Model(MemGuardModule, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(),
                                           torch.nn.Linear(256, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 32, generator=g),
                                          torch.randn(256, 1, generator=g))
    cb = MemGuardCallback(budget=None, micro_batch=8, allocator=False)
    t = L.Trainer(max_epochs=1, accelerator="gpu", devices=1, precision="16-mixed",
                  callbacks=[cb], logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, default_root_dir=tmp_path)
    model = Model()
    t.fit(model, torch.utils.data.DataLoader(data, batch_size=32))
    assert t.global_step == 8 and cb.guard.steps == 8
    assert cb.guard.last.n_micro == 4
    assert t.precision_plugin.scaler is not None
    assert t.precision_plugin.scaler.get_scale() > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert float(t.callback_metrics["train_loss"]) < 10


def test_guarded_steps_leave_torchs_cuda_peak_counters_alone():
    """A script that logs torch.cuda.max_memory_allocated() reads the run's
    peak, not the last step's: the guard reads torch's counters and never
    resets them. A step that raises the mark is measured exactly; one below
    an earlier, higher mark gets a lower bound, not taught to the planner."""
    import memguard

    model = wide_model(1024)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_fn(b):
        return torch.nn.functional.mse_loss(model(b[0]), b[1])

    hog = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")   # the run's peak so far
    del hog
    mark = torch.cuda.max_memory_allocated()
    guard = memguard.Guard(budget=None, micro_batch=64, allocator=False)
    with guard:
        for _ in range(3):
            res = guard.step((torch.randn(64, 256, device="cuda"),
                              torch.randn(64, 8, device="cuda")), loss_fn, opt)
    assert guard.peak_source == "cuda"
    assert torch.cuda.max_memory_allocated() >= mark        # not reset by the steps
    assert not guard.boundary.peak.exact and 0 < res.peak_bytes < mark
    torch.cuda.reset_peak_memory_stats()                    # the script's own reset
    with memguard.Guard(budget=None, micro_batch=64, allocator=False) as g2:
        res = g2.step((torch.randn(64, 256, device="cuda"), torch.randn(64, 8, device="cuda")),
                      loss_fn, opt)
    assert g2.boundary.peak.exact and res.peak_bytes == torch.cuda.max_memory_allocated()
