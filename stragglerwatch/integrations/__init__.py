"""Framework integrations: attach stragglerwatch from a framework's own extension point.

- :mod:`stragglerwatch.integrations.lightning`: ``StragglerWatch``, a Lightning ``Callback``.
- :mod:`stragglerwatch.integrations.transformers`: ``StragglerWatchCallback``, a Hugging Face
  ``TrainerCallback``.

Accelerate, FSDP2 (``fully_shard``), torch.compile and torchtitan need no integration:
``stragglerwatch.attach(model)`` on the prepared, sharded or compiled model (README).
Each module imports its framework; the package itself imports none.
"""
