"""A guard's resumable state (Guard.state_dict / load_state_dict) with real
guards and real checkpointed blocks: it round-trips; every field is checked
before any is applied, so a bad one is refused by name and changes nothing;
a state of another version, or not a mapping, is skipped with a warning.
(A Lightning resume from such states: tests/test_lightning.py.)"""
from __future__ import annotations

import re
import warnings

import pytest
import torch

import memguard

FIELDS = ("micro_batch", "checkpointed_blocks", "steps", "ooms_recovered",
          "micro_batch_changes", "peak_bytes")


def make_guard(**kw) -> memguard.Guard:
    blocks = [torch.nn.Linear(4, 4) for _ in range(4)]
    return memguard.Guard(budget=None, allocator=False, checkpoint=blocks, **kw)


def saved() -> dict:
    """A state unlike a new guard's in every field."""
    return {"version": 1, "micro_batch": 6, "checkpointed_blocks": 2, "steps": 40,
            "ooms_recovered": 3, "micro_batch_changes": 5, "peak_bytes": 123 << 20}


def used_guard() -> memguard.Guard:
    """A guard with a state of its own, unlike saved()'s in every field."""
    g = make_guard()
    g.load_state_dict({"version": 1, "micro_batch": 12, "checkpointed_blocks": 1, "steps": 7,
                       "ooms_recovered": 1, "micro_batch_changes": 2, "peak_bytes": 9 << 20})
    return g


def test_a_state_round_trips_and_the_planner_resumes_at_its_size():
    g = make_guard()
    g.load_state_dict(saved())
    assert g.state_dict() == saved()
    assert g.micro_batch == 6 and g.checkpoints.n_on == 2
    x, y = torch.randn(24, 4), torch.randn(24, 1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    res = g.step((x, y), lambda b: torch.nn.functional.mse_loss(model(b[0]), b[1]), opt)
    assert res.micro_batch == 6 and g.steps == 41      # counts go on from the saved ones
    fresh = make_guard()
    fresh.load_state_dict(g.state_dict())
    assert fresh.state_dict() == g.state_dict()


def test_a_new_guards_state_loads_into_a_new_guard():
    """micro_batch 0 is what a guard with "auto" saves before its first
    step: none planned yet."""
    state = make_guard().state_dict()
    assert state["micro_batch"] == 0
    g = make_guard()
    g.load_state_dict(state)
    assert g.state_dict() == state


def test_more_checkpointed_blocks_than_there_are_checkpoints_all():
    g = make_guard()
    g.load_state_dict(dict(saved(), checkpointed_blocks=10))
    assert g.checkpoints.n_on == len(g.checkpoints) == 4


def test_the_largest_size_the_planner_takes_is_kept_exactly():
    g = make_guard()
    g.load_state_dict(dict(saved(), micro_batch=2**64 - 1, peak_bytes=2**64 - 1))
    assert g.micro_batch == 2**64 - 1 and g.peak_bytes == 2**64 - 1


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("value", [-5, -1, 2**64, 10**30, None, 1.5, 4.0, "4", True,
                                   torch.tensor(4)])
def test_a_bad_field_is_refused_by_name_and_changes_nothing(field, value):
    g = used_guard()
    before, plan = g.state_dict(), g.plan()
    with pytest.raises(ValueError, match=rf"{field} must be an integer from 0 to 2\*\*64-1, "
                                         rf"not {_escaped(value)}"):
        g.load_state_dict(dict(saved(), **{field: value}))
    assert g.state_dict() == before and g.plan() == plan and g.checkpoints.n_on == 1


@pytest.mark.parametrize("field", FIELDS)
def test_a_missing_field_is_refused_by_name_and_changes_nothing(field):
    g = used_guard()
    before = g.state_dict()
    state = saved()
    del state[field]
    with pytest.raises(ValueError, match=f"field '{field}' is missing"):
        g.load_state_dict(state)
    assert g.state_dict() == before


def test_an_unknown_field_is_refused_by_name_and_changes_nothing():
    g = used_guard()
    before = g.state_dict()
    with pytest.raises(ValueError, match="unknown field.*'micro_batch_size'"):
        g.load_state_dict(dict(saved(), micro_batch_size=4))
    assert g.state_dict() == before


@pytest.mark.parametrize(("state", "named"), [
    (dict(saved(), version=99), "version 99"),
    (dict(saved(), version=0), "version 0"),
    (dict(saved(), version=2), "version 2"),
    (dict(saved(), version="1"), "version '1'"),
    (dict(saved(), version=True), "version True"),
    (dict(saved(), version=None), "version None"),
    ({k: v for k, v in saved().items() if k != "version"}, "no version"),
    ({"optimizer": {}, "lr": 0.1}, "no version"),
    ([6, 2, 40], "a list, not a mapping"),
    (None, "a NoneType, not a mapping"),
    ("micro_batch=6", "a str, not a mapping"),
])
def test_a_state_of_another_version_is_skipped_with_a_warning(state, named):
    g = used_guard()
    before = g.state_dict()
    with pytest.warns(UserWarning, match=f"not loaded: it (is|has) {named}.*reads version 1"):
        g.load_state_dict(state)
    assert g.state_dict() == before


def test_a_good_state_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_guard().load_state_dict(saved())


def test_the_state_names_every_field_it_saves():
    assert tuple(make_guard().state_dict()) == ("version", *FIELDS)


def _escaped(value) -> str:
    return re.escape(repr(value))
