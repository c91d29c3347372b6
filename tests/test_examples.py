"""The training-loop examples in examples/, each run in its short
configuration (``--quick``) as a user would run it, and held to its
invariants: the effective batch never changes, no step is lost, the peak
stays under the budget, and each script's own (queue alignment, once-per-
step updates). Every example writes its summary with ``--summary-json``.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytest.importorskip("torch")

EXAMPLES = ROOT / "examples"


def run_example(name: str, tmp_path, *args: str, timeout: float = 300) -> dict:
    """Run examples/<name>.py --quick and return its summary."""
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    proc = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--quick",
                           "--summary-json", str(out), *args],
                          check=False, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    print(proc.stdout[-2000:])
    return summary


def check_common(s: dict) -> None:
    """What every example promises."""
    assert s["steps_done"] == s["steps"], "a step was lost"
    assert s["steps"] > 0
    assert len(set(s["effective_batches"])) == 1, "the effective batch changed"
    assert s["peak_bytes"] <= s["budget_bytes"], "the peak passed the budget"
    assert s["throttled"], "the budget was not tight enough for the throttle to act"


# -- dino_multicrop ------------------------------------------------------------
def check_tensor_room(s: dict) -> None:
    """The tensors stayed inside the arena's share of the process budget."""
    if s["peak_source"] == "arena":
        assert 0 < s["tensor_budget_bytes"] < s["budget_bytes"]
        assert s["peak_bytes"] <= s["tensor_budget_bytes"], "the tensors passed the arena's room"


def test_dino_multicrop(tmp_path):
    """The centre and the EMA teacher move once per optimizer step, with the
    teacher outputs of the whole batch however it was split."""
    s = run_example("dino_multicrop", tmp_path)
    check_common(s)
    check_tensor_room(s)
    assert s["effective_batches"] == [32] * s["steps"]   # every image's teacher outputs
    assert s["center_updates"] == s["ema_updates"] == s["steps_done"]
    assert s["ooms_recovered"] >= 1                      # the whole batch does not fit
    assert all(4 <= m < 32 for m in s["micro_batches"])  # min_micro_batch .. split
    assert s["error"] is None


# -- moco_queue ----------------------------------------------------------------
def test_moco_queue_v2(tmp_path):
    """Keys enqueued once per step, a whole batch at a time: the pointer
    advances by the effective batch and always sits on a multiple of it."""
    s = run_example("moco_queue", tmp_path)
    check_common(s)
    check_tensor_room(s)
    b, size = s["effective_batch"], s["queue_size"]
    assert s["effective_batches"] == [b] * s["steps"]
    assert size % b == 0
    assert all(p % b == 0 for p in s["queue_ptrs"])
    assert s["queue_ptrs"] == [(i + 1) * b % size for i in range(s["steps_done"])]
    assert s["enqueued"] == s["steps_done"] * b
    assert s["momentum_updates"] == s["steps_done"]
    assert s["ooms_recovered"] >= 1                        # the whole batch does not fit
    assert all(b % m == 0 and m < b for m in s["micro_batches"])   # divisor_of=batch


def test_moco_queue_v3_gradcache(tmp_path):
    """In-batch negatives through embed_fn= (GradCache): the loss sees the whole
    batch's embeddings, the momentum encoder moves once per step."""
    s = run_example("moco_queue", tmp_path, "--variant", "v3")
    check_common(s)
    check_tensor_room(s)
    assert s["variant"] == "v3"
    assert s["effective_batches"] == [64] * s["steps"]
    assert s["momentum_updates"] == s["steps_done"]
    assert s["ooms_recovered"] >= 1
    assert s["queue_size"] is None and s["queue_ptrs"] == []


def test_moco_queue_find_batch(tmp_path):
    """--find-batch (seed story 002): the batch is the largest whose step
    fits the tensor budget, the queue of 65536 moves to the multiple of it
    nearest, and a step at both runs whole inside the budget. (A small model
    and one step: the probes are the test.)"""
    s = run_example("moco_queue", tmp_path, "--find-batch", "--steps", "1", "--batch", "16",
                    "--queue-size", "65536", "--dim", "16", "--width", "4", "--image-size", "10",
                    "--crop-size", "8", "--tensor-budget", "24MiB")
    b, q = s["effective_batch"], s["queue_size"]
    assert s["found"]["size"] == b > 16 and s["found"]["queue_size"] == q
    assert q % b == 0 and abs(q - 65536) <= b / 2
    assert s["steps_done"] == 1 and s["queue_ptrs"] == [b] and s["micro_batches"] == [b]
    assert s["peak_bytes"] <= s["tensor_budget_bytes"]


def test_moco_queue_rejects_misaligned_queue(tmp_path):
    """A queue size the batch does not divide is refused before training."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / "moco_queue.py"), "--quick",
                           "--queue-size", "1000"], check=False, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "python")))
    assert proc.returncode == 2
    assert "multiple of --batch" in proc.stderr


# -- dinov3_lora_cpu -----------------------------------------------------------
# One torch thread: where the tests share two cores with other work, two
# OpenMP threads spend most of a step waiting for each other.
ONE_THREAD = ("--threads", "1")


def test_dinov3_lora_cpu(tmp_path):
    """A training epoch through DataLoader workers: only the adapters and the
    head train, the effective batch stays whole. Then the validation loop,
    while another program takes the room the run had: every prediction
    gathered as a plain value, and inference's micro-batch smaller once
    the room fell, each batch's peak within the room it had."""
    # 8 steps; 4 validation batches, the last 2 after the other program grew
    s = run_example("dinov3_lora_cpu", tmp_path, "--steps", "8", "--val-size", "512",
                    *ONE_THREAD)
    check_common(s)
    assert s["effective_batches"] == [32] * s["steps"]
    assert s["ooms_recovered"] >= 1                       # the whole batch does not fit
    assert all(4 <= m < 32 for m in s["micro_batches"])   # min_micro_batch .. split
    names = s["trainable_names"]
    assert names and all(".lora_" in n or ".head.modules_to_save." in n for n in names)
    assert any(".lora_" in n for n in names) and any(".head." in n for n in names)
    assert not any("patch_embed" in n for n in names)    # LoRA on the blocks only
    assert 0 < s["trainable_params"] < s["total_params"] / 5
    assert s["workers"] == 2
    # predictions: numpy values, a float32 each, no graph
    assert s["val_predictions"] == s["val_size"] and s["val_prediction_type"] == "ndarray"
    assert s["val_held_bytes"] == 4 * s["val_size"]
    rows = s["val_batches"]
    assert len(rows) == s["val_size"] // s["val_batch"] == 4
    first, after = rows[0], rows[2:]
    assert first["hog_bytes"] == 0 and s["hog_bytes"] > 0
    assert all(r["hog_bytes"] == s["hog_bytes"] for r in after)
    assert all(r["tensor_room_bytes"] < first["tensor_room_bytes"] for r in after), \
        "the other program's memory did not take the run's room"
    assert all(r["micro"] < first["micro"] for r in after), "inference did not shrink"
    assert all(r["peak_bytes"] <= r["tensor_room_bytes"] for r in rows)
    assert max(r["peak_bytes"] for r in rows) < s["peak_bytes"]   # no graph: less than training
    assert s["val_mse"] < s["val_target_var"]                      # and it learnt
    assert s["peak_bytes"] <= s["tensor_budget_bytes"] < s["budget_bytes"]


# -- dual_cross_attention ------------------------------------------------------
def _check_pairs(s: dict) -> None:
    """Pairs stay whole: every micro-batch even (multiple_of=2), none cut a
    pair, and each step's gradients come from the whole batch of 16."""
    assert s["effective_batches"] == [16] * s["steps"]
    assert all(m % 2 == 0 and 2 <= m <= 16 for m in s["micro_batches"])
    assert s["micro_batches_even"] and s["broken_pairs"] == 0
    assert len(s["checkpointed_blocks"]) == s["steps_done"]
    assert s["peak_bytes"] <= s["tensor_budget_bytes"] < s["budget_bytes"]


def test_dual_cross_attention(tmp_path):
    """The whole batch of pairs does not fit: the step is redone in even
    micro-batches, and the effective batch stays 16."""
    s = run_example("dual_cross_attention", tmp_path, "--steps", "6", *ONE_THREAD)
    check_common(s)
    _check_pairs(s)
    assert s["ooms_recovered"] >= 1
    assert s["micro_batches"][0] < 16


def test_dual_cross_attention_checkpoint_switch(tmp_path):
    """With every block checkpointed the whole batch fits; once calm,
    memguard switches checkpointing off a quarter of the blocks at a time."""
    # the first quarter goes off after grow_after (8) calm steps: 10 leave two to spare
    s = run_example("dual_cross_attention", tmp_path, "--checkpoint-blocks", "4", "--steps", "10",
                    *ONE_THREAD)
    _check_pairs(s)
    assert s["steps_done"] == s["steps"]
    ck = s["checkpointed_blocks"]
    assert ck[0] == s["blocks"] == 4
    assert all(b <= a for a, b in zip(ck, ck[1:])), "checkpointing came back while calm"
    assert ck[-1] < 4, "checkpointing was never switched off"
    assert s["micro_batches"][0] == 16


# -- dreams_lightning ----------------------------------------------------------
def test_dreams_lightning(tmp_path):
    pytest.importorskip("lightning")
    s = run_example("dreams_lightning", tmp_path)
    check_common(s)
    assert s["effective_batches"] == [32] * s["steps"]
    assert all(m > 0 for m in s["masked_peaks"])      # the loss's weights
    assert min(s["micro_batches"]) >= 4               # min_micro_batch
    # validated before fit and after it, on the guard's inference plan
    assert 0 < s["val_loss"] < s["val_loss_before"] and s["val_micro_batch"] >= 4


def test_dreams_lightning_ddp_two_processes(tmp_path):
    """strategy="ddp" on 2 CPU processes (gloo): every rank runs the same
    micro-batch plan and ends with the same parameters. Lightning's launcher
    starts rank 1 as rank 0's child, yet rank 0's samples (its callback's
    memguard/workers metrics, logged at every step) count no child process
    and no child's bytes: rank 1 is no worker of rank 0, and the example's
    DataLoaders have none."""
    pytest.importorskip("lightning")
    s0 = run_example("dreams_lightning", tmp_path, "--devices", "2")
    s1 = json.loads((tmp_path / "dreams_lightning.json.rank1").read_text())
    assert s0["world_size"] == s1["world_size"] == 2
    check_common(s0)
    check_common(s1)
    assert s0["micro_batches"] == s1["micro_batches"]
    assert s0["param_checksum"] == s1["param_checksum"]
    assert s0["val_loss"] == s1["val_loss"] > 0       # synchronised across the ranks
    with open(tmp_path / "out" / "dreams" / "version_0" / "metrics.csv") as f:
        steps = [r for r in csv.DictReader(f) if r["memguard/workers"]]
    assert len(steps) == s0["steps"]
    assert {(r["memguard/workers"], r["memguard/workers_mib"]) for r in steps} == {("0.0", "0.0")}
