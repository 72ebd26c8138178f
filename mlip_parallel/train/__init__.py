"""Training potentials (the ``mlip-train`` application, docs/architecture.md §5): labelled data, batches
and losses (``training``), the strategies that run a step — data, graph and pipeline parallel — and the
``Trainer`` (``trainer``), pipeline stages (``pipeline``) and their schedules (``schedule``), and the
command line (``cli``)."""
