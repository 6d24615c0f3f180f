"""The record format every part shares: what a run dir holds, how it is written and how it is read.

The step log's schema (``schema``), the run dir's metadata files (``rundir``), the step-log readers
(``steplog``: :func:`load_run`), the events file of stalls and shutdowns (``events``), the context and
code-sample streams (``context``, ``codelog``, over ``streams``), Prometheus read back as records
(``promsource``) and synthetic run dirs (``simulate``). It imports nothing else of ours and no torch:
the training process writes through it, every reader reads through it.
"""
