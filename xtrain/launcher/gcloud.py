"""``gcloud compute tpus tpu-vm`` (and ``queued-resources``): describe (a VM's workers, state,
type), create and delete.

Only the control plane goes through gcloud; every connection to a VM is direct OpenSSH
(xtrain/launcher/ssh.py), because ``gcloud ... ssh`` is flaky (exit 255) and slow. Calls go
through the launch's :class:`~xtrain.launcher.runner.Runner`.
"""

from __future__ import annotations

import json
import re
import tempfile
import time

from xtrain.errors import TargetUnready
from xtrain.launcher.runner import LaunchError, Result

# gcloud's words for "no capacity for this request right now": waiting and retrying can help. The
# TPU API's stockout reads "There is no more capacity in the zone "Z"; you can try in another
# zone where Cloud TPU Nodes are offered ..." (code 8, RESOURCE_EXHAUSTED).
NO_CAPACITY = ("RESOURCE_EXHAUSTED", "no more capacity", "insufficient capacity", "STOCKOUT",
               "ZONE_RESOURCE_POOL_EXHAUSTED", "does not have enough resources")
# A quota is RESOURCE_EXHAUSTED (HTTP 429) too, but no wait lifts it: "Quota limit
# 'TPUV6EPreemptiblePerProjectPerRegionForTPUAPI' has been exceeded. Limit: 0 in region
# us-east5.", "Quota 'TPUV4sPreemptiblePodPerProjectPerRegionForTPUAPI' exhausted.",
# QUOTA_EXCEEDED. Checked before NO_CAPACITY.
QUOTA = re.compile(r"quota limit|quota_exceeded|\bquota\b.*\b(exceeded|exhausted)\b",
                   re.IGNORECASE)
# ... except a rate quota ("... limit 'Create node requests per minute ...'"): the next minute
# lifts it, so it is retried like a stockout.
RATE_QUOTA = re.compile(r"\bper (second|minute)\b", re.IGNORECASE)
QUOTA_NAME = re.compile(r"\bquota(?: limit)? '([^']+)'", re.IGNORECASE)


# gcloud failing with no verdict on the request, in its error line: the API's server errors,
# its auth-token refresh ("There was a problem refreshing your current auth tokens"), the
# network, a call that timed out (xtrain/launcher/runner.py). A create or delete that failed so
# is asked again; not when gcloud needs a new login, which no wait gives it.
NO_VERDICT = re.compile(r"\b(UNAVAILABLE|INTERNAL|DEADLINE_EXCEEDED|ABORTED)\b|auth tokens|"
                        r"Connection (aborted|reset)|timed out after")
NEEDS_LOGIN = re.compile(r"Reauthentication|gcloud auth login")


# Waits before a launch's describe of its TPU asks gcloud again, when it did not answer.
DESCRIBE_RETRY_WAITS_S = (2.0, 8.0)


class NoCapacity(LaunchError):
    """A create refused because the zone has no capacity for it now: retrying later can help."""


class QuotaExceeded(LaunchError):
    """A create refused by the project's quota: no retry can help, only more quota (or another
    zone, region or accelerator type)."""


class NoVerdict(LaunchError):
    """A create or delete that gcloud failed with no verdict on it (:data:`NO_VERDICT`): asking
    again can help."""


def create_failure(stderr: str) -> type[LaunchError]:
    """The error a failed create's stderr calls for: QuotaExceeded, NoCapacity, NoVerdict or
    LaunchError."""
    if QUOTA.search(stderr):
        return NoCapacity if RATE_QUOTA.search(stderr) else QuotaExceeded
    if any(m.lower() in stderr.lower() for m in NO_CAPACITY):
        return NoCapacity
    return NoVerdict if no_verdict(stderr) else LaunchError


def no_verdict(stderr: str) -> bool:
    return bool(NO_VERDICT.search(_error_line(stderr) or "")) and not NEEDS_LOGIN.search(stderr)


class Gcloud:
    def __init__(self, runner, binary: str = "gcloud"):
        self.runner, self.binary = runner, binary

    def _argv(self, verb: str, name: str, zone: str, project: str | None, queued=False) -> list[str]:
        group = "queued-resources" if queued else "tpu-vm"
        argv = [self.binary, "compute", "tpus", group, verb, name, f"--zone={zone}"]
        return argv + ([f"--project={project}"] if project else [])

    def describe(self, name: str, zone: str, project: str | None = None) -> dict:
        """The TPU node resource (``networkEndpoints``, ``state``, ``acceleratorType``, ...) of a
        launch's target; TargetUnready when gcloud does not know it, or still cannot answer after
        the waits of :data:`DESCRIBE_RETRY_WAITS_S` (an auth-token refresh or a network blip
        must not refuse a launch, nor end a fleet's re-run on the VM it has just recreated)."""
        for wait in (*DESCRIBE_RETRY_WAITS_S, None):
            r = self._describe(name, zone, project)
            if r.ok or "NOT_FOUND" in r.stderr or wait is None:
                break
            time.sleep(wait)
        if not r.ok:
            raise TargetUnready(f"gcloud could not describe TPU {name!r} in {zone}: {_message(r)}")
        return _resource(r, name)

    def find(self, name: str, zone: str, project: str | None = None,
             queued: bool = False) -> dict | None:
        """The node (or queued resource), None when gcloud does not know it; LaunchError when
        gcloud cannot answer (its callers ask again)."""
        r = self._describe(name, zone, project, queued)
        if not r.ok:
            if "NOT_FOUND" in r.stderr:
                return None
            raise LaunchError(f"gcloud could not describe TPU {name!r} in {zone}: {_message(r)}")
        return _resource(r, name)

    def _describe(self, name: str, zone: str, project: str | None, queued: bool = False) -> Result:
        return self.runner.run(self._argv("describe", name, zone, project, queued) +
                               ["--format=json"], timeout=120, label="gcloud describe")

    def create(self, name: str, zone: str, hardware, project: str | None = None,
               spot: bool = True, queued: bool = False, ssh_key: str | None = None) -> None:
        """Create a TPU VM (or a queued resource whose node has the same name) of the profile's
        type and runtime; ``ssh_key`` (``user:public key``) goes into its ``ssh-keys`` metadata.
        Raises NoCapacity when the zone has none for it now, QuotaExceeded when the project's
        quota does not allow it."""
        kind = [f"--accelerator-type={hardware.accelerator_type}"]
        if queued:  # queued-resources takes --runtime-version and names its node with --node-id
            kind = [f"--node-id={name}", *kind, f"--runtime-version={hardware.runtime_version}"]
        else:
            kind.append(f"--version={hardware.runtime_version}")
        argv = self._argv("create", name, zone, project, queued) + kind + (["--spot"] if spot else [])
        with tempfile.NamedTemporaryFile("w", suffix=".ssh-keys") as keys:
            if ssh_key:  # from a file: gcloud splits --metadata values at commas
                keys.write(ssh_key + "\n")
                keys.flush()
                argv.append(f"--metadata-from-file=ssh-keys={keys.name}")
            r = self.runner.run(argv, timeout=1800, label="gcloud create")
        if not r.ok:
            error = create_failure(r.stderr)
            why = f"gcloud could not create TPU {name!r} in {zone}: {_message(r)}"
            if error is QuotaExceeded:
                quota = QUOTA_NAME.search(r.stderr)
                why += (f" (the project's {'quota ' + repr(quota.group(1)) if quota else 'quota'}"
                        " allows no such TPU there, and waiting will not change that: request "
                        "more quota (Google Cloud console, IAM & Admin > Quotas, service Cloud "
                        "TPU API), or use another zone or accelerator type)")
            raise error(why)

    def delete(self, name: str, zone: str, project: str | None = None, queued: bool = False) -> None:
        """Delete the VM (a queued resource with its node: --force)."""
        extra = ["--force", "--quiet"] if queued else ["--quiet"]
        r = self.runner.run(self._argv("delete", name, zone, project, queued) + extra,
                            timeout=1800, label="gcloud delete")
        if not r.ok and "NOT_FOUND" not in r.stderr:  # already gone is what was asked
            error = NoVerdict if no_verdict(r.stderr) else LaunchError
            raise error(f"gcloud could not delete TPU {name!r} in {zone}: {_message(r)}")


def _resource(r: Result, name: str) -> dict:
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError as e:
        raise LaunchError(f"gcloud describe {name}: unreadable output ({e})") from e


def _message(r: Result) -> str:
    return _error_line(r.stderr) or f"exit {r.returncode}"


def _error_line(stderr: str) -> str | None:
    """gcloud's own error line (``ERROR: (gcloud...) NOT_FOUND: ...``), else its last line."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or [None])[-1]
