"""The loops of DINO and MoCo as their authors wrote them, guarded, under a
real tensor budget at which their plain loop fits.

DINO (Caron et al., 2021, facebookresearch/dino ``main_dino.py``): a
student and an EMA teacher over multi-crop views, a ``DINOLoss`` whose
``update_center`` *reassigns* its ``center`` buffer inside the loss,
``clip_gradients`` (each parameter's gradient norm clipped on its own),
``cancel_gradients_last_layer`` (the head's last layer frozen in the first
epoch) and AdamW. MoCo v2 (He et al., 2020, facebookresearch/moco
``moco/builder.py``): ``_momentum_update_key_encoder`` reassigning each key
parameter's ``.data`` before the forward, a queue of keys with a pointer,
SGD with momentum. (The code below is written from the papers' loops, to
their shape, not copied.)

Guarded with the upstream code unchanged (the center updated in the loss,
the momentum update as ``pre_step``), a step at micro-batch = batch equals
the plain loop's bit for bit; split in two, with the once-per-step updates
moved to ``post_step`` as memguard's docs say, it equals the unsplit run
within float rounding. Each runs under a budget the plain loop fits in, and
an out-of-memory error injected into a step is redone without changing the
result.
"""
from __future__ import annotations

import copy
import gc

import pytest

torch = pytest.importorskip("torch")

from memguard import Guard, Output
from memguard.memory import arena as allocator

F = torch.nn.functional
OUT = 8192
OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes"


pytestmark = pytest.mark.usefixtures("one_thread")


# -- DINO ----------------------------------------------------------------------------
class Backbone(torch.nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.GELU(),
                                       torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(),
                                       torch.nn.Linear(256, dim), torch.nn.LayerNorm(dim))

    def forward(self, x):
        return self.net(x)


class Head(torch.nn.Module):
    """DINO's head: an MLP to a bottleneck, then a last layer to many
    prototypes (65536 upstream), most of the parameters and of AdamW's
    state."""

    def __init__(self, dim: int = 64, out: int = OUT, bottleneck: int = 256) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU(),
                                       torch.nn.Linear(dim, bottleneck))
        self.last_layer = torch.nn.Linear(bottleneck, out, bias=False)

    def forward(self, x):
        return self.last_layer(F.normalize(self.mlp(x), dim=-1))


class MultiCrop(torch.nn.Module):
    """Runs the backbone once per crop resolution, the head on all."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone, self.head = Backbone(), Head()

    def forward(self, crops):
        return torch.cat([self.head(self.backbone(c)) for c in crops])


class DINOLoss(torch.nn.Module):
    def __init__(self, out: int = OUT, ncrops: int = 4, momentum: float = 0.9) -> None:
        super().__init__()
        self.ncrops, self.momentum = ncrops, momentum
        self.register_buffer("center", torch.zeros(1, out))

    def forward(self, student_out, teacher_out, update_center: bool = True):
        s = (student_out / 0.1).chunk(self.ncrops)
        t = F.softmax((teacher_out - self.center) / 0.04, dim=-1).detach().chunk(2)
        total, n = 0.0, 0
        for iq, q in enumerate(t):
            for v in range(len(s)):
                if v == iq:
                    continue
                total = total + torch.sum(-q * F.log_softmax(s[v], dim=-1), dim=-1).mean()
                n += 1
        if update_center:
            self.update_center(teacher_out)
        return total / n

    @torch.no_grad()
    def update_center(self, teacher_out):
        batch_center = teacher_out.mean(dim=0, keepdim=True)
        self.center = self.center * self.momentum + batch_center * (1 - self.momentum)


def clip_gradients(model, clip: float) -> None:
    for p in model.parameters():
        if p.grad is not None:
            norm = p.grad.data.norm(2)
            ratio = clip / (norm + 1e-6)
            if ratio < 1:
                p.grad.data.mul_(ratio)


def cancel_gradients_last_layer(epoch: int, model, freeze_epochs: int) -> None:
    if epoch >= freeze_epochs:
        return
    for n, p in model.named_parameters():
        if "last_layer" in n:
            p.grad = None


def dino_data(steps: int, batch: int):
    g = torch.Generator().manual_seed(3)
    return [[torch.randn(batch, 3, 16, 16, generator=g) for _ in range(2)] +
            [torch.randn(batch, 3, 8, 8, generator=g) for _ in range(2)] for _ in range(steps)]


def dino_build():
    torch.manual_seed(0)
    student = MultiCrop()
    teacher = copy.deepcopy(student).requires_grad_(False)
    loss = DINOLoss()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    return student, teacher, loss, opt


def ema(student, teacher, m: float = 0.99) -> None:
    with torch.no_grad():
        for ps, pt in zip(student.parameters(), teacher.parameters()):
            pt.data.mul_(m).add_((1 - m) * ps.detach().data)


def dino_plain(steps: int, batch: int):
    student, teacher, loss_mod, opt = dino_build()
    for i, crops in enumerate(dino_data(steps, batch)):
        t_out = teacher(crops[:2])
        s_out = student(crops)
        loss = loss_mod(s_out, t_out)
        opt.zero_grad()
        loss.backward()
        clip_gradients(student, 0.3)
        cancel_gradients_last_layer(i, student, 1)
        opt.step()
        ema(student, teacher)
    return student, teacher, loss_mod


def dino_guarded(steps: int, batch: int, micro: int, room: int | None, oom_at: int = -1):
    """The same loop through Guard.step, under a tensor budget of ``room``
    above what is held before it: the upstream loss as it is at micro-batch
    = batch; split, the center updated in post_step."""
    budget = budget_for(room)
    student, teacher, loss_mod, opt = dino_build()
    g = Guard(budget=None, tensor_budget=budget, micro_batch=micro, min_micro_batch=2,
              allocator=budget is not None)
    split = micro < batch
    calls = []

    def loss_fn(crops):
        calls.append(1)
        t_out = teacher(crops[:2])
        loss = loss_mod(student(crops), t_out, update_center=not split)
        if len(calls) == oom_at:
            raise RuntimeError(OOM)
        return Output(loss=loss, aux=t_out.view(2, -1, t_out.shape[-1]).transpose(0, 1))

    def post_step(t_out):
        if split:                           # the whole batch's teacher outputs, once
            loss_mod.update_center(t_out.transpose(0, 1).reshape(-1, t_out.shape[-1]))
        ema(student, teacher)

    with g:
        for i, crops in enumerate(dino_data(steps, batch)):
            def hooks(optimizer, i=i):
                clip_gradients(student, 0.3)
                cancel_gradients_last_layer(i, student, 1)

            g.step(crops, loss_fn, opt, restore=[loss_mod], before_optimizer_step=hooks,
                   post_step=post_step)
    return student, teacher, loss_mod, g


# -- MoCo v2 -----------------------------------------------------------------------------
class MoCo(torch.nn.Module):
    def __init__(self, dim: int = 32, K: int = 64, m: float = 0.99, T: float = 0.2) -> None:
        super().__init__()
        self.K, self.m, self.T = K, m, T
        self.encoder_q = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 64, 64),
                                             torch.nn.ReLU(), torch.nn.Linear(64, dim))
        self.encoder_k = copy.deepcopy(self.encoder_q).requires_grad_(False)
        self.register_buffer("queue", F.normalize(torch.randn(dim, K), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self):
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data = param_k.data * self.m + param_q.data * (1.0 - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        batch_size = keys.shape[0]
        ptr = int(self.queue_ptr)
        assert self.K % batch_size == 0
        self.queue[:, ptr:ptr + batch_size] = keys.T
        self.queue_ptr[0] = (ptr + batch_size) % self.K

    def forward(self, im_q, im_k, momentum: bool = True, enqueue: bool = True):
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            if momentum:
                self._momentum_update_key_encoder()
            k = F.normalize(self.encoder_k(im_k), dim=1)
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1) / self.T
        labels = torch.zeros(logits.shape[0], dtype=torch.long)
        if enqueue:
            self._dequeue_and_enqueue(k)
        return logits, labels, k


def moco_data(steps: int, batch: int):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(batch, 3, 8, 8, generator=g), torch.randn(batch, 3, 8, 8, generator=g))
            for _ in range(steps)]


def moco_build():
    torch.manual_seed(0)
    model = MoCo()
    opt = torch.optim.SGD(model.encoder_q.parameters(), lr=0.05, momentum=0.9,
                          weight_decay=1e-4)
    return model, opt


def moco_plain(steps: int, batch: int):
    model, opt = moco_build()
    for im_q, im_k in moco_data(steps, batch):
        logits, labels, _ = model(im_q, im_k)
        loss = F.cross_entropy(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def moco_guarded(steps: int, batch: int, micro: int, room: int | None, oom_at: int = -1):
    """The momentum update as pre_step (listed in restore=, as the docs
    advise), the keys enqueued once a step in post_step, under a tensor
    budget of ``room`` above what is held before it."""
    budget = budget_for(room)
    model, opt = moco_build()
    g = Guard(budget=None, tensor_budget=budget, micro_batch=micro, model=model,
              divisor_of=model.K, allocator=budget is not None)
    calls = []

    def loss_fn(b):
        calls.append(1)
        logits, labels, k = model(*b, momentum=False, enqueue=False)
        if len(calls) == oom_at:
            raise RuntimeError(OOM)
        return Output(loss=F.cross_entropy(logits, labels), aux=k)

    with g:
        for b in moco_data(steps, batch):
            g.step(b, loss_fn, opt, pre_step=model._momentum_update_key_encoder,
                   post_step=model._dequeue_and_enqueue,
                   restore=[model, *model.encoder_k.parameters()])
    return model, g


# -- the runs ------------------------------------------------------------------------------
def plain_peak(run) -> int:
    """Bytes above what was held that a plain run's tensors peaked at."""
    gc.collect()
    allocator.trim()
    base = allocator.stats()["allocated_bytes.current"]
    allocator.reset_peaks()
    run()
    return allocator.stats()["allocated_bytes.peak"] - base


def budget_for(room: int | None) -> int | None:
    """A budget that leaves ``room`` above what is held now."""
    if room is None:
        return None
    gc.collect()
    allocator.trim()
    return allocator.stats()["reserved_bytes.current"] + room


def room_for(peak: int) -> int:
    """Room a plain run that peaked ``peak`` above what was held fits in,
    with a little to spare."""
    return peak + peak // 4 + (2 << 20)


def assert_equal_models(a, b, exact: bool) -> None:
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        if exact:
            assert torch.equal(x, y), k
        else:
            torch.testing.assert_close(x, y, rtol=2e-4, atol=1e-6, msg=k)


STEPS, BATCH = 3, 16


def test_dino_guarded_equals_its_plain_loop(arena):
    room = room_for(plain_peak(lambda: dino_plain(STEPS, BATCH)))
    allocator.set_budget(budget_for(room))          # the plain loop fits under it
    s0, t0, l0 = dino_plain(STEPS, BATCH)
    allocator.set_budget(None)
    s1, t1, l1, g = dino_guarded(STEPS, BATCH, BATCH, room)
    assert g.steps == STEPS and all(p.grad is None for p in s1.head.last_layer.parameters())
    for a, b in ((s0, s1), (t0, t1), (l0, l1)):
        assert_equal_models(a, b, exact=True)
    del s1, t1, l1, g
    s2, t2, l2, g = dino_guarded(STEPS, BATCH, BATCH // 2, room, oom_at=4)
    assert g.ooms_recovered == 1
    for a, b in ((s0, s2), (t0, t2), (l0, l2)):
        assert_equal_models(a, b, exact=False)


def test_moco_guarded_equals_its_plain_loop(arena):
    room = room_for(plain_peak(lambda: moco_plain(STEPS, BATCH)))
    allocator.set_budget(budget_for(room))
    m0 = moco_plain(STEPS, BATCH)
    allocator.set_budget(None)
    m1, g = moco_guarded(STEPS, BATCH, BATCH, room)
    assert g.steps == STEPS
    assert_equal_models(m0, m1, exact=True)
    del m1, g
    m2, g = moco_guarded(STEPS, BATCH, BATCH // 2, room, oom_at=3)
    assert g.ooms_recovered == 1
    assert_equal_models(m0, m2, exact=False)
    assert int(m2.queue_ptr) == STEPS * BATCH % m2.K
