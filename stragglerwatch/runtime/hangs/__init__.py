"""Stalls: the watchdog thread (``watchdog``), the other ranks' progress through the store (``peers``),
what a stall leaves behind (``dumps``, ``nativestacks``) and the signal and exit hooks (``shutdown``).
"""
