"""How to install recurra's packages: the one command that every hint recurra prints names.

The packages are not published yet: they install from a checkout of the recurra repository,
where ``python tools/build_wheels.py --install NAME`` builds the wheels NAME needs (each
once) into ``dist/`` and pip-installs NAME from there (``pip install --find-links dist
NAME`` later, in any venv). A plain ``pip install NAME`` would look for NAME on PyPI.
"""

from __future__ import annotations

#: The distribution of each backend plugin recurra knows of (backend name -> distribution).
PLUGINS = {"vulkan": "recurra-vulkan"}


def install_command(requirement: str) -> str:
    """The command that installs ``requirement`` (``recurra-vulkan``, ``recurra-cli[models]``,
    or a third-party requirement such as ``matplotlib``) from a checkout of the repository."""
    quoted = f"'{requirement}'" if "[" in requirement else requirement
    if not requirement.startswith("recurra-"):
        return f"pip install {quoted}"
    return f"python tools/build_wheels.py --install {quoted}"


def install_hint(requirement: str) -> str:
    """``install_command`` with where to run it, for messages: "run `...` in a checkout of
    the recurra repository"."""
    cmd = install_command(requirement)
    if requirement.startswith("recurra-"):
        return f"run `{cmd}` in a checkout of the recurra repository"
    return f"run `{cmd}`"
