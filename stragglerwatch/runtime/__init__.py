"""What runs inside the training process: :func:`~stragglerwatch.runtime.watch.attach` and its parts,
one sub-package per role, imported one way (``tests/test_layers.py`` holds the order):

- ``capture``: measuring the step (hooks, taps, the step anatomy, PyTorch's record of the collectives);
- ``output``: where the records go (the step log thread, the Prometheus exporter);
- ``hangs``: the stall watchdog and what a stall leaves behind;
- ``actions``: the opt-in policies (end a hung rank, act on a lasting straggler);
- ``context``: the samplers of host, GPU and code;
- ``controls``: runtime control and the debug server.

``watch`` (``attach``) is the one place that assembles them, with ``config`` (the settings), ``identity``
(who this rank is in the run) and ``log`` (the one-line problem reports every part uses). It writes
records (``stragglerwatch.record``) and may use the pure rules of ``stragglerwatch.analysis``; nothing
below it imports it.
"""
