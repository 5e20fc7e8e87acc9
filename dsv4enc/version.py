"""The package version, in a module of its own: nothing imports ``dsv4enc/__init__`` for it."""

__version__ = "0.1.0"
