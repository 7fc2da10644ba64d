"""``gcloud compute tpus tpu-vm``: describe (a VM's workers, state, type), create and delete.

Only the control plane goes through gcloud; every connection to a VM is direct OpenSSH
(xtrain/launcher/ssh.py), because ``gcloud ... ssh`` is flaky (exit 255) and slow. Calls go
through the launch's :class:`~xtrain.launcher.runner.Runner`.
"""

from __future__ import annotations

import json

from xtrain.errors import ConfigError
from xtrain.launcher.runner import LaunchError, Result


class Gcloud:
    def __init__(self, runner, binary: str = "gcloud"):
        self.runner, self.binary = runner, binary

    def _tpu_vm(self, verb: str, name: str, zone: str, project: str | None) -> list[str]:
        argv = [self.binary, "compute", "tpus", "tpu-vm", verb, name, f"--zone={zone}"]
        return argv + ([f"--project={project}"] if project else [])

    def describe(self, name: str, zone: str, project: str | None = None) -> dict:
        """The TPU node resource (``networkEndpoints``, ``state``, ``acceleratorType``, ...)."""
        r = self.runner.run(self._tpu_vm("describe", name, zone, project) + ["--format=json"],
                            timeout=120, label="gcloud describe")
        if not r.ok:
            raise ConfigError(f"gcloud could not describe TPU {name!r} in {zone}: {_message(r)}")
        try:
            return json.loads(r.stdout)
        except json.JSONDecodeError as e:
            raise LaunchError(f"gcloud describe {name}: unreadable output ({e})") from e

    def create(self, name: str, zone: str, hardware, project: str | None = None,
               spot: bool = True) -> None:
        """Create a TPU VM of the profile's type and runtime (the spot fleet's building block)."""
        argv = self._tpu_vm("create", name, zone, project) + [
            f"--accelerator-type={hardware.accelerator_type}",
            f"--version={hardware.runtime_version}"] + (["--spot"] if spot else [])
        r = self.runner.run(argv, timeout=1800, label="gcloud create")
        if not r.ok:
            raise LaunchError(f"gcloud could not create TPU {name!r} in {zone}: {_message(r)}")

    def delete(self, name: str, zone: str, project: str | None = None) -> None:
        r = self.runner.run(self._tpu_vm("delete", name, zone, project) + ["--quiet"],
                            timeout=1800, label="gcloud delete")
        if not r.ok:
            raise LaunchError(f"gcloud could not delete TPU {name!r} in {zone}: {_message(r)}")


def _message(r: Result) -> str:
    """gcloud's own error line (``ERROR: (gcloud...) NOT_FOUND: ...``), else its last line."""
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or [f"exit {r.returncode}"])[-1]
