"""Sampling the rank's surroundings: host and GPU context (``sampler``, ``hostctx``, ``gpuctx``,
``ctxmetrics``) and where in the code the training thread is (``codesampler``, ``codemetrics``).
"""
