"""Which machines a job runs on: explicit ``hosts`` or a TPU VM's workers from gcloud, checked
against the hardware profile before anything is copied."""

from __future__ import annotations

from dataclasses import dataclass

from xtrain.errors import ConfigError, TargetUnready


@dataclass(frozen=True)
class Target:
    index: int  # worker index (0 coordinates: MASTER_ADDR, rank 0)
    host: str  # the address ssh connects to
    internal: str  # the address other workers reach it on


TARGET_REQUIRED = ("hydra.launcher.tpu=NAME (with zone) or hydra.launcher.hosts=[ADDRESS, ...] is "
                   "required (or, for sweeps on several VMs, hydra.launcher.pool=[NAME, ...])")


def resolve_targets(cfg, hardware, gcloud) -> list[Target]:
    """The job's workers, in worker order; refuses a launcher/profile mismatch first."""
    if cfg.kind not in ("vm", "pod"):
        raise ConfigError(f"hydra.launcher.kind={cfg.kind!r}: expected vm or pod")
    if cfg.kind == "vm" and hardware.hosts > 1:
        raise ConfigError(f"hardware={hardware.name} spans {hardware.hosts} hosts (a pod): use "
                          "hydra/launcher=tpu_pod, which runs the job on every worker")
    if bool(cfg.hosts) == bool(cfg.tpu):
        raise ConfigError("hydra.launcher: give either tpu (with zone) or hosts, not both"
                          if cfg.hosts else TARGET_REQUIRED)
    if cfg.hosts:
        targets = [Target(i, h, h) for i, h in enumerate(cfg.hosts)]
        where = "hydra.launcher.hosts"
    else:
        if not cfg.zone:
            raise ConfigError(f"hydra.launcher.tpu={cfg.tpu} needs hydra.launcher.zone")
        node = gcloud.describe(cfg.tpu, cfg.zone, cfg.project)
        targets = node_targets(node, cfg.address, hardware)
        where = f"TPU {cfg.tpu}"
    if len(targets) != hardware.hosts:
        raise ConfigError(f"{where} has {len(targets)} host(s), hardware={hardware.name} expects "
                          f"{hardware.hosts}")
    return targets


def node_targets(node: dict, address: str, hardware) -> list[Target]:
    """Workers of a described TPU node; refuses a VM that is not READY or not the profile's type."""
    name = node.get("name", "?").rsplit("/", 1)[-1]
    state = node_state(node)
    if state == MAINTENANCE:
        raise TargetUnready(f"TPU {name} is READY but under maintenance (health {MAINTENANCE}): it "
                          "resumes once rescheduled; launch again then")
    if state != "READY":
        raise TargetUnready(f"TPU {name} is {state}, not READY (a preempted spot VM must be deleted "
                          "and recreated)")
    check_type(node, hardware, f"TPU {name}")
    if address not in ("external", "internal"):
        raise ConfigError(f"hydra.launcher.address={address!r}: expected external or internal")
    targets = []
    for i, endpoint in enumerate(node.get("networkEndpoints", [])):
        internal = endpoint.get("ipAddress")
        external = endpoint.get("accessConfig", {}).get("externalIp")
        host = internal if address == "internal" else external
        if not host:
            raise ConfigError(f"TPU {name} worker {i} has no {address} address (created with "
                              "--internal-ips? use hydra.launcher.address=internal from the VPC)")
        targets.append(Target(i, host, internal or host))
    return targets


# TPU API v2 Node.health: "under maintenance/priority boost caused rescheduling and will resume
# running once rescheduled", while the node's state may still say READY.
MAINTENANCE = "UNHEALTHY_MAINTENANCE"


def node_state(node: dict) -> str:
    """A described node's state, UNHEALTHY_MAINTENANCE in place of READY while its health says so
    (not yet usable, back by itself)."""
    state = node.get("state", "UNKNOWN")
    return MAINTENANCE if state == "READY" and node.get("health") == MAINTENANCE else state


# TPU API v2 AcceleratorConfig.Type -> the chip name in a profile's ``topology`` (v6e:2x2).
CONFIG_TYPES = {"V2": "v2", "V3": "v3", "V4": "v4", "V5LITE_POD": "v5e", "V5P": "v5p", "V6E": "v6e"}


def check_type(node: dict, hardware, what: str) -> None:
    """Refuse a node (or a queued resource's node spec) of another type than the profile's. A node
    created with ``--accelerator-type`` has ``acceleratorType`` (v6e-4); one created with
    ``--type``/``--topology`` may carry only ``acceleratorConfig`` {type: V6E, topology: 2x2},
    compared with the profile's ``topology``. What the node does not say is not refused."""
    kind = node.get("acceleratorType", "").rsplit("/", 1)[-1]
    if kind:
        if hardware.accelerator_type and kind != hardware.accelerator_type:
            raise ConfigError(f"{what} is a {kind}, hardware={hardware.name} is a "
                              f"{hardware.accelerator_type}")
        return
    config = node.get("acceleratorConfig") or {}
    chip, topology = CONFIG_TYPES.get(config.get("type", "")), config.get("topology")
    wanted = getattr(hardware, "topology", None)
    if chip and topology and wanted and f"{chip}:{topology}" != wanted:
        raise ConfigError(f"{what} is a {config['type']} {topology} (acceleratorConfig), "
                          f"hardware={hardware.name} is a {hardware.accelerator_type or 'TPU'} "
                          f"({wanted})")
