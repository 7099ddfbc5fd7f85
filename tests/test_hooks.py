"""The hook protocol (posenc/hooks.py): which hooks a scheme defines, and their checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from posenc.engine import Mask, attend
from posenc.hooks import HOOK_NAMES, hooks_of


def run(backend, scheme, q, k, v, q_pos, k_pos, mask):
    out, _ = attend(q, k, v, scheme=scheme, q_pos=q_pos, k_pos=k_pos, mask=mask, backend=backend)
    return out


def test_a_subclass_overriding_a_hook_drops_the_parents_fast_forms():
    """A steeper ALiBi (score_bias overridden) must not run on ALiBi's offset_bias."""
    from posenc import ALiBi, RelativeQueryEmbedding

    class SteeperALiBi(ALiBi):
        def score_bias(self, q_pos, k_pos):
            return 1.1 * super().score_bias(q_pos, k_pos)

    class SteeperSlopes(ALiBi):  # the natural way: no hook overridden, fast forms kept
        def slopes(self, device=None):
            return 1.1 * super().slopes(device)

    class Both(ALiBi):  # a hook and its fast form redefined in one class: kept
        def score_bias(self, q_pos, k_pos):
            return super().score_bias(q_pos, k_pos)

        def offset_bias(self, q_pos, k_pos):
            return super().offset_bias(q_pos, k_pos)

    class Doubled(RelativeQueryEmbedding):
        def score_term(self, q, q_pos, k_pos):
            return 2 * super().score_term(q, q_pos, k_pos)

    assert hooks_of(SteeperALiBi(4)).offset_bias is None
    assert hooks_of(SteeperALiBi(4)).flex_score_mod is None
    assert hooks_of(SteeperSlopes(4)).offset_bias is not None
    assert hooks_of(Both(4)).offset_bias is not None
    assert hooks_of(ALiBi(4)).offset_bias is not None
    assert hooks_of(Doubled(16, 8)).offset_term is None
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 16, 8, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(16)[None]
    for scheme in (SteeperALiBi(4), SteeperSlopes(4), Doubled(16, 8).double()):
        expected = run("math", scheme, q, k, v, pos, pos, Mask(16, 16))
        torch.testing.assert_close(run("auto", scheme, q, k, v, pos, pos, Mask(16, 16)), expected)


def test_every_hook_has_a_protocol_that_the_schemes_satisfy():
    """One Protocol per hook (runtime-checkable), and each scheme of the package satisfies
    the protocols of the hooks it defines."""
    import posenc
    from posenc import hooks

    for name in HOOK_NAMES:
        assert isinstance(getattr(hooks, name.title().replace("_", "")), type)
    examples = {
        hooks.Rotate: posenc.Rotary(8),
        hooks.ScoreBias: posenc.ALiBi(2),
        hooks.ScoreTerm: posenc.RelativeQueryEmbedding(8, 8),
        hooks.ValueTerm: posenc.ShawRelativePosition(8, 2),
        hooks.OffsetBias: posenc.T5RelativeBias(2),
    }
    for protocol, scheme in examples.items():
        assert isinstance(scheme, protocol), (protocol, scheme)
    assert not isinstance(posenc.ALiBi(2), hooks.ScoreTerm)


def test_checked_hooks_pass_declining_extras_and_reject_wrong_shapes():
    from posenc.hooks import checked_hooks

    class Declines(nn.Module):
        def score_bias(self, q_pos, k_pos):
            return torch.zeros(1, 1, q_pos.shape[-1], k_pos.shape[-1])

        def offset_bias(self, q_pos, k_pos):
            return None  # positions not one run: the engine falls back

    scheme = Declines()
    hooks = checked_hooks(hooks_of(scheme), scheme, 2, 4, 8)
    pos = torch.arange(3)[None]
    assert hooks.offset_bias(pos, pos) is None
    assert hooks.score_bias(pos, pos).shape == (1, 1, 3, 3)

    class ThreeHeads(nn.Module):
        def score_bias(self, q_pos, k_pos):
            return torch.zeros(1, 3, q_pos.shape[-1], k_pos.shape[-1])

    wrong = checked_hooks(hooks_of(ThreeHeads()), ThreeHeads(), 2, 4, 8)
    with pytest.raises(ValueError, match=r"score_bias hook returned shape \(1, 3, 3, 3\)"):
        wrong.score_bias(pos, pos)
