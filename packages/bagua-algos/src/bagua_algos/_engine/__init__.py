"""The wrapper's machinery, below the algorithms and the wrapper itself.

``engine`` (:class:`~.engine.StepEngine`: buckets, readiness, launch order, end of backward,
unused parameters, side stream), ``bucket`` (one bucket's flat buffers and flag slots),
``comm`` (handles, the reducer, broadcasts), ``state`` (per-parameter algorithm state),
``checkpoint``, ``join`` (uneven inputs), ``sparse`` (sparse gradients), ``consistency``
(same configuration on every rank), ``checks`` (argument checks), ``compiled``
(``torch.compile``), ``overflow`` (GradScaler's skipped steps).  Nothing here imports the
wrapper, the algorithms, tuning or the integrations (an import-linter contract).
"""
