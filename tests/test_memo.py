"""Constant tensors kept between calls (:mod:`posenc._memo`): kept per arguments, usable in
any later call, never kept where the tensors built are not plain eager ones."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from posenc._memo import memo


def _counted():
    built = []

    @memo(maxsize=2)
    def ramp(n: int, device: torch.device) -> torch.Tensor:
        built.append(n)
        return torch.arange(n, device=device, dtype=torch.float32)

    return ramp, built


def test_kept_per_arguments_the_most_recent_first():
    ramp, built = _counted()
    cpu = torch.device("cpu")
    first = ramp(3, cpu)
    assert ramp(3, cpu) is first and built == [3]
    assert torch.equal(ramp(4, cpu), torch.arange(4.0)) and built == [3, 4]
    ramp(5, cpu)  # maxsize 2: 3 is dropped
    assert ramp(3, cpu) is not first and built == [3, 4, 5, 3]


def test_built_in_inference_mode_it_serves_autograd_later():
    ramp, _ = _counted()
    with torch.inference_mode():
        kept = ramp(3, torch.device("cpu"))
    assert not kept.is_inference() and not kept.requires_grad
    x = torch.ones(3, requires_grad=True)
    (x * ramp(3, torch.device("cpu"))).sum().backward()  # saved for backward: not an error
    assert torch.equal(x.grad, torch.arange(3.0))


@pytest.mark.parametrize("mode", ["fake", "meta device", "compiling", "torch.func"])
def test_not_kept_under_a_mode_or_torch_compile(monkeypatch, mode):
    """Fake tensors (a dispatch mode), a default device (a function mode), a ``torch.func``
    transform and tracing build tensors that must not serve a later eager call."""
    ramp, built = _counted()
    cpu = torch.device("cpu")
    if mode == "fake":
        with FakeTensorMode():
            ramp(3, cpu)
    elif mode == "meta device":
        with torch.device("meta"):
            ramp(3, cpu)
    elif mode == "torch.func":  # a functorch wrapper, with no storage, must not be kept
        torch.func.grad(lambda x: (x * ramp(3, cpu)).sum())(torch.ones(()))
    else:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        ramp(3, cpu)
        monkeypatch.undo()
    plain = ramp(3, cpu)
    assert built == [3, 3] and torch.equal(plain, torch.arange(3.0))
    assert plain.data_ptr()  # a plain tensor with its storage
    assert ramp(3, cpu) is plain
