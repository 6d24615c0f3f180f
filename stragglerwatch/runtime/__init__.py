"""What runs inside the training process: :func:`~stragglerwatch.runtime.watch.attach` and its parts.

Hooks and taps (``probes``, ``shadows``, ``taps``, ``datamark``, ``models``, ``devices``), the step
anatomy (``timing``), the step-log writer thread (``writer``), the stall watchdog and what it leaves
(``watchdog``, ``dumps``, ``nativestacks``, ``shutdown``), the samplers of host, GPU and code
(``sampler``, ``hostctx``, ``gpuctx``, ``codesampler``), the Prometheus exporter (``exporter``,
``ctxmetrics``, ``codemetrics``) and runtime control (``controlspec``, ``control``, ``controlfile``,
``debugserver``, ``debugstack``). It writes records (``stragglerwatch.record``) and may use the pure
rules of ``stragglerwatch.analysis``; nothing below it imports it.
"""
