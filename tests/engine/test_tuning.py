"""engine/tuning.py: the constants' state, which the kept routes' key holds."""

from __future__ import annotations

import importlib

from posenc.engine import tuning


def _values():
    return tuple(
        (name, value)
        for name, value in vars(tuning).items()
        if name.isupper() and not name.startswith("_")
    )


def test_the_state_is_every_constant_as_it_is(monkeypatch):
    before = tuning.state
    assert before == _values() and len(before) > 20
    monkeypatch.setattr(tuning, "KEPT_ROUTES", 3)
    assert tuning.state == _values() and tuning.state != before
    assert dict(tuning.state)["KEPT_ROUTES"] == 3
    tuning.GEMM_COLUMNS = 4  # a plain assignment too
    try:
        assert dict(tuning.state)["GEMM_COLUMNS"] == 4
    finally:
        tuning.GEMM_COLUMNS = dict(before)["GEMM_COLUMNS"]
    monkeypatch.undo()
    assert tuning.state == before  # the same values: the same key


def test_the_key_numbers_the_state(monkeypatch):
    """``key`` is an int per distinct state: equal states, equal keys; another state,
    another key, across a reload of the module too."""
    before, first = tuning.state, tuning.key
    assert isinstance(first, int)
    monkeypatch.setattr(tuning, "KEPT_ROUTES", tuning.KEPT_ROUTES + 1)
    changed = tuning.key
    assert changed != first
    monkeypatch.undo()
    assert tuning.state == before and tuning.key == first
    module = importlib.reload(tuning)
    assert module is tuning and tuning.state == before and tuning.key == first
    reloaded = tuning.key
    monkeypatch.setattr(tuning, "KEPT_ROUTES", tuning.KEPT_ROUTES + 1)
    assert tuning.key not in (first, reloaded)
    monkeypatch.undo()
    assert tuning.key == reloaded


def test_a_constant_added_or_deleted_changes_the_state(monkeypatch):
    before = tuning.state
    monkeypatch.setattr(tuning, "AN_EXPERIMENT", 7, raising=False)
    assert ("AN_EXPERIMENT", 7) in tuning.state
    monkeypatch.undo()
    assert not hasattr(tuning, "AN_EXPERIMENT") and tuning.state == before


def test_values_of_any_type_count_and_differ(monkeypatch):
    """A value of another type (a NumPy integer, a bool) is a value of the key too; one
    that cannot be hashed stands for itself alone, equal to no other state."""
    import numpy as np

    states = set()
    for value in (np.int64(0), np.int64(1 << 23), True, 1.5):
        monkeypatch.setattr(tuning, "MATERIALISED_SCORES", value)
        states.add(tuning.state)
        assert ("MATERIALISED_SCORES", value) in tuning.state
    assert len(states) == 4
    monkeypatch.setattr(tuning, "MATERIALISED_SCORES", [1, 2])
    first = tuning.state
    hash(first)
    monkeypatch.setattr(tuning, "MATERIALISED_SCORES", [1, 2])
    assert tuning.state != first


def test_a_reload_keeps_the_state_in_step():
    module = importlib.reload(tuning)
    assert module is tuning and tuning.state == _values()
    tuning.KEPT_ROUTES = tuning.KEPT_ROUTES
    assert tuning.state == _values()


def test_assignments_from_two_threads_leave_the_state_of_both(monkeypatch):
    """Thread A computes the state of its assignment and, before storing it, waits (at most
    0.3 s) for thread B's assignment to land: B must wait for A instead, or A would store
    a state without B's constant."""
    import threading

    monkeypatch.setattr(tuning, "GEMM_COLUMNS", tuning.GEMM_COLUMNS)
    monkeypatch.setattr(tuning, "CAUSAL_ROWS", tuning.CAUSAL_ROWS)
    real = tuning._state
    inside, landed = threading.Event(), threading.Event()

    def slow_state(names):
        state = real(names)
        if threading.current_thread().name == "A":
            inside.set()
            landed.wait(0.3)
        return state

    monkeypatch.setattr(tuning, "_state", slow_state)

    def second():
        inside.wait(5)
        tuning.CAUSAL_ROWS = 2
        landed.set()

    a = threading.Thread(target=setattr, args=(tuning, "GEMM_COLUMNS", 1), name="A")
    b = threading.Thread(target=second, name="B")
    a.start()
    b.start()
    a.join()
    b.join()
    assert (tuning.GEMM_COLUMNS, tuning.CAUSAL_ROWS) == (1, 2)
    assert tuning.state == _values()
