"""Runs on a worker, inside the job's Python: ``python -m xtrain.launcher.envcheck REQ...`` prints,
as a JSON list, why each requirement is not satisfied (empty: all are). Standard library plus
``packaging`` (pip's vendored copy when the package is absent), so it works in a fresh venv."""

from __future__ import annotations

import json
import sys
from importlib import metadata

try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv has pip but not packaging
    from pip._vendor.packaging.requirements import Requirement


def problems(requirements: list[str]) -> list[str]:
    out = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue  # not for this platform
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            out.append(f"{req.name} is not installed (wanted {text})")
            continue
        # PEP 440: ==2.9.1 also accepts a local build such as 2.9.1+cpu
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            out.append(f"{req.name} {version} is installed, wanted {req.specifier}")
    return out


if __name__ == "__main__":
    print(json.dumps(problems(sys.argv[1:])))
