"""Guard.step under DDP: two ranks started by ``torchrun`` on gloo (CPU).

Each run trains the same model on every rank's half of each global batch
(tests/ddp_worker.py) and compares the parameters with single-process
training on the whole global batch. Out-of-memory errors are real: one
rank lowers its arena budget below a full-size step (before the step, or
inside its forward or backward pass), and the arena's count of refusals
says the error was its. Every run is bounded
by a timeout, so a rank waiting in a collective that another will never
join fails the test instead of hanging it.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from tests.conftest import ROOT, run_bounded
from tests.ddp_worker import H, T

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

TIMEOUT_S = 240   # generous for a loaded machine; a deadlock would last forever


def torchrun(tmp_path, *args: str, ranks: int = 2, records: bool = True) -> tuple[dict, ...]:
    """Run the worker on ``ranks`` ranks; their records (where ``records``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={ranks}", str(ROOT / "tests" / "ddp_worker.py"),
           "--out", str(tmp_path), *args]
    path = [str(ROOT / "python"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p),
               OMP_NUM_THREADS="1")
    run_bounded(cmd, env, TIMEOUT_S, "torchrun")
    if not records:
        return ()
    return tuple(torch.load(tmp_path / f"rank{r}.pt") for r in range(ranks))


def _mode(overlap: bool) -> list[str]:
    return ["--overlap"] if overlap else []


#: the two-rank runs, made one after the other in one torchrun launch (a
#: launch costs more than a run): name -> args. Those with an out-of-memory
#: error come last; the rank that runs out installs memguard's allocator for
#: its run and uninstalls it after, so that every run starts without it
SHARED = {
    **{f"plain-{o}": ["--micro-batch", "4", *_mode(o == "overlap")]
       for o in ("deferred", "overlap")},
    **{f"caller-{o}-{m}": ["--micro-batch", m, "--caller-weights", *_mode(o == "overlap")]
       for o in ("deferred", "overlap") for m in ("4", "16")},
    **{f"weightless-{o}-{m}": ["--micro-batch", m, "--caller-weights", "--weightless-rank",
                               "1", "--weightless-at", "2", *_mode(o == "overlap")]
       for o in ("deferred", "overlap") for m in ("4", "16")},
    **{f"skip-{o}-{m}": ["--micro-batch", m, "--skip-rank", "1", "--skip-at", "2",
                         *_mode(o == "overlap")]
       for o in ("deferred", "overlap") for m in ("4", "16")},
    "oom-rank1-step0": ["--oom-rank", "1", "--oom-at", "0"],
    "oom-forward": ["--overlap", "--teacher", "--oom-rank", "1", "--oom-at", "2"],
    "oom-minimum": ["--oom-rank", "0", "--tiny-budget", "--oom-at", "1"],
    "oom-backward": ["--micro-batch", "8", "--oom-rank", "0", "--oom-in-backward", "1"],
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict[str, tuple[dict, ...]]:
    """Every run of :data:`SHARED`, in one launch: name -> the ranks'
    records."""
    root = tmp_path_factory.mktemp("ddp")
    argvs = []
    for name, args in SHARED.items():
        (root / name).mkdir()
        argvs.append(["--out", str(root / name), *args])
    (root / "scenarios.json").write_text(json.dumps(argvs))
    torchrun(root, "--scenarios", str(root / "scenarios.json"), records=False)
    return {name: tuple(torch.load(root / name / f"rank{r}.pt") for r in range(2))
            for name in SHARED}


def _name(what: str, overlap: bool, micro: str | None = None) -> str:
    return "-".join([what, "overlap" if overlap else "deferred", *([micro] if micro else [])])


def assert_trained_alike(r0: dict, r1: dict) -> None:
    """Both ranks hold the same parameters, those of single-process
    training at the same effective batch (up to summation order)."""
    for k, ref in r0["reference"].items():
        assert torch.equal(r0["state"][k], r1["state"][k]), k
        torch.testing.assert_close(r0["state"][k], ref, rtol=1e-5, atol=1e-6, msg=k)
    assert r0["micro"] == r1["micro"]
    assert r0["tried"] == r1["tried"]


@pytest.mark.parametrize("overlap", [False, True], ids=["deferred", "overlap"])
def test_micro_batched_ddp_matches_single_process(shared, overlap):
    r0, r1 = shared[_name("plain", overlap)]
    assert_trained_alike(r0, r1)
    assert r0["micro"] == [4] * 5 and r0["retries"] == [0] * 5
    # per step: the plan, the OOM flag, and (deferred) one bucket of gradients
    # (DDP's own all-reduces in the overlap mode are not counted)
    assert r0["collectives"] == r1["collectives"] == (2 if overlap else 3) * 5


@pytest.mark.parametrize("micro", ["4", "16"], ids=["4-micro-batches", "one-micro-batch"])
@pytest.mark.parametrize("overlap", [False, True], ids=["deferred", "overlap"])
def test_caller_weights_under_ddp(shared, overlap, micro):
    """A masked loss weighted by its count: each rank's weighted mean,
    averaged over the ranks, in both modes; with DDP synchronising the last
    backward (overlap) the gradients accumulated before it are divided by
    the rank's total weight first, also when that backward is the only one."""
    r0, r1 = shared[_name("caller", overlap, micro)]
    assert_trained_alike(r0, r1)
    assert r0["micro"] == [int(micro)] * 5


@pytest.mark.parametrize("micro", ["4", "16"], ids=["4-micro-batches", "one-micro-batch"])
@pytest.mark.parametrize("overlap", [False, True], ids=["deferred", "overlap"])
def test_weights_summing_to_zero_on_one_rank_stop_the_step_on_both(shared, overlap, micro):
    """Rank 1's caller weights sum to 0 at step 2: it has no weighted mean,
    so the step cannot be done; both ranks raise ValueError (rank 0 naming
    the other rank) instead of one waiting for the other, and the next
    steps train alike on both."""
    r0, r1 = shared[_name("weightless", overlap, micro)]
    assert [s for s, _ in r0["errors"]] == [s for s, _ in r1["errors"]] == [2]
    assert "another rank" in r0["errors"][0][1]
    assert "positive weight" in r1["errors"][0][1]
    assert len(r0["micro"]) == len(r1["micro"]) == 4
    for k, v in r0["state"].items():
        assert torch.equal(v, r1["state"][k]), k


@pytest.mark.parametrize("micro", ["4", "16"], ids=["4-micro-batches", "one-micro-batch"])
@pytest.mark.parametrize("overlap", [False, True], ids=["deferred", "overlap"])
def test_a_batch_skipped_on_one_rank_is_skipped_on_both(shared, overlap, micro):
    """Rank 1's loss_fn skips step 2's batch in its last micro-batch (a
    Lightning training_step returning None): both ranks roll the step back
    and skip it, rank 0 naming the other rank, instead of one waiting for
    the other; the other steps train alike on both."""
    r0, r1 = shared[_name("skip", overlap, micro)]
    assert [s for s, _ in r0["skipped"]] == [s for s, _ in r1["skipped"]] == [2]
    assert "another rank" in r0["skipped"][0][1]
    assert "this rank skips" in r1["skipped"][0][1]
    assert len(r0["micro"]) == len(r1["micro"]) == 4
    for k, v in r0["state"].items():
        assert torch.equal(v, r1["state"][k]), k


def test_oom_on_one_rank_redoes_the_step_on_both(shared):
    """Rank 1 runs out of memory in the first step's backward at the full
    size; both ranks redo it at half the size and keep that size."""
    r0, r1 = shared["oom-rank1-step0"]
    assert_trained_alike(r0, r1)
    assert r0["micro"] == [8] * 5
    assert r0["tried"][0] == [16] and r0["retries"] == [1, 0, 0, 0, 0]
    assert r1["reasons"][0] == "oom" and r0["reasons"][0] == "peer"
    assert r0["ooms_recovered"] == r1["ooms_recovered"] == 1
    assert r1["arena_refusals"] >= 1 and r0["arena_refusals"] == 0


def test_oom_in_forward_with_ddp_synchronising(shared):
    """DDP synchronises the last backward itself (overlap); rank 1 runs out
    of memory in a teacher's no-grad forward at step 2, after DDP's reducer
    has run. The flag is agreed before the synchronising backward, the
    reducer is reset on both ranks, and training goes on at half the size."""
    r0, r1 = shared["oom-forward"]
    assert_trained_alike(r0, r1)
    assert r0["micro"] == [16, 16, 8, 8, 8]
    assert r0["tried"][2] == [16] and r0["reasons"][2] == "peer"
    assert r1["arena_refusals"] >= 1 and r0["arena_refusals"] == 0


def test_oom_at_the_minimum_stops_every_rank(shared):
    """Nothing fits on rank 0: both ranks raise GuardOOMError naming the same
    sizes, keep the same parameters, and neither hangs. Rank 0's planner
    knows from its model that not even one sample fits a 4 KiB room: the
    retry goes straight to the smallest size, not through every half."""
    r0, r1 = shared["oom-minimum"]
    assert r0["gave_up"] == r1["gave_up"] == [16, 1]
    assert r0["micro"] == r1["micro"] == [16]
    assert r0["arena_refusals"] >= 2 and r1["arena_refusals"] == 0   # one per size tried
    for k, v in r0["state"].items():
        assert torch.equal(v, r1["state"][k]), k


@pytest.mark.parametrize("ranks", [1, 2])
def test_oom_inside_backward_of_a_ddp_model(tmp_path, request, ranks):
    """An out-of-memory error inside the backward of a DDP model (the last
    micro-batch's, where DDP's reducer synchronises), at world size 1 as at
    2: the arena refuses GELU's gradient once the output layer's gradients
    are made. A model wrapped in DDP runs its micro-batches as the deferred
    mode does whatever the world size, so the redo starts from a clean
    reducer, and the run ends with the uninterrupted run's parameters."""
    recs = request.getfixturevalue("shared")["oom-backward"] if ranks == 2 else \
        torchrun(tmp_path, *SHARED["oom-backward"], ranks=ranks)
    r0 = recs[0]
    for k, ref in r0["reference"].items():
        torch.testing.assert_close(r0["state"][k], ref, rtol=1e-5, atol=1e-6, msg=k)
    assert r0["retries"] == [0, 1, 0, 0, 0] and r0["tried"][1] == [8]
    assert all(torch.equal(r["state"][k], r0["state"][k]) for r in recs for k in r0["state"])
    # the arena refused once: GELU's gradient, 8 samples of T tokens by H, fp32
    assert r0["arena_refusals"] == 1 and r0["last_refused_bytes"] == 8 * T * H * 4
    assert all(r["arena_refusals"] == 0 for r in recs[1:])


def test_a_vote_allocates_nothing(gloo_group, arena):
    """The ranks' vote after an out-of-memory error runs under the budget
    that error exhausted: it goes through tensors made in advance and
    allocates nothing from memguard's arena (one run saw a raw
    RuntimeError escape from the vote's own 1.2 KiB)."""
    from memguard.memory import arena as allocator
    from memguard.train.distributed import Peers

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    peers = Peers.detect(model)
    assert peers is not None
    before = allocator.stats()["num_allocs"]
    vote = peers.vote(Peers.OOM, 8, [1, 0], deferred=True)
    assert peers.agree([5]) == [5]
    assert allocator.stats()["num_allocs"] == before
    assert vote.outcome == "oom" and vote.next == 8 and vote.used_anywhere == [True, False]
