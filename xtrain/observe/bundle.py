"""The reproducibility bundle every run leaves in ``<run dir>/repro/step_<start step>/`` (one per
start, so a resumed run keeps the record of each process that trained it):

- ``config.yaml``: the resolved config, secrets masked;
- ``code.json`` and ``code.diff``: the git commit, changed and untracked files, and
  ``git diff HEAD`` of the source tree that ran; outside a git tree, the installed version;
- ``packages.txt``: every installed distribution, ``name==version``;
- ``devices.json``: engine, mesh and devices, host facts;
- ``env.json``: the environment variables that shape a run (runtime, XLA, W&B, ...), secrets
  masked.

:func:`mask_secrets` is also what the W&B and TensorBoard loggers receive as the config.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from xtrain.config.secrets import (PRIVATE_KEY, SECRET_VALUE, is_secret_name, mask_assigned,
                                   mask_private_keys, secret_values)
from xtrain.paths import url_to_fs

MASK = "***"
ENV_PREFIXES = ("XLA_", "PJRT_", "TPU_", "LIBTPU", "JAX_", "CPU_NUM_DEVICES", "WANDB_", "XTRAIN_",
                "OMP_", "MKL_", "TORCH", "PYTORCH", "CUDA_", "GCSFS_", "STORAGE_EMULATOR_HOST",
                "GOOGLE_", "CLOUDSDK_", "HYDRA_", "PYTHONPATH", "PYTHONHASHSEED", "HF_")

def mask_secrets(obj, environ=os.environ, key: str = ""):
    """A copy of nested dicts/lists (or a string) with secrets replaced by ``***``: values under
    secret-looking keys, wherever a string holds the value of a secret environment variable,
    values of a secret's form (:data:`SECRET_VALUE`) and, in text, private keys' blocks and
    literals a secret-named variable or key is set to (``export HF_TOKEN=...`` in a diff)."""
    secrets = secret_values(environ)

    def walk(x, name):
        if isinstance(x, dict):
            return {k: walk(v, str(k)) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v, name) for v in x]
        if isinstance(x, str):
            if x and is_secret_name(name):
                return MASK
            x = mask_private_keys(x, MASK)  # (a diff's key file, whole)
            for secret in secrets:
                x = x.replace(secret, MASK)
            x = SECRET_VALUE.sub(lambda m: "://" + MASK + "@" if m[0].startswith("://") else MASK, x)
            x = mask_assigned(x, MASK)  # (a diff's api_key: 1a2b...)
        return x

    return walk(obj, key)


def relevant_env(environ=os.environ) -> dict[str, str]:
    chosen = {k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES)}
    return mask_secrets(chosen, environ)


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          errors="replace", timeout=30, check=True).stdout  # (any file's bytes)


def source_git_root(source: Path | None = None) -> Path | None:
    """The git work tree holding xtrain's source, or None (an installed package)."""
    source = source or Path(__file__).resolve().parents[1]
    try:
        return Path(_git(source, "rev-parse", "--show-toplevel").strip())
    except (OSError, subprocess.SubprocessError):
        return None


def git_remote_url(root: Path) -> str | None:
    """The URL of the git tree's ``origin`` without its user and password (either can be a token;
    W&B's own capture of it keeps the user), or None."""
    try:
        url = _git(root, "remote", "get-url", "origin").strip()
    except (OSError, subprocess.SubprocessError):
        return None
    try:
        parts = urlsplit(url)  # (git@host:path, scp-like, has no netloc and no password to drop)
    except ValueError:  # malformed (an unclosed IPv6 bracket): nothing W&B could record either
        return None
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])) if parts.netloc else url


# Beside the code a launcher synced (without .git): the launching checkout's code_state, masked
# (xtrain/launcher/sync.py send_code_record), so a launched run records which code it ran.
SYNCED_CODE_RECORD = ".xtrain-code.json"


def code_state(source: Path | None = None, only: list[str] | None = None) -> tuple[dict, str]:
    """(facts, diff) of the code that runs: in code a launcher synced, those of the checkout it
    synced from (that checkout's git tree is not this one); in a git tree its commit, changed and
    untracked files and ``git diff HEAD`` (of the paths ``only`` names, when given); the installed
    version otherwise."""
    tree = (source or Path(__file__).resolve().parents[1]).resolve()
    synced = next((p / SYNCED_CODE_RECORD for p in (tree, tree.parent)  # the package's tree
                   if (p / SYNCED_CODE_RECORD).is_file()), None)
    if synced is not None:
        try:
            record = json.loads(synced.read_text())
            return {**record["facts"], "synced_to": str(synced.parent)}, record["diff"]
        except (OSError, ValueError, KeyError, TypeError) as e:  # a write cut short
            return {"git": None, "synced_to": str(synced.parent), "unreadable": str(e)[-300:]}, ""
    root = source_git_root(source)
    if root is None:
        try:
            version = metadata.version("xtrain")
        except metadata.PackageNotFoundError:
            version = "unknown"
        return {"git": False, "installed_version": version,
                "location": str(Path(__file__).resolve().parents[1])}, ""
    try:
        return _git_state(root, only)
    except (OSError, ValueError, subprocess.SubprocessError) as e:  # no commit yet, a hung git
        return {"git": True, "root": str(root), "commit": None, "unreadable": str(e)[-300:]}, ""


def _git_state(root: Path, only: list[str] | None) -> tuple[dict, str]:
    status = _git(root, "status", "--porcelain").splitlines()
    keys = _changed_key_files(root)
    facts = {"git": True, "root": str(root), "commit": _git(root, "rev-parse", "HEAD").strip(),
             "dirty": bool(status), "changed": [s[3:] for s in status if not s.startswith("??")],
             "untracked": [s[3:] for s in status if s.startswith("??")], "diff_omits": keys}
    if only is None:
        paths = ["."]
    else:
        changed = _git(root, "diff", "HEAD", "--name-only", "-z").split("\0")
        paths = [f":(literal){n}" for n in sorted(set(changed) & set(only))]
    if not paths:
        return facts, ""
    return facts, _git(root, "diff", "HEAD", "--", *paths,
                       *(f":(exclude,literal){k}" for k in keys))


def _changed_key_files(root: Path) -> list[str]:
    """The changed files that hold a private key, in the work tree or at HEAD: code.diff leaves
    them out, as a hunk may show a key's middle lines only, without the header that masking finds
    a key's body by (config/secrets.py mask_private_keys)."""
    changed = [n for n in _git(root, "diff", "HEAD", "--name-only", "-z").split("\0") if n]
    found = set()
    for where in (["HEAD"], []):  # (git grep exits 1 when it finds nothing)
        if changed:
            listed = subprocess.run(["git", "-C", str(root), "grep", "-lzE", "-e", PRIVATE_KEY.pattern,
                                     *where, "--", *changed], capture_output=True, text=True,
                                     errors="replace", timeout=30)
            found |= {n.removeprefix("HEAD:") for n in listed.stdout.split("\0") if n}
    return sorted(found)


CODE_PACKAGES = ("torch", "lightning", "torch_xla")  # what computes the step and its gradients


def code_fingerprint() -> dict:
    """What the processes of one run must share to train as one model: xtrain's own source (a
    digest of every file of the package) and the versions of Python and of what computes the step.
    A process started from another checkout, or a host with another torch, trains another model."""
    import hashlib
    import platform

    from xtrain.compat import installed_versions

    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return {"xtrain source": digest.hexdigest()[:16], "python": ".".join(platform.python_version_tuple()[:2]),
            **installed_versions(CODE_PACKAGES)}


def installed_packages() -> list[str]:
    found = {(d.metadata["Name"] or "?").lower(): d.version for d in metadata.distributions()}
    return [f"{name}=={version}" for name, version in sorted(found.items())]


def host_facts() -> dict:
    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine()}


def write_bundle(run_dir: str, start_step: int, config: dict, devices: dict) -> str:
    """Write the bundle; returns its directory. ``config`` is the resolved config (masked here),
    ``devices`` the engine's description (mesh, device list)."""
    from omegaconf import OmegaConf

    where = f"{run_dir.rstrip('/')}/repro/step_{start_step:06d}"
    fs, root = url_to_fs(where)
    fs.makedirs(root, exist_ok=True)
    facts, diff = code_state()
    files = {
        "config.yaml": OmegaConf.to_yaml(OmegaConf.create(mask_secrets(config))),
        "code.json": json.dumps(facts, indent=2),
        "code.diff": mask_secrets(diff),
        "packages.txt": "\n".join(installed_packages()) + "\n",
        "devices.json": json.dumps({**devices, "host": host_facts()}, indent=2, default=str),
        "env.json": json.dumps(relevant_env(), indent=2),
    }
    for name, text in files.items():
        fs.pipe_file(f"{root}/{name}", text.encode())
    return where
