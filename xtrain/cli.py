"""``python -m xtrain``: the Hydra app. Composes the config groups, then hands the job to its mode
(xtrain/modes.py).

Refused input, whether Hydra's (an unknown option, key or choice, a wrong type) or xtrain's
(xtrain/errors.py: a value out of range, a missing path), ends with one line on stderr and exit
code 2 (EXIT_REFUSED); a failed remote launch with one line and exit code 1;
``HYDRA_FULL_ERROR=1`` shows a refusal's traceback too. A crash's traceback, Hydra's report of it or
the interpreter's, has secrets masked (xtrain/observe/console.py mask_stderr), as have refusals and
warnings. With ``hydra/launcher=tpu_vm|tpu_pod`` a single run is launched on the workers
(xtrain/launcher/), never trained here. Heavy libraries (torch, lightning, torch_xla) are imported
only once a mode needs them, so ``--help``, ``--cfg job``, tab completion, ``mode=plan`` and every
refusal stay fast.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import hydra
from omegaconf import DictConfig

from xtrain import compat
from xtrain.config import Mode, register
from xtrain.config.choices import check_composed, check_group_overrides
from xtrain.config.hydra_record import discard, writes_record
from xtrain.config.secrets import check_no_secret_overrides
from xtrain.errors import (EXIT_INTERRUPTED, EXIT_STOPPED, ConfigError, Terminated, is_refusal,
                           printed_masked, refuse)
from xtrain.observe.bundle import mask_secrets
from xtrain.observe.console import mask_stderr, masked_stderr
from xtrain.paths import PRIMARY_CONFIG, config_dir

compat.report_refusals(is_refusal, refuse, masked_stderr)
printed_masked(mask_secrets)
register()
CWD_BEFORE: set[str] = set()  # the working dir's entries before Hydra made a run dir there
# what a stop (Ctrl-C, SIGTERM) leaves, said after it: a training its checkpoints
AFTER_A_STOP = {"said": "; a run resumes from its last committed checkpoint"}


@hydra.main(version_base="1.3", config_path=config_dir(), config_name=PRIMARY_CONFIG)
def _main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from xtrain.launcher import is_remote

    hc = HydraConfig.get()
    remote = is_remote(hc.launcher)
    keeps_nothing = not remote and cfg.mode.keeps_nothing
    if not remote and cfg.mode != Mode.train:
        AFTER_A_STOP["said"] = f"; mode={cfg.mode.value} keeps nothing" if keeps_nothing else ""
    try:
        summary = _run_mode(cfg, hc, remote)
    except (KeyboardInterrupt, Terminated):
        if keeps_nothing:
            discard(hc.runtime.output_dir, CWD_BEFORE)
        raise
    if keeps_nothing:
        discard(hc.runtime.output_dir, CWD_BEFORE)
    if summary and summary.get("preempted"):
        sys.exit(EXIT_STOPPED)  # not finished; re-running the command resumes


def _run_mode(cfg: DictConfig, hc, remote: bool) -> dict | None:
    """The job of ``cfg.mode``, or its launch on the workers (``remote``); a refusal ends here in
    one line, the run dir Hydra made for it removed."""
    from xtrain.launcher import launch_from_hydra
    from xtrain.modes import run
    from xtrain.train.run_lock import RunDirInUse

    try:  # hydra/launcher=tpu_vm|tpu_pod: Hydra calls a launcher only with -m, so route it here
        check_composed(cfg, hc)
        summary = launch_from_hydra(cfg) if remote else run(cfg, hc.runtime.output_dir)
    except Exception as ex:  # noqa: BLE001  (refusals end here, in one line; the rest is raised)
        from xtrain.train.preemption import SIGTERM_RAISED

        if SIGTERM_RAISED.is_set():  # a stop the code it interrupted turned into another error
            said = " ".join(f"{type(ex).__name__}: {ex}".split())
            print(mask_secrets(f"xtrain: after the SIGTERM: {said}"), file=sys.stderr)
            raise Terminated() from ex
        if not is_refusal(ex):
            raise
        if not isinstance(ex, RunDirInUse):  # a refused command leaves no trace of its own
            discard(hc.runtime.output_dir, CWD_BEFORE)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        refuse(ex)
    return summary


def secondary_process_overrides(env=os.environ) -> list[str]:
    """Hydra overrides for a process other than the first of a multi-process run (RANK > 0, as
    torchrun and xtrain's launchers set it): it writes no Hydra files into the run directory the
    processes may share (no .hydra/ copy of the config, no log file; it logs to stdout). What a
    run writes is process 0's job; the overrides do not change the run's name."""
    if writes_record(env):
        return []
    return ["hydra.output_subdir=null", "hydra/job_logging=stdout"]


def hydra_options(args: list[str]) -> tuple[argparse.Namespace, list[str]] | None:
    """The command's options as Hydra reads them, and the arguments it would not read: with
    [hydra-core] Hydra's own parser (a private function), so that every spelling its argparse
    takes (``--cf job`` for ``--cfg job``, ``-cjob``, ``-rcjob`` for ``-r -c job``) is read here
    as Hydra will read it: the masking of a printed config and the checks below depend on it.
    None for ``--version``, which Hydra prints. A value the parser refuses is refused in one line
    (argparse's own error is its usage, many lines)."""
    import contextlib
    import io

    from hydra._internal.utils import get_args_parser

    said = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(said):
        try:
            return get_args_parser().parse_known_args(args)
        except SystemExit as ex:
            if not ex.code:
                return None
    raise ConfigError(said.getvalue().strip().splitlines()[-1].split("error: ", 1)[-1])


def check_hydra_options(options: argparse.Namespace, unread: list[str]) -> None:
    """Refuse Hydra's ``--experimental-rerun FILE``, which unpickles FILE (a run dir's
    config.pickle): any code a crafted file holds would run; more than one of Hydra's modes (two
    end in Hydra's ValueError and its traceback); and what Hydra's parser would not read."""
    if options.experimental_rerun is not None:
        raise ConfigError("--experimental-rerun: Hydra's re-run unpickles a file, which can run "
                          "code; not supported (run the command again: its overrides are in the "
                          "run dir's .hydra/overrides.yaml)")
    modes = sorted(option for dest, option in HYDRA_MODES.items() if getattr(options, dest))
    if len(modes) > 1:
        raise ConfigError(f"{' with '.join(modes)}: Hydra takes one of "
                          f"{', '.join(HYDRA_MODES.values())} per command (a sweep job's config: "
                          "--cfg job with that job's overrides, without -m)")
    if unread and unread[0].startswith("-"):
        raise ConfigError(f"{unread[0]}: not an option of Hydra's (--hydra-help lists them)")
    if unread:  # (argparse takes one run of positional arguments)
        raise ConfigError(f"{unread[0]}: Hydra reads the overrides as one run, which an option "
                          "(-m, --cfg, ...) ended: write the overrides together")


# Hydra's modes, one per command: its parser's destination and option
HYDRA_MODES = {"run": "--run", "multirun": "--multirun", "cfg": "--cfg", "info": "--info",
               "shell_completion": "--shell-completion"}


def enum_member(enums: dict) -> re.Pattern:
    """An enum field's value written as its member (``model.attention=Attention.chunked``), the
    form Hydra's completion shows, for ``enums`` (by name): OmegaConf reads it as the value, but
    a run's name is made of the overrides as written (xtrain/naming.py)."""
    return re.compile(rf"(?P<enum>{'|'.join(sorted(enums))})\.(?P<value>\w+)")


def config_enums() -> dict:
    """The enums of xtrain's config schema (defined in xtrain/config/), by name."""
    from enum import Enum

    return {e.__name__: e for e in Enum.__subclasses__()
            if e.__module__.startswith("xtrain.config")}


def check_plain_enum_values(args: list[str]) -> None:
    """Refuse an enum written as its member: ``model.attention=Attention.chunked`` would name
    another run than ``model.attention=chunked``, which would resume nothing of the other's."""
    enums = config_enums()
    pattern = enum_member(enums)
    for arg in args:
        key, _, value = arg.partition("=")
        member = pattern.fullmatch(value.strip("'\""))
        is_member = member and member["value"] in enums[member["enum"]].__members__
        if is_member and not key.startswith("-"):
            raise ConfigError(f"{arg}: write {key}={member['value']} (the run's name is made of the "
                              "overrides as written)")


def main() -> None:
    mask_stderr()  # (an exception leaving main, Hydra's report of the job's, a library's thread)
    try:
        read = hydra_options(sys.argv[1:])
        if read is not None:
            check_hydra_options(*read)
        check_plain_enum_values(sys.argv[1:])
        check_group_overrides(sys.argv[1:])
        check_no_secret_overrides(sys.argv[1:])
    except ConfigError as ex:
        refuse(ex)
    extra = secondary_process_overrides()  # beside the command's own: Hydra reads one run
    overrides = read[0].overrides if read else []
    at = sys.argv.index(overrides[0], 1) if overrides else 1
    sys.argv[at:at] = extra
    find_plugins()
    CWD_BEFORE.update(os.listdir())
    try:
        if read is not None and completion_query(read[0]):
            complete_without_bases()
        elif read is not None and prints_config(read[0]):
            print_config_masked()
        else:
            _main()
            exit_if_jobs_stopped()
    except KeyboardInterrupt:  # Ctrl-C outside training's own handling (xtrain/train/preemption.py)
        print(f"xtrain: interrupted (SIGINT){AFTER_A_STOP['said']}", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except Terminated:  # SIGTERM there (xtrain/train/preemption.py sigterm_raises)
        print(f"xtrain: stopped (SIGTERM) outside a training step{AFTER_A_STOP['said']}",
              file=sys.stderr)
        sys.exit(EXIT_STOPPED)


def exit_if_jobs_stopped() -> None:
    """A launched sweep whose jobs stopped before finishing ends as a stopped single run does:
    exit 143, so that a script can tell and run the same command to resume them."""
    from xtrain.launcher.hydra_jobs import STOPPED_JOBS

    if STOPPED_JOBS:
        print(f"xtrain: {len(STOPPED_JOBS)} job(s) of the sweep stopped before finishing ("
              + "; ".join(STOPPED_JOBS) + "): run the same command to resume them",
              file=sys.stderr)
        sys.exit(EXIT_STOPPED)


def find_plugins() -> None:
    """[hydra-core] Hydra instantiates a sweeper or launcher only from a class it finds by walking
    the directories of the ``hydra_plugins`` namespace on the path (an editable install's import
    hook is not walked). Outside ``make setup`` (a plain checkout, a job launched from its synced
    tree) launch/ is not on the path: put it there, so that ``-m`` finds xtrain's sweeper
    (conf/train.yaml's default). A wheel installs the plugins as a directory of their own."""
    from pathlib import Path

    launch = str(Path(__file__).resolve().parent.parent / "launch")
    if os.path.isdir(launch) and launch not in sys.path:
        sys.path.append(launch)


def completion_query(options: argparse.Namespace) -> bool:
    """Whether the command is Hydra's shell-completion query (``-sc query=bash``), as the function
    ``xtrain -sc install=bash`` installs runs it."""
    return options.shell_completion and any(o.startswith("query=") for o in options.overrides)


def prints_config(options: argparse.Namespace) -> bool:
    """Whether Hydra is to print the config or its info (``--cfg``, ``--info``, and ``--help``,
    whose page shows the config)."""
    return bool(options.cfg or options.info or options.help)


def print_config_masked() -> None:
    """Hydra's ``--cfg``/``--info``/``--help`` output with secrets masked
    (xtrain/observe/bundle.py): with ``--resolve`` it holds the values of ``${oc.env:...}``
    interpolations, such as ``hardware.env.HF_TOKEN``'s."""
    import contextlib
    import io

    from xtrain.observe.bundle import mask_secrets

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            _main()
    finally:  # (Hydra's help ends in sys.exit)
        print(mask_secrets(printed.getvalue()), end="")


def complete_without_bases() -> None:
    """[hydra-core] Hydra's completion offers every file of a group, the bases too
    (``hardware=_tpu``, refused as a choice by xtrain/config/choices.py): its answer without
    them. Hydra allows one completion plugin per shell, its own, so the answer is filtered here."""
    import contextlib
    import io

    from xtrain.observe.bundle import mask_secrets

    answer = io.StringIO()
    with contextlib.redirect_stdout(answer):
        _main()
    # bash: one line of words; fish: a word per line; an enum's value as written on a command
    # line (mode=train, not Hydra's mode=Mode.train)
    words = re.sub(r"(?<!\S)[+~]*[\w/.]+=_\S*\s?", "", answer.getvalue())
    words = re.sub(r"=" + enum_member(config_enums()).pattern, r"=\g<value>", words)
    print(mask_secrets(words), end="")  # a field's completion is its value, resolved
