"""State: what is saved, copied, pickled and loaded, for every scheme and input encoding.

- ``state_dict`` holds the learned tables only, under the names and shapes of DESIGN.md's
  public API (derived tables, e.g. Swin's index, are non-persistent buffers);
- ``copy.deepcopy``, ``pickle`` and ``torch.save`` / ``torch.load(weights_only=True)`` of
  the state dict round-trip to identical outputs;
- a checkpoint written by hand here in the documented layout (as an earlier posenc
  version saved it) loads with ``strict=True``, and the outputs are those of a float64
  attention computed here from that checkpoint's tensors, the table read directly;
- construction on the meta device, then ``to_empty`` and re-initialisation, or
  ``to_empty`` / ``assign=True`` and loading a checkpoint, gives working derived tables
  (the rotary scalings and the input encodings included).

Distributed training (DDP, FSDP2) is in tests/test_distributed.py.
"""

from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch

from posenc import (
    AbsoluteQueryEmbedding,
    ALiBi,
    DynamicNTKScaling,
    KerpleBias,
    LearnedEncoding,
    LinearScaling,
    MultiHeadAttention,
    NTKScaling,
    RelativePositionBias,
    RelativeQueryEmbedding,
    RelativeQueryEmbedding2D,
    Rotary,
    ShawRelativePosition,
    SinusoidalEncoding,
    SinusoidalEncoding2D,
    T5RelativeBias,
    YaRNScaling,
)
from schemes import SCHEMES
from tolerances import assert_close, forward

HEADS, HEAD_DIM = 2, 4
DIM = HEADS * HEAD_DIM
GRID = (2, 2)
N = GRID[0] * GRID[1]
PROJECTIONS = {
    f"{name}.{part}": (DIM, DIM) if part == "weight" else (DIM,)
    for name in ("q_proj", "k_proj", "v_proj", "out_proj")
    for part in ("weight", "bias")
}

#: the learned tables of each scheme of tests/schemes.py built for (HEADS, HEAD_DIM, N, GRID),
#: with the names and shapes of DESIGN.md's public API
TABLES: dict[str, dict[str, tuple[int, ...]]] = {
    "rotary": {},
    "rotary-interleaved": {},
    "rotary-partial": {},
    "rotary-ntk": {},
    "xpos": {},
    "alibi": {},
    "alibi-learned": {"log_slopes": (HEADS,)},
    "kerple-log": {"r1": (HEADS,), "r2": (HEADS,)},
    "kerple-power": {"r1": (HEADS,), "r2": (HEADS,)},
    "sandwich": {},
    "fire": {  # FIREBias(HEADS): hidden=32; c and L_multiplier are scalars
        "mlp.0.weight": (32, 1),
        "mlp.0.bias": (32,),
        "mlp.2.weight": (HEADS, 32),
        "mlp.2.bias": (HEADS,),
        "c": (),
        "L_multiplier": (),
    },
    "rotary-2d": {},
    "rotary-mixed": {"freqs": (2, HEADS, HEAD_DIM // 2)},
    "rotary-nd": {},
    "t5": {"embedding.weight": (8, HEADS)},  # num_buckets=8
    "t5-decoder": {"embedding.weight": (8, HEADS)},
    "swin-1d": {"table": (2 * N - 1, HEADS)},
    "swin-2d": {"table": ((2 * GRID[0] - 1) * (2 * GRID[1] - 1), HEADS)},
    "swin-v2-cpb": {  # Swin V2's cpb_mlp: Linear(2, 512), ReLU, Linear(512, heads, bias=False)
        "cpb_mlp.0.weight": (512, 2),
        "cpb_mlp.0.bias": (512,),
        "cpb_mlp.2.weight": (HEADS, 512),
    },
    "relative": {"weight": (2 * N - 1, HEAD_DIM)},
    "relative-per-head": {"weight": (HEADS, 2 * N - 1, HEAD_DIM)},
    "relative-2d": {
        "height": (2 * GRID[0] - 1, HEAD_DIM),
        "width": (2 * GRID[1] - 1, HEAD_DIM),
    },
    "absolute-query": {"weight": (N, HEAD_DIM)},
    "cope": {"weight": (HEAD_DIM, N + 1)},  # max_position = max_len + 1
    "shaw": {"keys": (7, HEAD_DIM), "values": (7, HEAD_DIM)},  # max_distance=3
    "shaw-keys-only": {"keys": (7, HEAD_DIM)},
}

ENCODINGS = {
    "sinusoidal": (lambda: SinusoidalEncoding(DIM), (2, N, DIM), {}),
    "learned": (lambda: LearnedEncoding(DIM, 6), (2, N, DIM), {"weight": (6, DIM)}),
    "sinusoidal-2d": (lambda: SinusoidalEncoding2D(DIM), (2, *GRID, DIM), {}),
}

SCALINGS = {
    "linear": lambda: LinearScaling(2.0),
    "ntk": lambda: NTKScaling(2.0),
    "dynamic-ntk": lambda: DynamicNTKScaling(2.0, 2),
    "yarn": lambda: YaRNScaling(2.0, 2),
}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """A scheme inside attention (``name`` in SCHEMES), an input encoding, or a scaled RoPE."""
    torch.manual_seed(seed)
    if name in ENCODINGS:
        return ENCODINGS[name][0]()
    if name in SCALINGS:
        scheme = Rotary(HEAD_DIM, scaling=SCALINGS[name]())
    else:
        scheme = SCHEMES[name].build(HEADS, HEAD_DIM, N, GRID)
    return MultiHeadAttention(DIM, HEADS, position=scheme)


def call(name: str, module: torch.nn.Module) -> torch.Tensor:
    """The module's output on a fixed input (causal attention for the schemes)."""
    shape = ENCODINGS[name][1] if name in ENCODINGS else (2, N, DIM)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(99))
    return module(x) if name in ENCODINGS else module(x, causal=True)


EVERYTHING = [*SCHEMES, *ENCODINGS]


def test_tables_cover_every_scheme():
    assert set(TABLES) == set(SCHEMES), "add the new scheme's documented tables to TABLES"


# ----- state_dict: learned tables only ------------------------------------------------------


@pytest.mark.parametrize("name", EVERYTHING)
def test_state_dict_holds_learned_tables_only(name):
    module = build(name)
    state = module.state_dict()
    if name in ENCODINGS:
        expected = ENCODINGS[name][2]
    else:
        expected = PROJECTIONS | {f"position.{k}": v for k, v in TABLES[name].items()}
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    parameters = dict(module.named_parameters())
    assert set(state) == set(parameters), "only parameters are saved"
    for key, value in state.items():
        assert value.dtype == torch.float32, key
    # derived tables exist as buffers but are not saved
    for key, _ in module.named_buffers():
        assert key not in state


def test_swin_index_is_a_derived_buffer():
    swin = RelativePositionBias(GRID, HEADS)
    assert [k for k, _ in swin.named_buffers()] == ["index"]
    assert list(swin.state_dict()) == ["table"]


def test_swin_1d_derived_state_is_linear_in_the_window():
    """Regression: a 1-D window kept a dense ``[W, W]`` int64 index (128 MB at W = 4096)
    that attention never reads; its derived state must be O(W)."""
    window = 4096
    swin = RelativePositionBias(window, HEADS)
    assert sum(buffer.numel() for buffer in swin.buffers()) < 10 * window
    assert {k: tuple(v.shape) for k, v in swin.state_dict().items()} == {
        "table": (2 * window - 1, HEADS)
    }
    # a checkpoint of the 1-D table loads into a meta-built module and gives the same bias
    small = RelativePositionBias(6, HEADS)
    with torch.device("meta"):
        module = RelativePositionBias(6, HEADS)
    module.load_state_dict(small.state_dict(), strict=True, assign=True)
    assert torch.equal(module(), small())


# ----- copies: deepcopy, pickle, torch.save ---------------------------------------------------


@pytest.mark.parametrize("name", EVERYTHING)
def test_deepcopy_and_pickle_give_identical_independent_modules(name):
    module = build(name).eval()
    expected = call(name, module)
    for clone in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert type(clone) is type(module)
        assert torch.equal(call(name, clone), expected)
        for (key, p), (_, c) in zip(
            module.named_parameters(), clone.named_parameters(), strict=True
        ):
            assert torch.equal(p, c) and p.data_ptr() != c.data_ptr(), key
        for (key, b), (_, c) in zip(module.named_buffers(), clone.named_buffers(), strict=True):
            assert torch.equal(b, c), key
        # independent: changing the clone leaves the original alone
        with torch.no_grad():
            for p in clone.parameters():
                p.add_(1.0)
        assert torch.equal(call(name, module), expected)


@pytest.mark.parametrize("name", [*EVERYTHING, *SCALINGS])
def test_torch_save_and_load_weights_only_round_trip(name, tmp_path):
    module = build(name, seed=0).eval()
    expected = call(name, module)
    torch.save(module.state_dict(), tmp_path / "checkpoint.pt")
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    fresh = build(name, seed=1).eval()
    if any(True for _ in fresh.parameters()):
        assert not torch.equal(call(name, fresh), expected), "the seeds must differ"
    fresh.load_state_dict(state, strict=True)
    assert torch.equal(call(name, fresh), expected)
    # an in-memory buffer too, and the whole module pickled by torch.save
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    whole = torch.load(buffer, weights_only=False)
    assert torch.equal(call(name, whole), expected)


# ----- a checkpoint of an earlier version, written by hand ------------------------------------


def fixed(shape: tuple[int, ...], salt: float) -> torch.Tensor:
    """Deterministic values that do not depend on any posenc code or random state."""
    count = math.prod(shape)
    return (0.5 * torch.sin(torch.arange(count, dtype=torch.float64) * 0.61 + salt)).reshape(shape)


#: offsets j - i -> T5 bucket for num_buckets=8, max_distance=16, by hand from the T5 paper's
#: rule: half the buckets per direction, exact below 2 (bidirectional) or 4 (decoder)
T5_BUCKETS = {-3: 2, -2: 2, -1: 1, 0: 0, 1: 5, 2: 6, 3: 6}
T5_DECODER_BUCKETS = {-3: 3, -2: 2, -1: 1, 0: 0, 1: 0, 2: 0, 3: 0}
#: Swin's index for a (2, 2) window, from DESIGN.md
SWIN_INDEX = [[4, 3, 1, 0], [5, 4, 2, 1], [7, 6, 4, 3], [8, 7, 5, 4]]


def _grid_row(tables, h, i, j):
    """``height[r_j - r_i + H - 1] + width[c_j - c_i + W - 1]`` (head ``h``'s if per head)."""
    (r_i, c_i), (r_j, c_j) = divmod(i, GRID[1]), divmod(j, GRID[1])
    height, width = tables["height"], tables["width"]
    if h is not None:
        height, width = height[h], width[h]
    return height[r_j - r_i + GRID[0] - 1] + width[c_j - c_i + GRID[1] - 1]


#: name -> (module, {table: shape}, bias(t, h, i, j), term(t, h, i, j, q_i), value(t, h, i, j))
CHECKPOINTS = {
    "alibi-learned": (
        lambda: ALiBi(HEADS, learned=True),
        {"log_slopes": (HEADS,)},
        lambda t, h, i, j: -math.exp(t["log_slopes"][h]) * abs(j - i),
        None,
        None,
    ),
    "kerple-log": (  # r1, r2 clamped to >= 0.01 (Chi et al. 2022's reference code)
        lambda: KerpleBias(HEADS, kind="log"),
        {"r1": (HEADS,), "r2": (HEADS,)},
        lambda t, h, i, j: (
            -max(0.01, float(t["r1"][h])) * math.log(1 + max(0.01, float(t["r2"][h])) * abs(j - i))
        ),
        None,
        None,
    ),
    "kerple-power": (  # r1 >= 0.01, 0.01 <= r2 <= 2
        lambda: KerpleBias(HEADS, kind="power"),
        {"r1": (HEADS,), "r2": (HEADS,)},
        lambda t, h, i, j: (
            -max(0.01, float(t["r1"][h])) * abs(j - i) ** min(2.0, max(0.01, float(t["r2"][h])))
        ),
        None,
        None,
    ),
    "t5": (
        lambda: T5RelativeBias(HEADS, num_buckets=8, max_distance=16),
        {"embedding.weight": (8, HEADS)},
        lambda t, h, i, j: t["embedding.weight"][T5_BUCKETS[j - i], h],
        None,
        None,
    ),
    "t5-decoder": (
        lambda: T5RelativeBias(HEADS, num_buckets=8, max_distance=16, bidirectional=False),
        {"embedding.weight": (8, HEADS)},
        lambda t, h, i, j: t["embedding.weight"][T5_DECODER_BUCKETS[j - i], h],
        None,
        None,
    ),
    "swin-1d": (
        lambda: RelativePositionBias(N, HEADS),
        {"table": (2 * N - 1, HEADS)},
        lambda t, h, i, j: t["table"][i - j + N - 1, h],  # Swin: query minus key
        None,
        None,
    ),
    "swin-2d": (
        lambda: RelativePositionBias(GRID, HEADS),
        {"table": (9, HEADS)},
        lambda t, h, i, j: t["table"][SWIN_INDEX[i][j], h],
        None,
        None,
    ),
    "relative": (
        lambda: RelativeQueryEmbedding(N, HEAD_DIM),
        {"weight": (2 * N - 1, HEAD_DIM)},
        None,
        lambda t, h, i, j, q: q @ t["weight"][j - i + N - 1],
        None,
    ),
    "relative-per-head": (
        lambda: RelativeQueryEmbedding(N, HEAD_DIM, heads=HEADS),
        {"weight": (HEADS, 2 * N - 1, HEAD_DIM)},
        None,
        lambda t, h, i, j, q: q @ t["weight"][h, j - i + N - 1],
        None,
    ),
    "relative-2d": (
        lambda: RelativeQueryEmbedding2D(GRID, HEAD_DIM),
        {"height": (3, HEAD_DIM), "width": (3, HEAD_DIM)},
        None,
        lambda t, h, i, j, q: q @ _grid_row(t, None, i, j),
        None,
    ),
    "relative-2d-per-head": (
        lambda: RelativeQueryEmbedding2D(GRID, HEAD_DIM, heads=HEADS),
        {"height": (HEADS, 3, HEAD_DIM), "width": (HEADS, 3, HEAD_DIM)},
        None,
        lambda t, h, i, j, q: q @ _grid_row(t, h, i, j),
        None,
    ),
    "absolute-query": (
        lambda: AbsoluteQueryEmbedding(N, HEAD_DIM),
        {"weight": (N, HEAD_DIM)},
        None,
        lambda t, h, i, j, q: q @ t["weight"][j],
        None,
    ),
    "shaw": (  # max_distance 1: offsets -3..3 are clipped to rows 0..2
        lambda: ShawRelativePosition(HEAD_DIM, 1),
        {"keys": (3, HEAD_DIM), "values": (3, HEAD_DIM)},
        None,
        lambda t, h, i, j, q: q @ t["keys"][max(-1, min(1, j - i)) + 1],
        lambda t, h, i, j: t["values"][max(-1, min(1, j - i)) + 1],
    ),
    "shaw-keys-only": (
        lambda: ShawRelativePosition(HEAD_DIM, 1, values=False),
        {"keys": (3, HEAD_DIM)},
        None,
        lambda t, h, i, j, q: q @ t["keys"][max(-1, min(1, j - i)) + 1],
        None,
    ),
}


def reference_attention(state, x, tables, bias=None, term=None, value=None):
    """Self-attention in float64, one (batch, head, query) at a time, no mask."""
    x = x.double()

    def project(name, inputs):
        return inputs @ state[f"{name}.weight"].T + state[f"{name}.bias"]

    b, n, _ = x.shape
    q, k, v = (project(p, x).view(b, n, HEADS, HEAD_DIM) for p in ("q_proj", "k_proj", "v_proj"))
    out = torch.zeros(b, n, HEADS, HEAD_DIM, dtype=torch.float64)
    for batch in range(b):
        for h in range(HEADS):
            for i in range(n):
                qi = q[batch, i, h]
                logits = []
                for j in range(n):
                    s = qi @ k[batch, j, h] + (term(tables, h, i, j, qi) if term else 0.0)
                    s = s / math.sqrt(HEAD_DIM) + (bias(tables, h, i, j) if bias else 0.0)
                    logits.append(s)
                weights = torch.stack(logits).softmax(0)
                for j in range(n):
                    extra = value(tables, h, i, j) if value else 0.0
                    out[batch, i, h] += weights[j] * (v[batch, j, h] + extra)
    return project("out_proj", out.reshape(b, n, DIM))


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_checkpoint_in_the_documented_layout_loads_and_is_used(name):
    factory, shapes, bias, term, value = CHECKPOINTS[name]
    tables = {key: fixed(shape, salt=0.3 * i) for i, (key, shape) in enumerate(shapes.items())}
    projections = {
        key: fixed(shape, salt=1.0 + 0.7 * i) for i, (key, shape) in enumerate(PROJECTIONS.items())
    }
    checkpoint = projections | {f"position.{k}": t for k, t in tables.items()}
    torch.manual_seed(3)
    model = MultiHeadAttention(DIM, HEADS, position=factory()).eval()
    result = model.load_state_dict({k: t.float() for k, t in checkpoint.items()}, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    x = torch.randn(2, N, DIM, generator=torch.Generator().manual_seed(5))
    expected = reference_attention(checkpoint, x, tables, bias=bias, term=term, value=value)
    got, logit = forward(model, x)  # float32 against float64: sums of DIM terms at most
    assert_close(got, expected, terms=DIM, logit=logit)
    # the table matters: the same projections with another table give another output
    other = MultiHeadAttention(DIM, HEADS, position=factory()).eval()
    other.load_state_dict(
        projections | {f"position.{k}": -t for k, t in tables.items()}, strict=True
    )
    assert not torch.allclose(other(x).double(), expected, atol=1e-3)


@pytest.mark.parametrize("name", ["t5", "t5-decoder", "swin-1d", "swin-2d"])
def test_standalone_bias_reads_the_loaded_table(name):
    factory, shapes, bias, _, _ = CHECKPOINTS[name]
    tables = {key: fixed(shape, salt=0.4) for key, shape in shapes.items()}
    module = factory()
    module.load_state_dict({k: t.float() for k, t in tables.items()}, strict=True)
    got = module(N, N) if name.startswith("t5") else module()  # [h, N, N]
    expected = torch.tensor(
        [[[bias(tables, h, i, j) for j in range(N)] for i in range(N)] for h in range(HEADS)],
        dtype=torch.float64,
    )
    assert_close(got, expected)  # a plain lookup: one rounding


def test_learned_encoding_checkpoint_loads_and_is_used():
    weight = fixed((6, DIM), salt=0.2)
    enc = LearnedEncoding(DIM, 6)
    enc.load_state_dict({"weight": weight.float()}, strict=True)
    x = torch.randn(2, 4, DIM)
    assert_close(enc(x), x.double() + weight[:4], terms=2)
    positions = torch.tensor([5, 0, 2, 2])
    assert_close(enc(x, positions), x.double() + weight[positions], terms=2)
    for fixed_enc in (SinusoidalEncoding(DIM), SinusoidalEncoding2D(DIM)):
        fixed_enc.load_state_dict({}, strict=True)  # nothing to load, nothing missing


def test_checkpoint_with_a_wrong_table_shape_is_refused():
    model = MultiHeadAttention(DIM, HEADS, position=RelativePositionBias(GRID, HEADS))
    state = model.state_dict()
    state["position.table"] = torch.zeros(HEADS, 9)  # transposed: heads first
    with pytest.raises(RuntimeError, match=r"size mismatch for position\.table"):
        model.load_state_dict(state)


# ----- meta device ------------------------------------------------------------------------------


def _reset(module: torch.nn.Module) -> None:
    for sub in module.modules():
        if callable(getattr(sub, "reset_parameters", None)):
            sub.reset_parameters()


@pytest.mark.parametrize("name", [*SCALINGS, *ENCODINGS])
def test_meta_construction_to_empty_and_reset(name):
    with torch.device("meta"):
        module = build(name)
    assert all(p.is_meta for p in module.parameters())
    module.to_empty(device="cpu")
    _reset(module)
    reference = build(name).eval()
    assert set(module.state_dict()) == set(reference.state_dict())
    module.load_state_dict(reference.state_dict())
    assert torch.equal(call(name, module.eval()), call(name, reference))


@pytest.mark.parametrize("name", [*EVERYTHING, *SCALINGS])
@pytest.mark.parametrize("how", ["to_empty", "assign"])
def test_meta_construction_then_loading_a_checkpoint_rebuilds_derived_tables(name, how):
    """The large-model flow: build on meta, then load weights (no ``reset_parameters``)."""
    reference = build(name, seed=4).eval()
    with torch.device("meta"):
        module = build(name)
    if how == "to_empty":
        module.to_empty(device="cpu")
        module.load_state_dict(reference.state_dict(), strict=True)
    else:
        module.load_state_dict(reference.state_dict(), strict=True, assign=True)
    module.eval()
    for (key, buffer), (_, expected) in zip(
        module.named_buffers(), reference.named_buffers(), strict=True
    ):
        assert buffer.device == expected.device and torch.equal(buffer, expected), key
    assert torch.equal(call(name, module), call(name, reference))


@pytest.mark.parametrize("how", ["to_empty", "assign"])
def test_swin_standalone_bias_after_meta_construction_and_loading(how):
    """Regression: Swin's index stayed uninitialised (or on meta) after loading a checkpoint
    into a meta-built module, and the standalone ``forward()`` failed or read garbage."""
    reference = RelativePositionBias((3, 2), HEADS)
    with torch.device("meta"):
        module = RelativePositionBias((3, 2), HEADS)
    if how == "to_empty":
        module.to_empty(device="cpu")
        module.load_state_dict(reference.state_dict())
    else:
        module.load_state_dict(reference.state_dict(), assign=True)
    assert torch.equal(module.index, reference.index)
    assert torch.equal(module(), reference())
