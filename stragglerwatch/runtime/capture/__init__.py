"""Measuring the step: the hooks and taps on the training loop (``probes``, ``taps``, ``shadows``,
``datamark``), what the model is (``models``), the work of a step (``work``), CUDA marks (``devices``), the
step anatomy (``timing``, ``intervals``), what no bracket sees (``coverage``) and PyTorch's own record of
the collectives (``collectives``).
"""
