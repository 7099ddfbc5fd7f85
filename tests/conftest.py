"""Fixtures shared by the test modules, and the ``numerical`` marker."""

from __future__ import annotations

import dis
import types
from pathlib import Path

import pytest
import torch.nn.functional as F

from posenc.engine import kept


@pytest.fixture(autouse=True)
def no_kept_routes():
    """Each test starts with no route kept (engine/kept.py): a test that spies on or
    replaces the engine's functions sees its own calls walk the paths."""
    kept.clear()
    yield
    kept.clear()


@pytest.fixture
def sdpa_masks(monkeypatch):
    """``(masks, sdpa)``: every call of ``F.scaled_dot_product_attention`` (posenc's and the
    bench's floor, which both reach it through ``torch.nn.functional``) appends its
    ``attn_mask`` to ``masks``; ``sdpa`` is the function itself, for references."""
    masks = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F,
        "scaled_dot_product_attention",
        lambda *a, **kw: masks.append(kw.get("attn_mask")) or sdpa(*a, **kw),
    )
    return masks, sdpa


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "numerical: compares floats with tests/tolerances.py (set by tests/conftest.py); "
        "`make test` runs these again under ATEN_CPU_CAPABILITY=avx2 and default",
    )


TESTS = str(Path(__file__).parent)


def _uses_tolerances(code: types.CodeType, namespace: dict, seen: set) -> bool:
    """Whether ``code`` (a test, its nested functions, the module's helpers it calls, and
    theirs) refers to something from tests/tolerances.py."""
    if code in seen:
        return False
    seen.add(code)
    for instruction in dis.get_instructions(code):
        if instruction.opname != "LOAD_GLOBAL":
            continue
        value = namespace.get(instruction.argval)
        if "tolerances" in (getattr(value, "__module__", None), getattr(value, "__name__", None)):
            return True
        inner = getattr(value, "__code__", None)
        where = getattr(value, "__globals__", None)
        # a helper of the module, or of a helper module of the tests (tests/engine/...)
        ours = where is namespace or str((where or {}).get("__file__", "")).startswith(TESTS)
        if inner is not None and ours and _uses_tolerances(inner, where, seen):
            return True
    return any(
        _uses_tolerances(const, namespace, seen)
        for const in code.co_consts
        if isinstance(const, types.CodeType)
    )


def pytest_collection_modifyitems(config, items):
    """``numerical`` on every test that compares with tests/tolerances.py (directly or
    through a helper of its module): the tests whose results depend on the CPU's kernels,
    run again under other kernel sets by `make test`."""
    for item in items:
        function = getattr(item, "function", None)
        # a hypothesis test: the function that @given wraps
        function = getattr(getattr(function, "hypothesis", None), "inner_test", function)
        code = getattr(function, "__code__", None)
        if code is not None and _uses_tolerances(code, function.__globals__, set()):
            item.add_marker(pytest.mark.numerical)
