"""The package version, in a leaf module: modules that record it (manifest, CLI) import it from
here, not from the package ``__init__`` (whose ``run`` reaches the whole pipeline)."""

__version__ = "0.1.0"
