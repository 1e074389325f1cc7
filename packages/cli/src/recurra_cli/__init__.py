"""The ``recurra`` command-line tool (Typer)."""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("recurra-cli")
except _metadata.PackageNotFoundError:
    __version__ = "0+unknown"
