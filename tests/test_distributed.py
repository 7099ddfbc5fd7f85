"""Distributed training of a posenc model on two CPU processes (gloo): DDP and FSDP2.

A :class:`~posenc.MultiHeadAttention` with a learned scheme (``T5RelativeBias``) and a
linear head is trained for a few SGD steps on two processes, each with half of the global
batch, once wrapped in ``DistributedDataParallel`` and once sharded with FSDP2
(``torch.distributed.fsdp.fully_shard``). Both must give what one process gives on the
whole batch: the same loss at every step and the same parameters at the end, identical on
the two ranks. One ``torch.multiprocessing.spawn`` runs both (about 10 s on 2 cores).
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from posenc import MultiHeadAttention, T5RelativeBias
from tolerances import assert_close

pytestmark = pytest.mark.slow

WORLD = 2
STEPS = 4
LR = 0.5
BATCH, SEQ, DIM, HEADS = 4, 6, 16, 2  # global batch, split in WORLD equal halves


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        scheme = T5RelativeBias(HEADS, num_buckets=8, max_distance=16)
        self.attn = MultiHeadAttention(DIM, HEADS, position=scheme)
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, causal=True))


def make_model() -> Model:
    torch.manual_seed(0)
    model = Model()
    with torch.no_grad():  # a table large enough to matter, so that its training shows
        model.attn.position.embedding.weight.normal_(std=0.5)
    return model


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, SEQ, DIM, generator=gen), torch.randn(BATCH, SEQ, 3, generator=gen)


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """SGD on ``x, y``; returns the loss before each step (averaged over ranks if any)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        value = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(float(value))
    return losses


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded (FSDP2 holds DTensor shards), without DDP's prefix."""
    out = {}
    for key, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[key.removeprefix("module.")] = value.detach().clone()
    return out


def worker(rank: int, init_method: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.set_num_threads(1)
        x, y = make_data()
        x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]  # this rank's half of the batch
        results = {}

        ddp = nn.parallel.DistributedDataParallel(make_model())
        results["ddp"] = (train(ddp, x, y), full_parameters(ddp))

        from torch.distributed.fsdp import fully_shard

        sharded = make_model()
        fully_shard(sharded.attn)
        fully_shard(sharded)
        table = sharded.attn.position.embedding.weight
        results["fsdp2"] = (train(sharded, x, y), full_parameters(sharded))
        results["fsdp2-sharded"] = type(table).__name__, tuple(table.to_local().shape)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        # every rank done before any tears gloo down: one leaving while another's gloo
        # threads still run aborts it now and then ("terminate called without an active
        # exception", SIGABRT)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("distributed")
    init_method = f"file://{out_dir / 'store'}"
    mp.spawn(worker, args=(init_method, str(out_dir)), nprocs=WORLD, join=True)
    ranks = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    single = make_model()
    initial = {k: v.detach().clone() for k, v in single.state_dict().items()}
    x, y = make_data()
    losses = train(single, x, y)
    return ranks, losses, dict(single.state_dict()), initial


@pytest.mark.parametrize("method", ["ddp", "fsdp2"])
def test_two_processes_train_like_one(runs, method):
    ranks, losses, params, initial = runs
    # float32 sums in another order (half batches, then an all-reduce): STEPS steps, each
    # over BATCH * SEQ tokens; each value at its own size (tests/tolerances.py)
    close = dict(terms=STEPS * BATCH * SEQ)
    for rank in ranks:
        rank_losses, rank_params = rank[method]
        assert_close(torch.tensor(rank_losses), torch.tensor(losses), **close, msg="losses")
        assert set(rank_params) == set(params)
        for key, value in params.items():
            assert_close(rank_params[key], value, **close, msg=key)
    # the ranks hold the same parameters, to the bit
    for key, value in ranks[0][method][1].items():
        assert torch.equal(ranks[1][method][1][key], value), key
    # and training did move them, the positional table included
    assert losses[-1] < losses[0]
    table = "attn.position.embedding.weight"
    assert (params[table] - initial[table]).abs().max() > 1e-3


def test_fsdp2_shards_the_positional_table(runs):
    ranks = runs[0]
    for rank in ranks:
        kind, local_shape = rank["fsdp2-sharded"]
        assert kind == "DTensor"
        assert local_shape == (8 // WORLD, HEADS)  # dim-0 shards of [num_buckets, heads]
