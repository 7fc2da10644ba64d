"""The launcher's schema: every field of ``hydra/launcher=tpu_vm|tpu_pod``, documented once here.

The Hydra plugin (``launch/hydra_plugins/xtrain_launchers/``) subclasses it only to add Hydra's
``_target_`` and the ``kind``; override any field as ``hydra.launcher.<field>=...``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xtrain.limits import limits


@dataclass
class LauncherConfig:
    """Where a job runs (a TPU VM, a pod's workers, explicit hosts, or a pool of VMs) and how it
    gets there: SSH, code sync, the worker's venv, job control, spot recreation."""

    # vm (hydra/launcher=tpu_vm: one host) | pod (tpu_pod: every worker of a slice)
    kind: str = "vm"

    # Targets: a TPU VM resolved by `gcloud compute tpus tpu-vm describe`, or explicit hosts.
    tpu: str | None = None  # TPU VM name
    zone: str | None = None  # its zone, e.g. asia-northeast1-b (required with tpu)
    project: str | None = None  # gcloud project; None: gcloud's configured default
    # the address ssh uses: external (accessConfig.externalIp) | internal (ipAddress, in the VPC)
    address: str = "external"
    hosts: list[str] = field(default_factory=list)  # explicit worker addresses, worker 0 first

    # SSH (OpenSSH; launch/README.md says why not a Python SSH library)
    user: str | None = None  # remote user; None: the local user name (the one gcloud uses)
    port: int = limits(22, ge=1, le=65535)
    identity_file: str = "~/.ssh/google_compute_engine"  # the key gcloud pushes to TPU VMs
    # xtrain's own known_hosts: a new host is accepted on first contact, a changed key refused
    known_hosts: str = "~/.config/xtrain/known_hosts"
    rekey: bool = False  # accept a changed host key (a recreated VM): its old entry is removed
    connect_timeout_s: int = limits(20, ge=1)  # ssh's ConnectTimeout
    # further attempts after a connection failure (refused, timed out, reset)
    retries: int = limits(4, ge=0)
    # wait before the first retry, doubled for each further one
    backoff_s: float = limits(2.0, ge=0)
    # ServerAliveInterval; 4 unanswered keepalives drop the connection
    keepalive_s: int = limits(15, ge=1)
    multiplex: bool = True  # one ssh connection per host, reused by a launch's calls

    # Remote layout and Python environment
    # per-worker root holding code/, venv/, jobs/, runs/ (relative: to the home directory);
    # '{host}' becomes the worker's address
    remote_dir: str = "~/xtrain"
    venv: str | None = None  # the environment jobs run in; None: <remote_dir>/venv
    base_python: str | None = None  # creates the venv; None: python<hardware.python>
    # make the venv match the profile's pins + xtrain's dependencies (pip, skipped when its
    # stamp matches); false: an environment managed by hand, only verified
    install: bool = True
    pip_args: list[str] = field(default_factory=list)  # extra `pip install` arguments
    # extra environment of the job; it lands in the job's run script, so never put secrets here
    env: dict[str, str] = field(default_factory=dict)
    # variable names forwarded from the local environment like WANDB_API_KEY and HF_TOKEN
    secrets: list[str] = field(default_factory=list)

    # Code sync
    source: str | None = None  # the git checkout to sync; None: the one xtrain runs from
    exclude: list[str] = field(default_factory=list)  # more glob patterns never synced
    # a bigger file is refused: data does not belong in the code
    max_file_mb: float = limits(20.0, gt=0)
    # files to sync bigger than this together are refused too (many small data files)
    max_total_mb: float = limits(200.0, gt=0)

    # Job control
    # MASTER_PORT; MASTER_ADDR is worker 0's internal address
    coordinator_port: int = limits(29500, ge=1, le=65535)
    # SIGTERM, then SIGKILL after this long (kill -9 can leave the TPU runtime broken)
    stop_grace_s: float = limits(60.0, ge=0)
    # libtpu's lock (TPU profiles only): removed before a start when no process holds it
    tpu_lockfile: str = "/tmp/libtpu_lockfile"
    # stop this job on its workers (SIGTERM: it checkpoints and exits 143) instead of running it
    stop: bool = False
    # how long a launch (or a stop) waits for another launch placing a job on the same worker
    # (its launch lock, xtrain/launcher/worker.py); then that worker refuses
    lock_wait_s: float = limits(1800.0, gt=0, le=604800)  # (a week: flock's timer takes no more)

    # Spot fleet (xtrain/launcher/fleet.py, pool.py). With `tpu` or `pool`, a job whose stream or
    # connection ends is judged by the VM's state in gcloud: not READY is a preemption.
    # delete and recreate a preempted VM (accelerator_type and runtime_version of the hardware
    # profile), set it up again and re-run the job, which resumes from its newest committed
    # checkpoint; needs checkpoint.dir=gs://... (a recreated VM starts with an empty disk)
    recreate: bool = False
    # preemptions one job may survive (each re-runs it); then it fails. A stop for a GCE notice
    # on a VM that stayed up counts as one (xtrain/launcher/fleet.py, NoticeStop)
    max_recreates: int = limits(3, ge=0)
    spot: bool = True  # create VMs with --spot
    # the VM is the node of a queued resource of the same name (gcloud compute tpus
    # queued-resources): its state is the queued resource's (SUSPENDED: preempted), and it is
    # recreated as a queued resource
    queued: bool = False
    # a recreation (delete, create with capacity retries, wait for READY) that takes longer fails
    ready_timeout_s: float = limits(3600.0, gt=0)
    # after a job stopped for a GCE notice on a VM that stayed up, the VM takes no job while
    # gcloud shows its maintenance under way or its window open or near (a window lasts hours),
    # this long at most (xtrain/launcher/vm.py, Vm.wait_out_maintenance); it also bounds the
    # wait for a node whose health says maintenance while it is being brought back (Vm.restore)
    maintenance_wait_s: float = limits(21600.0, ge=0)
    # wait after "no capacity", doubled each time, at most 16x
    capacity_backoff_s: float = limits(60.0, gt=0)
    poll_s: float = limits(15.0, gt=0)  # between gcloud describes while waiting for a VM
    # a VM just created may refuse logins (its guest agent writes the ssh-keys metadata after
    # READY) or not answer them (sshd starting) this long before the launch goes on; 0: no wait
    login_grace_s: float = limits(180.0, ge=0)
    # single-host TPU VMs (names, in `zone`) a multirun's jobs are spread over: one job per VM at
    # a time, the next job to the first free VM; a preempted VM's job is requeued
    pool: list[str] = field(default_factory=list)
