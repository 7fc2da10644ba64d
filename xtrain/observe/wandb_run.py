"""The W&B logger: which mode (online only with a key, never W&B's interactive login prompt),
which run id (kept in the run dir), and the run itself, handed to Lightning's WandbLogger.

Lightning's WandbLogger logs metrics, text and the config; the run is started here rather than
by the logger because the logger's own start (``WandbLogger.experiment``) writes
``WANDB_MODE=dryrun`` into the process environment when offline, passes W&B's deprecated
``anonymous`` setting (a warning on every run) and leaves the login to W&B, which prompts for a
key on a terminal and raises without one. ``WandbLogger(experiment=run)`` is its documented way
to log to a run started elsewhere.
"""

from __future__ import annotations

import logging
import os
import re
import secrets

from xtrain.config import WandbMode
from xtrain.config.secrets import wandb_key
from xtrain.errors import ConfigError, EnvironmentMismatch
from xtrain.observe.bundle import mask_secrets
from xtrain.paths import url_to_fs

log = logging.getLogger(__name__)
RUN_ID_FILE = "wandb-run-id"  # in the run dir: the W&B run a resumed run continues
# set by the launcher (xtrain/launcher/launch.py) from the local job dir, which outlives the VM:
# a job re-run on a recreated VM (an empty run dir) continues the same W&B run
RUN_ID_ENV = "XTRAIN_WANDB_RUN_ID"
_OFFLINE_NAMES = ("offline", "dryrun")


def has_key(environ=os.environ) -> bool:
    """A W&B key without asking for one: WANDB_API_KEY, else one ``wandb login`` stored."""
    return wandb_key(environ) is not None


def required_mode(mode: WandbMode | str, environ=os.environ) -> tuple[WandbMode, str]:
    """The mode asked for (``auto`` follows WANDB_MODE when set) and who asked, for messages."""
    mode = WandbMode(mode)
    env_mode = environ.get("WANDB_MODE", "").strip().lower()
    if mode == WandbMode.auto and env_mode:
        if env_mode not in ("online", "run", *_OFFLINE_NAMES):
            raise ConfigError(f"WANDB_MODE={env_mode!r}: expected online or offline (or drop "
                              "logger=wandb to log without W&B)")
        return (WandbMode.offline if env_mode in _OFFLINE_NAMES else WandbMode.online,
                f"WANDB_MODE={env_mode}")
    return mode, f"logger.wandb.mode={mode.value}"


def choose_mode(mode: WandbMode | str, environ=os.environ) -> str:
    """``online`` or ``offline``. ``auto`` follows WANDB_MODE when set, else goes online only with
    a key. Online without a key is refused (W&B would prompt on a terminal, raise without one)."""
    mode, source = required_mode(mode, environ)
    if mode == WandbMode.offline:
        return "offline"
    if has_key(environ):
        return "online"
    if mode == WandbMode.online:
        raise ConfigError(f"{source} but no W&B key: export WANDB_API_KEY (never put it in a "
                          "config), or set logger.wandb.mode=offline")
    return "offline"


def run_id(run_dir: str, environ=os.environ, renew: bool = False) -> str:
    """The run dir's W&B run id, created on first use (or ``renew``ed: a run that starts over):
    the same for every restart of the run (a resumed run continues its W&B run), new once the
    run dir is gone. A launched job's id comes from its launcher (RUN_ID_ENV) and is written to
    the run dir; a launched job that starts over in a run dir that already used that id gets
    ``<id>-<random>`` (the launcher's id stays the job's, and later resumes keep the new one)."""
    fs, root = url_to_fs(f"{run_dir.rstrip('/')}/{RUN_ID_FILE}")
    given = environ.get(RUN_ID_ENV, "").strip()
    stored = fs.cat_file(root).decode().strip() if fs.exists(root) else ""
    ours = stored and (not given or stored == given or stored.startswith(f"{given}-"))
    if ours and not renew:
        return stored
    chosen = given or secrets.token_hex(6)  # W&B ids: lowercase letters, digits and "-"
    if given and ours:  # (W&B would continue the launcher's run with the steps drawn twice)
        chosen = f"{given}-{secrets.token_hex(3)}"
    fs.makedirs(root.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(root, chosen.encode())
    return chosen


def attempt_id(chosen: str, stored: str) -> str:
    """The W&B run id of this start: online, the run's stored id (W&B continues the run). Offline,
    an id of its own: each offline start writes its own files, and ``wandb sync`` of two with one
    id makes the later replace the earlier's history (W&B cannot join offline pieces:
    wandb/wandb#3841, #5865), so the pieces are separate runs of the run's group instead."""
    return stored if chosen == "online" else f"{stored}-{secrets.token_hex(3)}"


def describe_mode(chosen: str, mode: WandbMode | str, files: str, group: str,
                  environ=os.environ) -> str:
    """The one line a run prints about W&B."""
    if chosen == "online":
        return "W&B: online"
    why = ("WANDB_MODE=offline" if environ.get("WANDB_MODE") and WandbMode(mode) == WandbMode.auto
           else "logger.wandb.mode=offline" if WandbMode(mode) == WandbMode.offline
           else "no key: WANDB_API_KEY unset and none in ~/.netrc")
    return f"W&B: offline ({why}); {_sync_later(files, group)}"


def _sync_later(files: str, group: str) -> str:
    return (f"`wandb sync {files}/wandb/offline-run-*` uploads each start as its own run of group "
            f"{group!r} (charts by trainer/global_step join them)")


def wandb_logger(run_dir: str, local_dir: str, run_name: str, run_config: dict,
                 project: str = "xtrain", entity: str | None = None, group: str | None = None,
                 tags=(), mode: WandbMode | str = WandbMode.auto, git_root: str | None = None,
                 git_remote_url: str | None = None, start_step: int = 0):
    """Start (or continue) the run's W&B run and wrap it in Lightning's WandbLogger.
    ``run_config``: the resolved config with secrets masked (the W&B run's config). The run id is
    kept in ``run_dir`` (any fsspec URL); W&B writes its files under ``<local_dir>/wandb`` (W&B
    needs a local directory). Without ``group``, the run's starts are grouped under its name
    (offline starts are separate W&B runs: :func:`attempt_id`). ``git_root``: the code's git tree
    (None: no git facts); ``git_remote_url``: its remote, given so that W&B does not read one
    with a token in it. ``start_step``: the step training resumes from; 0, a start or a start
    over (killed before its first checkpoint), gets a new W&B run of the group, which W&B would
    otherwise continue with every step drawn twice."""
    from lightning.pytorch.loggers import WandbLogger

    chosen, group = choose_mode(mode), group or run_name
    log.info(describe_mode(chosen, mode, local_dir, group))
    os.makedirs(local_dir, exist_ok=True)
    # finish_previous: a run left open in this process (a sweep's earlier job that failed) is
    # finished, not continued (W&B's default outside notebooks returns it)
    git = {"git_root": git_root, "git_remote_url": git_remote_url, "disable_git": git_root is None}
    run = _start(chosen, mode, run_id(run_dir, renew=start_step == 0), git, project=project,
                 entity=entity, name=run_name, resume="allow", group=group,
                 tags=list(tags) or None, dir=local_dir, config=run_config,
                 reinit="finish_previous")
    # the x axis of every chart is the training step (WandbLogger logs it as trainer/global_step)
    run.define_metric("trainer/global_step")
    run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
    return WandbLogger(experiment=run, project=project, save_dir=local_dir)


def _start(chosen: str, mode: WandbMode | str, stored: str, git: dict, **init):
    """``wandb.init`` for this start. Online, a W&B that does not answer within its init timeout
    (WANDB_INIT_TIMEOUT, 90 s by default) raises CommError: with logger.wandb.mode=auto the start
    logs offline instead (an outage must not fail a resume, which the fleet does not re-run);
    with logger.wandb.mode=online (or WANDB_MODE=online) it is refused (exit 2): online was
    required, nothing ran. A key W&B refuses is refused whatever the mode: no wait mends it."""
    import wandb

    def start(chosen: str):
        # no code saving, whatever WANDB_SAVE_CODE or the account says: W&B would keep and
        # upload the checkout's diff unmasked (the run's repro/ keeps the code, masked)
        settings = wandb.Settings(mode=chosen, console="off", silent=True, save_code=False,
                                  disable_code=True, **git)
        return wandb.init(id=attempt_id(chosen, stored), settings=settings, **init)

    try:
        return start(chosen)
    except wandb.errors.CommError as e:
        if chosen != "online":
            raise
        where = wandb.setup().settings.base_url  # (W&B reads its environment once a process)
        said = mask_secrets(str(e).splitlines()[0] if str(e) else repr(e))
        # a key refused is no outage: waiting will not mend it (W&B raises a plain CommError
        # quoting the HTTP status when it is refused while asking for the run's resume status)
        if isinstance(e, wandb.errors.AuthenticationError) or re.search(r"\berror 40[13]\b", said):
            raise EnvironmentMismatch(f"W&B ({where}) refused the key ({said}): check "
                                      "WANDB_API_KEY (or `wandb login`)") from None
        why = f"W&B ({where}) could not start the run ({said})"
        required, source = required_mode(mode)
        if required == WandbMode.online:
            instead = "unset WANDB_MODE" if source.startswith("WANDB_MODE") else "set logger.wandb.mode=auto"
            raise EnvironmentMismatch(f"{source} but {why}: nothing was trained; retry when W&B "
                                      f"answers, or {instead} to log offline while it does not") from None
    log.warning(f"{why}: this start logs offline; "
                f"{_sync_later(init['dir'], init['group'])}")
    return start("offline")
