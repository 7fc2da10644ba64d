"""Code sync: the checkout's git-tracked and untracked-not-ignored files, mirrored to a worker by
rsync over ssh. Incremental (rsync skips files whose size and mtime match), and exact: a file
deleted locally is deleted on the worker, so a removed module cannot linger there.

Never synced, whatever git says: .git, virtual environments, run outputs, caches, dotenv, key and
credential files (and folders such as .ssh and .aws), secret-named files (``WANDB_API_KEY.txt``;
not code or configs such as ``auth.py``), pickles, checkpoints and data formats (``ALWAYS_EXCLUDED``, matched
whatever the case); a file over ``max_file_mb`` (or files over ``max_total_mb`` together) is
refused before
anything is copied, because data does not belong in the code tree, and so is one whose text
holds a secret, whatever its name.
"""

from __future__ import annotations

import base64
import fnmatch
import json
import os
import re
import shlex
import tempfile
from pathlib import Path

from xtrain.config.secrets import forbidden_values, is_secret_name, secret_in_file
from xtrain.errors import ConfigError
from xtrain.launcher.runner import LaunchError
from xtrain.observe.bundle import SYNCED_CODE_RECORD, code_state, mask_secrets

# Matched against every component of a file's path (and so against whole directories).
ALWAYS_EXCLUDED = (
    ".git", ".venv", "venv", "__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache", ".cache",
    "node_modules", "outputs", "multirun", "wandb",
    ".env", ".env.*", "*.pem", "*.key", "*.p12", "id_rsa*", "id_ecdsa*", "id_ed25519*", ".netrc",
    "credentials*.json", "*service*account*.json", "*credentials*.json", "*key*.json",
    ".envrc", ".git-credentials", ".boto", ".pgpass", ".pypirc", ".npmrc", "*.env",
    ".ssh", ".aws", ".azure", ".kube", ".docker", ".gnupg", ".huggingface", ".config",
    "*.jks", "*.pfx", "*.keystore", "*.pkl", "*.pickle",
    "*.parquet", "*.arrow", "*.pt", "*.pth", "*.ckpt", "*.safetensors", "*.npy", "*.npz",
    "*.distcp", ".metadata", ".hydra", ".hydra-*", "lightning_logs",  # (.metadata: DCP's)
) + tuple(  # secret-named files (hf_token, secrets.yaml, db-password.txt), not code (secrets.py)
    f"*{word}{suffix}" for word in ("secret", "secrets", "token", "tokens", "password", "passwords",
                                    "api_key", "apikey", "credential", "credentials")
    for suffix in ("", ".json", ".yaml", ".yml", ".txt", ".toml", ".ini", ".cfg", ".conf"))
# A plain-text or suffix-less file named as a secret holds one (WANDB_API_KEY.txt, HF_TOKEN). Code,
# configs and docs may be named after what they handle (auth.py, key_value.yaml): their text is
# read for secrets instead (check_no_secrets), as a file left out would break the job.
SECRET_FILE_SUFFIXES = ("", ".txt")


def source_root(source: str | None) -> Path:
    """The checkout to sync: ``source``, else the one this xtrain is imported from."""
    root = Path(source).expanduser() if source else Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        raise ConfigError(f"{root} is not a git checkout: the launcher syncs a checkout's files "
                          "(set hydra.launcher.source=PATH)")
    return root.resolve()


def code_files(root: Path, runner, exclude=(), max_file_mb: float = 20.0,
               max_total_mb: float = 200.0) -> list[str]:
    """Relative paths to sync: tracked plus untracked-not-ignored, minus the exclusions."""
    r = runner.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                    "--exclude-standard"], label="git ls-files")
    if not r.ok:
        raise ConfigError(f"git ls-files failed in {root}: {r.stderr.strip()}")
    patterns = ALWAYS_EXCLUDED + tuple(exclude)
    files = []
    for rel in sorted(set(filter(None, r.stdout.split("\0")))):
        path = root / rel
        if not os.path.isfile(path) or excluded(rel, patterns):  # deleted but still in the index
            continue
        mb = path.stat().st_size / 2**20
        if mb > max_file_mb:
            raise ConfigError(f"{rel} is {mb:.0f} MB (hydra.launcher.max_file_mb={max_file_mb:g}): "
                              "data does not belong in the synced code; git-ignore it or add it "
                              "to hydra.launcher.exclude")
        files.append(rel)
    check_total(root, files, max_total_mb)
    check_no_secrets(root, files)
    return files


def check_total(root: Path, files: list[str], max_total_mb: float) -> None:
    """Refuse files that together outgrow ``max_total_mb``, naming the folders that hold most."""
    sizes = {rel: (root / rel).stat().st_size for rel in files}
    total = sum(sizes.values()) / 2**20
    if total <= max_total_mb:
        return
    by_folder: dict[str, int] = {}
    for rel, size in sizes.items():
        folder = rel.split("/", 1)[0] + "/" if "/" in rel else rel
        by_folder[folder] = by_folder.get(folder, 0) + size
    biggest = sorted(by_folder.items(), key=lambda kv: -kv[1])[:3]
    raise ConfigError(f"the files to sync come to {total:.0f} MB (hydra.launcher.max_total_mb="
                      f"{max_total_mb:g}), most in " + ", ".join(
                          f"{name} ({size / 2**20:.0f} MB)" for name, size in biggest)
                      + ": data does not belong in the synced code; git-ignore it or add it to "
                      "hydra.launcher.exclude")


def check_no_secrets(root: Path, files: list[str]) -> None:
    """Refuse to sync files that hold a secret (xtrain/config/secrets.py secret_in_file: a private
    key, a token, a secret-named variable set to a literal, this environment's secrets) whatever
    their names: every worker would get a copy."""
    known = forbidden_values()
    found = []
    for rel in files:
        why = secret_in_file((root / rel).read_bytes(), known)
        if why:
            found.append(f"{rel} ({why})")
    if found:
        raise ConfigError(f"{len(found)} file(s) to sync hold a secret: {'; '.join(found[:5])}"
                          f"{' ...' if len(found) > 5 else ''}; they would be copied to every "
                          "worker: move the secret into an environment variable "
                          "(hydra.launcher.secrets forwards it), or git-ignore the file or add it "
                          "to hydra.launcher.exclude")


def excluded(rel: str, patterns) -> bool:
    """Whether a pattern (``ALWAYS_EXCLUDED`` and hydra.launcher.exclude) matches a component of
    ``rel`` whatever the case (``Secrets.yaml``, made on a laptop whose file system ignores case),
    or the file is a plain-text one named as a secret (``WANDB_API_KEY.txt``, ``HF_TOKEN``,
    ``wandb_key.txt``: xtrain/config/secrets.py is_secret_name)."""
    path = Path(rel)
    if path.suffix.lower() in SECRET_FILE_SUFFIXES and is_secret_name(path.stem):
        return True
    return any(fnmatch.fnmatchcase(part.lower(), p.lower()) for part in path.parts for p in patterns)


def filter_rules(files: list[str]) -> str:
    """rsync filter rules that admit exactly ``files`` (and their directories). With
    --delete-excluded, anything else on the worker is deleted, except bytecode caches and the
    code record (send_code_record).
    rsync checks rules in order per file, so a tree of 10,000 files costs about a second."""
    dirs = sorted({str(p) for f in files for p in Path(f).parents if str(p) != "."})
    rules = (["P __pycache__/", f"P /{SYNCED_CODE_RECORD}"] + [f"+ /{_literal(d)}/" for d in dirs]
             + [f"+ /{_literal(f)}" for f in files] + ["- *"])
    return "\n".join(rules) + "\n"


def _literal(path: str) -> str:
    """``path`` as an rsync pattern that matches only itself. rsync takes a pattern holding any of
    ``*?[`` as a wildcard (``data[1].py`` would match ``data1.py`` and miss itself, so the file
    would be deleted on the worker), where a backslash escapes; others it matches literally."""
    if not any(c in path for c in "*?["):
        return path
    return re.sub(r"([\\*?\[])", r"\\\1", path)


MAX_CODE_DIFF = 2**20  # bytes of diff a launch sends to each worker; a bigger one is left out


def code_record(root: Path, files: list[str]) -> str:
    """The checkout's code_state for the workers, whose synced tree has no .git: its commit and
    changed files, and the diff of the synced ones (what the workers run; a file never synced may
    hold anything), masked as the bundle masks it, at most :data:`MAX_CODE_DIFF`; base64, the
    payload of :func:`send_code_record`, made once for every worker."""
    facts, diff = code_state(root, only=files)
    if len(diff) > MAX_CODE_DIFF:
        facts["diff_left_out"] = (f"{len(diff) / 2**20:.1f} MB, over the "
                                  f"{MAX_CODE_DIFF // 2**20} MB a launch sends")
        diff = ""
    record = json.dumps({"facts": mask_secrets(facts), "diff": mask_secrets(diff)})
    return base64.encodebytes(record.encode()).decode()


def send_code_record(ssh, host: str, dest: str, payload: str) -> None:
    """Write :func:`code_record`'s ``payload`` beside the synced code (after the sync, which
    deletes what it did not send; an unchanged one is left as it is)."""
    path = shlex.quote(f"{dest}/{SYNCED_CODE_RECORD}")
    r = ssh.run(host, f"set -e\nbase64 -d > {path}.tmp <<'END'\n{payload}END\n"
                f"if cmp -s {path}.tmp {path}; then rm {path}.tmp; else mv {path}.tmp {path}; fi\n",
                "code record")
    if not r.ok:
        raise LaunchError(f"{host}: could not write {path}: {r.stderr.strip()[-500:]}")


def sync(ssh, host: str, root: Path, files: list[str], dest: str) -> list[str]:
    """Mirror ``files`` of ``root`` into ``dest`` on ``host``; returns the files rsync sent."""
    with tempfile.NamedTemporaryFile("w", suffix=".rsync-filter") as rules:
        rules.write(filter_rules(files))
        rules.flush()
        argv = ["rsync", "-rlpt", "--delete", "--delete-excluded", "--itemize-changes",
                f"--filter=merge {rules.name}", "-e", ssh.rsh(), f"{root}/",
                f"{ssh.destination(host)}:{dest}/"]
        result = ssh.retrying(host, lambda: ssh.runner.run(argv, timeout=1800, label="sync"),
                              rerunnable=True)
    if not result.ok:
        raise LaunchError(f"{host}: rsync failed (exit {result.returncode}): "
                          f"{result.stderr.strip()[-500:]}")
    # --itemize-changes: "<f+++++++++ path" for a file sent, "*deleting path" for a removal
    return [line.split(" ", 1)[1] for line in result.stdout.splitlines() if line.startswith("<f")]
