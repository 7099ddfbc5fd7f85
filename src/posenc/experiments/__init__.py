"""The experiment that ``posenc compare`` runs, apart from the library's core.

- :mod:`~posenc.experiments.tasks`: synthetic tasks on which positional information is
  necessary and the answer is known (``shift``, ``copy``, ``grid``), and ``lm``, a
  byte-level language model on real text.
- :mod:`~posenc.experiments.corpus`: the ``lm`` task's text (by default the Python
  standard library's source), split into training and held-out files.
- :mod:`~posenc.experiments.language`: perplexity per test length, and RoPE scalings
  applied to a trained rotary model at evaluation.
- :mod:`~posenc.experiments.models`: :class:`~posenc.experiments.models.TinyTransformer`,
  a small pre-norm transformer built from posenc's own modules.
- :mod:`~posenc.experiments.training`: build, train and evaluate one model per task,
  scheme (a name of :mod:`posenc.registry`) and seed, and keep it as a checkpoint.

Nothing here is imported by ``import posenc``.
"""
