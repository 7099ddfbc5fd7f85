"""The experiment that ``posenc compare`` runs: build, train and evaluate one model.

For a task of :mod:`posenc.experiments.tasks` and a scheme of :mod:`posenc.registry`, a
:class:`~posenc.experiments.models.TinyTransformer` is built (:func:`build_model`),
trained at the task's training length (:func:`train`, under DistributedDataParallel when
a process group is up) and evaluated at that length and longer ones (:func:`evaluate`;
on the ``lm`` task the perplexity too, :mod:`~posenc.experiments.language`);
:func:`run_one` does all three and returns a :class:`Run`. :func:`save_checkpoint` and
:func:`load_checkpoint` keep a trained model with what rebuilds it.

Every scheme is built for the :class:`~posenc.registry.Shape` of the task
(:func:`shape_for`): the tables sized by length are built for the longest test length
(window, ``max_len`` or grid), a learned absolute table has rows for the training length
only, and 2-D schemes number the cells of a grid row-major within the largest test grid,
so that the cell above is always the same table row.

Shape legend: ``b`` batch, ``n`` tokens, ``H x W`` a grid (row-major, ``n = H * W``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import registry
from ..registry import Shape
from .language import evaluate_lm, rope_scaling_perplexity
from .models import TinyTransformer
from .tasks import IGNORE, Batch, LanguageModelTask, Task, get_task

__all__ = [
    "SHAW_CLIP",
    "T5_BUCKETS",
    "Config",
    "Run",
    "accuracy",
    "build_model",
    "default_schemes",
    "evaluate",
    "load_checkpoint",
    "logits_of",
    "parameter_groups",
    "positions_for",
    "rank_and_world",
    "run_one",
    "save_checkpoint",
    "scheme_order",
    "schemes_for",
    "shape_for",
    "train",
]

#: Shaw's clipping distance in these small models
SHAW_CLIP = 8
#: T5's ``(num_buckets, max_distance)`` in these small models
T5_BUCKETS = (16, 64)


# ----- the schemes ------------------------------------------------------------------------


def scheme_order(names: Sequence[str]) -> list[str]:
    """``names`` (old names resolved) in the order ``compare`` lists them: the 1-D schemes,
    then the 2-D ones (which run on grid tasks only), each in the registry's order."""
    resolved = {registry.resolve(name) for name in names}
    order = [n for n in registry.SCHEMES if n in resolved]
    return [n for n in order if not registry.SCHEMES[n].two_d] + [
        n for n in order if registry.SCHEMES[n].two_d
    ]


def default_schemes() -> list[str]:
    """The schemes of ``compare``'s default run, in its order."""
    return scheme_order(registry.names(default_in="compare"))


def schemes_for(task: Task, names: Sequence[str] | None = None) -> list[str]:
    """The schemes that make sense for ``task`` (2-D ones only on grids), in order.

    ``names`` (old names resolved) keep their order; None: :func:`default_schemes` and
    the task's own ``schemes`` (``lm`` adds ``kerple-log``).
    """
    if names is None:
        names = scheme_order([*default_schemes(), *task.schemes])
    else:
        names = [registry.resolve(n) for n in names]
    return [n for n in names if task.two_d or not registry.SCHEMES[n].two_d]


# ----- one model --------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """Training set-up shared by every run."""

    steps: int = 200
    batch: int = 32
    dim: int = 64
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    table_lr_scale: float = 10.0
    eval_examples: int = 128
    device: str = "cpu"


def shape_for(task: Task, config: Config) -> Shape:
    """The :class:`~posenc.registry.Shape` every scheme is built for on ``task``."""
    grids = [t for t in (task.train_length, *task.test_lengths) if isinstance(t, tuple)]
    max_grid = (max(g[0] for g in grids), max(g[1] for g in grids)) if grids else None
    return Shape(
        heads=config.heads,
        head_dim=config.dim // config.heads,
        max_len=max(task.tokens_of(t) for t in (task.train_length, *task.test_lengths)),
        grid=max_grid,
        dim=config.dim,
        train_len=task.tokens_of(task.train_length),
        causal=task.causal,
        clip=SHAW_CLIP,
        buckets=T5_BUCKETS,
    )


def build_model(task: Task, scheme: str, config: Config) -> TinyTransformer:
    """A :class:`TinyTransformer` for ``task`` with ``scheme`` (seed the RNG before).

    The scheme's input encoding, or its module inside attention: one shared by every layer
    where the registry says ``shared``, else a fresh one per layer.
    """
    entry = registry.get(scheme)
    shape = shape_for(task, config)
    if entry.two_d and shape.grid is None:
        raise ValueError(f"a 2-D scheme needs a 2-D task, got task {task.name!r}")
    encoding, position = None, None
    if entry.place == 1:
        encoding = entry.build(shape)
    elif entry.inside:
        position = entry.build(shape) if entry.shared else partial(entry.build, shape)
    return TinyTransformer(
        task.vocab,
        dim=config.dim,
        layers=config.layers,
        heads=config.heads,
        encoding=encoding,
        position=position,
    )


def positions_for(task: Task, scheme: str, config: Config, batch: Batch) -> Tensor | None:
    """Token positions for ``scheme``: cells of the largest grid for 2-D schemes inside
    attention, else None.

    A 1-D scheme on a grid sees the flattened sequence (``arange(H * W)``, the default).
    """
    entry = registry.get(scheme)
    if not (entry.two_d and entry.inside) or batch.size is None:
        return None
    width = shape_for(task, config).cells(scheme)[1]
    h, w = batch.size
    rows = torch.arange(h)[:, None].expand(h, w)  # [H, W]
    cols = torch.arange(w)[None, :].expand(h, w)  # [H, W]
    return (rows * width + cols).flatten()  # [H*W]


def logits_of(model: nn.Module, task: Task, scheme: str, config: Config, batch: Batch) -> Tensor:
    """``model``'s logits ``[b, n, vocab]`` on ``batch``."""
    device = torch.device(config.device)
    positions = positions_for(task, scheme, config, batch)
    return model(
        batch.tokens.to(device),
        causal=task.causal,
        positions=None if positions is None else positions.to(device),
        size=batch.size,
    )


def accuracy(logits: Tensor, targets: Tensor) -> float:
    """The fraction of scored positions (target != IGNORE) whose argmax is the target."""
    scored = targets != IGNORE
    hits = (logits.argmax(-1) == targets) & scored
    return float(hits.sum()) / max(1, int(scored.sum()))


def parameter_groups(model: nn.Module, config: Config) -> list[dict[str, Any]]:
    """AdamW groups: the positional tables inside attention at ``table_lr_scale * lr``.

    A bias table holds one scalar per offset and head, and Adam moves each parameter by
    about ``lr`` per step: at ``lr = 3e-3`` a Swin or T5 bias cannot grow past about 0.6
    in 200 steps (less with the warm-up and decay), too flat to stand out among many more keys at a longer test length.
    The faster rate lets such tables reach the size that a longer training would give.
    """
    tables = [p for n, p in model.named_parameters() if ".attn.position." in n]
    ids = {id(p) for p in tables}
    rest = [p for p in model.parameters() if id(p) not in ids]
    groups = [{"params": rest, "lr": config.lr}]
    if tables:
        groups.append({"params": tables, "lr": config.lr * config.table_lr_scale})
    return groups


def rank_and_world() -> tuple[int, int]:
    """``(rank, world)`` of the process group, ``(0, 1)`` without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def train(
    task: Task,
    scheme: str,
    seed: int,
    config: Config,
    *,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[nn.Module, list[float]]:
    """Train one model; return it (unwrapped) and its loss per step.

    Every rank builds the same model (same seed) and draws the same global batch; under
    DistributedDataParallel each rank trains on its slice of the batch and the gradients
    are averaged, which equals one process on the whole batch.
    """
    rank, world = rank_and_world()
    if config.batch % world:
        raise ValueError(
            f"--batch {config.batch} must be divisible by the number of processes ({world})"
        )
    torch.manual_seed(seed)
    device = torch.device(config.device)
    model = build_model(task, scheme, config).to(device)
    net: nn.Module = model
    if world > 1:
        net = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(parameter_groups(model, config), weight_decay=0.01, fused=True)
    warmup = max(1, config.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            min(1.0, (step + 1) / warmup)
            * 0.5
            * (1 + math.cos(math.pi * min(step, config.steps) / config.steps))
        ),
    )
    generator = torch.Generator().manual_seed(10_000 + seed)
    share = slice(rank * config.batch // world, (rank + 1) * config.batch // world)
    losses = []
    model.train()
    for step in range(config.steps):
        full = task.sample(config.batch, task.train_length, generator)
        batch = Batch(full.tokens[share], full.targets[share], full.size)
        logits = logits_of(net, task, scheme, config, batch)
        loss = F.cross_entropy(
            logits.flatten(0, 1), batch.targets.to(device).flatten(), ignore_index=IGNORE
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return model.eval(), losses


@torch.no_grad()
def evaluate(
    model: nn.Module, task: Task, scheme: str, seed: int, config: Config
) -> dict[str, float | None]:
    """Accuracy at every test length (None where the scheme cannot serve the length).

    On the ``lm`` task: next-byte accuracy on the held-out text
    (:func:`~posenc.experiments.language.evaluate_lm`, which gives the perplexity too).
    """
    shape, entry = shape_for(task, config), registry.get(scheme)
    if isinstance(task, LanguageModelTask):
        return evaluate_lm(
            model,
            task,
            examples=config.eval_examples,
            device=config.device,
            serves=lambda n: entry.serves(shape, n),
        )[0]
    results: dict[str, float | None] = {}
    for length in task.test_lengths:
        label = task.label(length)
        if not entry.serves(shape, task.tokens_of(length)):
            results[label] = None
            continue
        generator = torch.Generator().manual_seed(20_000 + seed)
        batch = task.sample(config.eval_examples, length, generator)
        results[label] = accuracy(logits_of(model, task, scheme, config, batch), batch.targets)
    return results


# ----- runs and checkpoints -------------------------------------------------------------


@dataclass
class Run:
    """One trained model: its task, scheme, seed and results.

    ``perplexity`` (per byte, per test length) is set on the ``lm`` task, ``rope_scaling``
    (``{scaling: {length: perplexity}}``, see
    :func:`~posenc.experiments.language.rope_scaling_perplexity`) on the ``lm`` task
    for a scheme with unscaled rotary attention; both None otherwise.
    """

    task: str
    scheme: str
    seed: int
    accuracy: dict[str, float | None]
    parameters: int
    seconds: float
    final_loss: float
    perplexity: dict[str, float | None] | None = None
    rope_scaling: dict[str, dict[str, float]] | None = None


def run_one(
    task: Task,
    scheme: str,
    seed: int,
    config: Config,
    *,
    checkpoints: Path | None = None,
    on_step: Callable[[int, float], None] | None = None,
    threads: int | None = None,
) -> Run:
    """Train and evaluate one model (and save it when ``seed == 0`` and ``checkpoints``)."""
    if threads is not None:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    model, losses = train(task, scheme, seed, config, on_step=on_step)
    seconds = time.perf_counter() - started
    if checkpoints is not None and seed == 0 and rank_and_world()[0] == 0:
        save_checkpoint(checkpoints, model, task, scheme, config)
    perplexity, scaled = None, None
    if isinstance(task, LanguageModelTask):
        shape, entry = shape_for(task, config), registry.get(scheme)
        examples, device = config.eval_examples, config.device
        accuracy, perplexity = evaluate_lm(
            model,
            task,
            examples=examples,
            device=device,
            serves=lambda n: entry.serves(shape, n),
        )
        scaled = rope_scaling_perplexity(model, task, examples=examples, device=device)
    else:
        accuracy = evaluate(model, task, scheme, seed, config)
    return Run(
        task=task.name,
        scheme=scheme,
        seed=seed,
        accuracy=accuracy,
        parameters=sum(p.numel() for p in model.parameters()),
        seconds=seconds,
        final_loss=statistics.fmean(losses[-10:]),
        perplexity=perplexity,
        rope_scaling=scaled,
    )


def save_checkpoint(
    folder: Path, model: nn.Module, task: Task, scheme: str, config: Config
) -> Path:
    """Save a trained model with what rebuilds it (see :func:`load_checkpoint`)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{task.name}-{scheme}.pt"
    config_dict = asdict(config)
    lengths = {"train_length": task.train_length, "test_lengths": task.test_lengths}
    torch.save(
        {
            "task": task.name,
            "lengths": lengths,
            "corpus": getattr(task, "corpus", None),
            "scheme": scheme,
            "config": config_dict,
            "state": model.state_dict(),
        },
        path,
    )
    return path


def load_checkpoint(path: Path) -> tuple[TinyTransformer, Task, str, Config]:
    """``(model in eval mode, task, scheme, config)`` from :func:`save_checkpoint`.

    A checkpoint saved under an old scheme name (``swin``) gives the name of today.
    """
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        config = Config(**{**saved["config"], "device": "cpu"})
        lengths = saved["lengths"]
        task = replace(
            get_task(saved["task"]),
            train_length=_length(lengths["train_length"]),
            test_lengths=tuple(_length(x) for x in lengths["test_lengths"]),
        )
        if isinstance(task, LanguageModelTask):
            task = replace(task, corpus=saved.get("corpus"))
        scheme = registry.resolve(saved["scheme"])
        model = build_model(task, scheme, config)
        model.load_state_dict(saved["state"])
    except Exception as err:  # any file that is not one of ours: say which, and why
        raise ValueError(
            f"{path} is not a checkpoint of this posenc's `compare` ({type(err).__name__}: "
            f"{err}); run `posenc compare --out DIR` again to make new ones"
        ) from err
    return model.eval(), task, scheme, config


def _length(value: Any) -> int | tuple[int, int]:
    """A length read back from a checkpoint (grids may come back as lists)."""
    return int(value) if isinstance(value, int) else (int(value[0]), int(value[1]))
