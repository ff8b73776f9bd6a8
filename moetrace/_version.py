"""The package version, in a module of its own so that trace I/O can read it without the package root."""

__version__ = "0.1.0"
