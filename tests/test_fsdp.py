"""Guard.step under FSDP2 (``fully_shard``), and collectives inside a loss
under DDP: two ranks started by ``torchrun`` on gloo (CPU), every scenario
of tests/fsdp_worker.py in one launch.

Each scenario compares every rank's parameters (its shards under FSDP2)
with the plain unsplit loop's. Out-of-memory errors are injected on one
rank, once, inside its forward or backward (between FSDP2's all-gathers and
reduce-scatters) or just before its loss's ``all_gather``; every rank must
redo the step, none left in a collective. The launch is bounded by a
timeout, so a rank waiting in a collective that another will never join
fails the test instead of hanging it.
"""
from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from tests.conftest import ROOT, run_bounded
from tests.fsdp_worker import SCENARIOS

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available()
    or not hasattr(getattr(__import__("torch.distributed.fsdp").distributed.fsdp, "FSDPModule",
                           None), "reset_iter_state"),
    reason="torch.distributed with gloo and FSDP2's reset_iter_state are not available")

TIMEOUT_S = 240   # generous for a loaded machine; a deadlock would last forever


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """Every scenario, in one launch: name -> the two ranks' records."""
    out = tmp_path_factory.mktemp("fsdp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "fsdp_worker.py"), "--out", str(out), *SCENARIOS]
    path = [str(ROOT / "python"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p),
               OMP_NUM_THREADS="1")
    run_bounded(cmd, env, TIMEOUT_S, "torchrun")
    return {name: tuple(torch.load(out / name / f"rank{r}.pt") for r in range(2))
            for name in SCENARIOS}


def assert_as_unsplit(*ranks: dict) -> None:
    """Each rank's parameters are the plain unsplit loop's (up to summation
    order), and the ranks stepped alike."""
    for r in ranks:
        assert r["error"] is None, r["error"]
        for k, ref in r["reference"].items():
            torch.testing.assert_close(r["state"][k], ref, rtol=1e-5, atol=1e-5, msg=k)
    assert ranks[0]["micro"] == ranks[1]["micro"]
    assert ranks[0]["tried"] == ranks[1]["tried"]


def test_fsdp2_micro_batches_of_4_equal_the_unsplit_step(runs):
    r0, r1 = runs["fsdp-micro4"]
    assert_as_unsplit(r0, r1)
    assert r0["micro"] == [4] * 4          # 4 micro-batches of 16, each reduce-scattered
    assert r0["infer_equal"] and r1["infer_equal"]   # Guard.infer: the batch whole on each rank


@pytest.mark.parametrize("where", ["backward", "forward"])
def test_an_oom_inside_one_ranks_fsdp2_pass_is_redone_on_both(runs, where):
    """Rank 1 runs out of memory between FSDP2's collectives: rank 0 learns
    it at its next one, and both redo the step at half the size."""
    r0, r1 = runs[f"fsdp-oom-{where}"]
    assert r1["fired"] and not r0["fired"]
    assert_as_unsplit(r0, r1)
    step = SCENARIOS[f"fsdp-oom-{where}"][3]
    assert r0["tried"][step] == [16] and r0["micro"][step] == 8


def test_an_oom_after_the_last_collective_is_redone_while_calm(runs):
    """Memory calm, so no vote before each collective; rank 0 runs out of
    memory in backward, after the step's only all_gather: every collective
    of the attempt was issued (as many as each attempt so far issued), so
    the other rank is at the step's vote, which the failed rank joins."""
    r0, r1 = runs["ddp-gather-oom-calm-backward"]
    assert r0["fired"] and r0["armed"][2] is False
    assert_as_unsplit(r0, r1)
    assert r0["tried"][2] == [16]


def test_an_oom_in_one_ranks_evaluation_is_redone_on_both(runs):
    """Guard.infer under FSDP2: rank 1 runs out of memory in its forward
    (between all-gathers); both ranks redo the micro-batch at half the size,
    so they run the same forwards, and the outputs are the plain forward's."""
    r0, r1 = runs["fsdp-infer-oom"]
    assert r1["fired"] and not r0["fired"]
    assert r0["infer_equal"] and r1["infer_equal"]
    assert r0["infer_changes"] == r1["infer_changes"] == 1


def test_the_first_step_is_armed_by_default(runs):
    """Before the peak model knows a size, the agreement is armed: an
    out-of-memory error in the first step's backward is redone."""
    r0, r1 = runs["fsdp-oom-first-step"]
    assert r1["fired"]
    assert_as_unsplit(r0, r1)
    assert r0["tried"][0] == [16] and r0["armed"][0]


@pytest.mark.parametrize("name", ["ddp-gather-oom", "ddp-gather-oom-auto"])
def test_an_oom_before_a_losss_all_gather_is_redone_on_both(runs, name):
    """MoCo's pattern under DDP: rank 0 runs out of memory just before the
    loss's all_gather; rank 1, already at it, learns it there."""
    r0, r1 = runs[name]
    assert r0["fired"] and not r1["fired"]
    assert_as_unsplit(r0, r1)
    step = SCENARIOS[name][3]
    assert r0["tried"][step] == [16]


def test_steps_interrupted_or_raising_on_every_rank_roll_back_and_redo_alike(runs):
    """A Ctrl-C inside every rank's backward, then a loss raising in every
    rank's forward: each step is rolled back (FSDP2's state reset), the
    script redoes it, and training ends as the uninterrupted run."""
    r0, r1 = runs["fsdp-interrupted"]
    assert r0["redone"] == r1["redone"] == 2
    assert_as_unsplit(r0, r1)


def test_an_oom_while_calm_stops_every_rank_at_once_naming_the_collective(runs):
    """Memory calm: the agreement is not armed (no vote per collective), so
    an out-of-memory error between FSDP2's collectives cannot be redone.
    The rank that ran out says so, naming the last collective, and tears
    the group down: the other fails in seconds, not at the group's
    timeout (60 s)."""
    r0, r1 = runs["fsdp-oom-calm"]
    assert r0["armed"] == r1["armed"] == [True, False]   # the first step: unknown, armed
    assert r1["error"].startswith("StrandedCollective: memguard: rank 1 ran out of memory")
    assert "reduce_scatter_single" in r1["error"] and "sync_collectives='always'" in r1["error"]
    assert r0["error"] is not None and r0["seconds"] < 30


def test_sync_collectives_takes_auto_or_always():
    import memguard

    with pytest.raises(ValueError, match="sync_collectives must be 'auto' or 'always', not 'on'"):
        memguard.Guard(sync_collectives="on")
