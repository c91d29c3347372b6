"""The Lightning integration on two CPU processes (gloo): ``strategy="ddp"``
(deferred gradient sync, and ``ddp_overlap``) and ``"ddp_spawn"``, with
:class:`MemGuardModule` and :class:`MemGuardCallback`.

Every run is made by tests/lightning_ddp_worker.py, all of them in one
launch (a launch costs more than a run), bounded by a timeout so that a
rank waiting in a collective another will never join fails the test
instead of hanging it. On rank 1 memguard's arena refuses allocations for
real: in one training step (both ranks redo it smaller) and in one
validation batch (that rank's inference goes on smaller). The ranks end
with the same parameters, those of one process training unsplit on the
whole global batches.
"""
from __future__ import annotations

import os
import pickle
import sys
import types

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
L = pytest.importorskip("lightning.pytorch")

import memguard
from memguard.integrations.lightning import MemGuardCallback, MemGuardModule
from tests.conftest import ROOT, run_bounded
from tests.lightning_ddp_worker import BATCH, RUNS, STEPS, VAL_BATCHES

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

TIMEOUT_S = 300   # generous for a loaded machine; a deadlock would last forever


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """Every run of the worker, in one launch: name -> the ranks' records."""
    out = tmp_path_factory.mktemp("lightning_ddp")
    cmd = [sys.executable, str(ROOT / "tests" / "lightning_ddp_worker.py"), "--out", str(out)]
    path = [str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p),
               OMP_NUM_THREADS="1")
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)              # a launch of its own, not a rank of another
    run_bounded(cmd, env, TIMEOUT_S, "the Lightning runs", cwd=out)
    return {name: tuple(torch.load(out / name / f"rank{r}.pt") for r in range(2))
            for name in RUNS}


@pytest.mark.parametrize("name", list(RUNS))
def test_an_oom_on_one_rank_is_redone_smaller_on_both(runs, name):
    """Rank 1's arena refuses an allocation in step 1 (in its backward; in
    its forward, before DDP's synchronising backward, under ddp_overlap):
    both ranks redo the step at the same smaller size and keep it, and end
    with the same parameters, those of unsplit single-process training."""
    r0, r1 = runs[name]
    strategy, overlap, _ = RUNS[name]
    assert (r0["world"], r0["overlap"], r0["peers"]) == (2, overlap, True)
    assert r0["start_method"] == ("spawn" if strategy == "ddp_spawn" else "popen")
    assert r0["global_step"] == r1["global_step"] == STEPS
    assert r0["steps"] == r1["steps"]
    micro = r0["steps"][1][0]
    assert r0["steps"] == [(BATCH, 0, []), (micro, 1, [BATCH])] + [(micro, 0, [])] * 2
    assert 0 < micro < BATCH
    assert r1["refusals"] >= 1 and r0["refusals"] == 0      # rank 1's arena, for real
    for k, ref in r0["reference"]["state"].items():
        assert torch.equal(r0["state"][k], r1["state"][k]), k
        torch.testing.assert_close(r0["state"][k], ref, rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.parametrize("name", list(RUNS))
def test_validation_is_guarded_on_every_rank(runs, name):
    """Both ranks validate through the guard's inference plan; rank 1's
    arena refuses the first validation batch at the full size and its
    inference goes on smaller, without a deadlock. Each batch's
    ``self.log(..., sync_dist=True)`` (a collective at every call) reaches
    Lightning once however the batch was split, and the validation loss
    reduced over the ranks is that of the unsplit model on all the data."""
    r0, r1 = runs[name]
    assert r0["val_sizes"] == [BATCH] * VAL_BATCHES
    assert r1["val_sizes"][0] == BATCH and max(r1["val_sizes"][1:]) < BATCH
    assert sum(r1["val_sizes"][1:]) == BATCH * VAL_BATCHES
    assert r1["ooms_recovered"] == r0["ooms_recovered"] + 1     # the validation's
    for r in (r0, r1):
        assert r["logged"]["val_loss"] == VAL_BATCHES
        assert r["logged"]["train_loss"] == STEPS
    assert r0["val_loss"] == r1["val_loss"]
    assert r0["val_loss"] == pytest.approx(r0["reference"]["val_loss"], rel=1e-5)


def test_the_callback_crosses_into_a_spawned_process():
    """``ddp_spawn`` pickles the trainer's callbacks: a MemGuardCallback
    goes over as its options and the state its guard reached, and makes its
    guard again on the other side (the guard itself, with its sampler and
    locks, is the process's own)."""
    cb = MemGuardCallback(budget="1GiB", micro_batch=8, allocator=False, min_micro_batch=2,
                          log_every_n_steps=3)
    copy = pickle.loads(pickle.dumps(cb))
    assert copy.guard is not cb.guard
    assert copy.guard.budget_bytes == cb.guard.budget_bytes == 1 << 30
    assert copy.guard.config == cb.guard.config
    assert copy.log_every_n_steps == 3 and copy._pending is None    # a fresh guard: no state
    cb.guard.steps = 5                                               # one that stepped
    state = pickle.loads(pickle.dumps(cb))._pending
    assert state == cb.guard.state_dict() and state["steps"] == 5


def test_lightning_fsdp1_is_refused_before_the_first_step():
    """Lightning's ``strategy="fsdp"`` has wrapped the module in FSDP1 by
    ``on_fit_start`` (and before validation, test or predict loops): the
    callback refuses it there, naming it and what to use instead; a
    MemGuardModule without a callback refuses it as it makes its own guard,
    at its first step."""
    from tests.test_engines import fsdp1

    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(model=fsdp1()), callbacks=[])
    cb = MemGuardCallback(budget=None, allocator=False)
    for hook in (cb.on_fit_start, cb.on_validation_start, cb.on_test_start, cb.on_predict_start):
        with pytest.raises(memguard.UnsupportedEngine, match=r"FSDP1 .* use FSDP2 .*"
                                                            r"ModelParallelStrategy"):
            hook(trainer, None)
    assert cb.guard.model is None and not cb.guard.installed

    class Module(MemGuardModule, L.LightningModule):
        pass

    module = Module()
    module._trainer = trainer
    with pytest.raises(memguard.UnsupportedEngine, match="strategy=\"fsdp\""):
        _ = module.memguard
    assert "_memguard_own" not in module.__dict__
