"""engine/tuning.py: the constants' state, which the kept routes' key holds."""

from __future__ import annotations

import importlib

import pytest

from posenc.engine import tuning


def _values():
    return tuple(
        (name, value)
        for name, value in vars(tuning).items()
        if name.isupper() and type(value) in (int, float)
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


def test_a_constant_added_or_deleted_changes_the_state(monkeypatch):
    before = tuning.state
    monkeypatch.setattr(tuning, "AN_EXPERIMENT", 7, raising=False)
    assert ("AN_EXPERIMENT", 7) in tuning.state
    monkeypatch.undo()
    assert not hasattr(tuning, "AN_EXPERIMENT") and tuning.state == before


@pytest.mark.parametrize("kind", ["str", "float"])
def test_only_numbers_count(monkeypatch, kind):
    value = "x" if kind == "str" else 1.5
    monkeypatch.setattr(tuning, "A_SETTING", value, raising=False)
    assert (("A_SETTING", value) in tuning.state) == (kind != "str")


def test_a_reload_keeps_the_state_in_step():
    module = importlib.reload(tuning)
    assert module is tuning and tuning.state == _values()
    tuning.KEPT_ROUTES = tuning.KEPT_ROUTES
    assert tuning.state == _values()
