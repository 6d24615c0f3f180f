"""Other tools' evidence, read and judged: PyTorch's own failure logs (``torchlogs``,
``torchlogs_blocks``, ``logevent``), Flight Recorder dumps (``frdumps``, ``flightrec``), one hang
verdict from every source (``hangverdict``), their place in a report (``combine``), and op-level
traces of hybrid-parallel jobs with the what-if method (``traces``, ``whatif``, ``whatif_deps``).
It builds on ``stragglerwatch.analysis`` and ``stragglerwatch.record``, and imports no torch.
"""
