"""The package version, alone in a module: anything may import it without importing the package's public names."""

__version__ = "0.1.0"
