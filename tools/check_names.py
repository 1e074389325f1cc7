#!/usr/bin/env python3
"""Asks PyPI whether the distribution names of this repository's packages are taken.

    python tools/check_names.py            # every package under packages/, and "recurra"
    python tools/check_names.py --index https://test.pypi.org

For each name it queries the index's JSON API (``<index>/pypi/<name>/json``): 404 means no
project of that name exists (free to register), 200 means someone published it (pip would
install theirs where ours is not found first). Exits 1 when a name is taken, 2 when the
index cannot be reached. Run it before the first release (README, "Releases").
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

from build_wheels import canon, discover_packages


def status(index: str, name: str, timeout: float) -> tuple[str, str]:
    """("free" | "taken" | "error", detail) for one name on the index."""
    url = f"{index.rstrip('/')}/pypi/{canon(name)}/json"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            info = json.load(resp).get("info", {})
            return "taken", f"{info.get('name')} {info.get('version')}: {info.get('summary')}"
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return "free", "no such project"
        return "error", f"HTTP {e.code} from {url}"
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        return "error", f"{url}: {e}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--index", default="https://pypi.org", help="the index (default: PyPI)")
    ap.add_argument("--timeout", type=float, default=10.0)
    args = ap.parse_args(argv)
    names = ["recurra"] + [p.name for p in discover_packages()]
    worst = 0
    for name in names:
        state, detail = status(args.index, name, args.timeout)
        print(f"{name:<16} {state:<6} {detail}")
        worst = max(worst, {"free": 0, "taken": 1, "error": 2}[state])
    return worst


if __name__ == "__main__":
    sys.exit(main())
