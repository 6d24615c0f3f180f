"""The package version, in a module of its own: every layer may read it, and it imports nothing."""

__version__ = "0.1.0"
