"""The experiment that ``posenc compare`` runs, apart from the library's core.

- :mod:`~posenc.experiments.tasks`: synthetic tasks on which positional information is
  necessary and the answer is known (``shift``, ``copy``, ``grid``).
- :mod:`~posenc.experiments.models`: :class:`~posenc.experiments.models.TinyTransformer`,
  a small pre-norm transformer built from posenc's own modules.
- :mod:`~posenc.experiments.training`: build, train and evaluate one model per task,
  scheme (a name of :mod:`posenc.registry`) and seed, and keep it as a checkpoint.

Nothing here is imported by ``import posenc``.
"""
