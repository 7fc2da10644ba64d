"""requirements.lock is the stack the tests run on: `make setup` installs through it (`pip install
-c`), and it covers everything pyproject.toml declares. The GCS tests depend on gcsfs's default
filesystem class, which changed between gcsfs releases: they assert the locked one."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.utils import canonicalize_name

from conftest import gcs_filesystem, use_gcs_emulator
from required_packages import declared_requirements

LOCK = Path(__file__).resolve().parent.parent / "requirements.lock"


def locked_versions(lock: Path = LOCK) -> dict[str, str]:
    """Canonical distribution name -> pinned version, from the lock's `name==version` lines."""
    pins = (re.match(r"([A-Za-z0-9._-]+)==(\S+)$", line) for line in lock.read_text().splitlines())
    return {canonicalize_name(m[1]): m[2] for m in pins if m}


def installed_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def test_every_locked_package_is_installed_at_its_locked_version():
    locked = locked_versions()
    assert len(locked) > 100, LOCK  # the whole stack, not a handful
    wrong = {name: (pin, installed_version(name)) for name, pin in locked.items()
             if installed_version(name) != pin}
    assert not wrong, f"(locked, installed) differ; run `make setup`: {wrong}"


def test_every_declared_dependency_is_locked_within_its_range():
    locked = locked_versions()
    stale = [str(req) for req in declared_requirements()
             if not req.specifier.contains(locked.get(canonicalize_name(req.name), "0.dev0"), prereleases=True)]
    assert not stale, f"pyproject.toml changed since the lock was made; run `make lock`: {stale}"


def test_gs_urls_get_the_default_class_of_the_locked_gcsfs(monkeypatch, tmp_path):
    import fsspec
    import gcsfs
    from gcsfs.extended_gcsfs import ExtendedGcsFileSystem

    assert gcsfs.__version__ == locked_versions()["gcsfs"]
    # the tests' emulator setup (tests/conftest.py) is written for this class; a lock that moves
    # gcsfs to a release with another default must revisit it
    assert gcsfs.GCSFileSystem is ExtendedGcsFileSystem
    use_gcs_emulator(monkeypatch, "http://127.0.0.1:9", tmp_path)  # nothing listens: no I/O here
    assert type(gcs_filesystem("gs://any")) is gcsfs.GCSFileSystem
    assert type(fsspec.filesystem("gs")) is gcsfs.GCSFileSystem
