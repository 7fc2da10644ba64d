"""OpenSSH, configured once for every remote call of a launch.

Host keys live in a known_hosts file xtrain owns: a new host is accepted on first contact
(``StrictHostKeyChecking=accept-new``), a changed key is refused with the address and the opt-in
``hydra.launcher.rekey=true`` (never ``StrictHostKeyChecking=no``, which MaxText's and Levanter's
launch scripts use). No agent forwarding. Keepalives notice a dead link; connection failures
(refused, timed out, reset) are retried with exponential backoff, because a freshly created or
restarted TPU VM refuses connections for a while. One connection per host is reused
(ControlMaster): a relaunch makes about five calls per worker.

Scripts run as ``bash -s`` with the script on stdin, so nothing of them (secrets in particular)
appears on a command line that ``ps`` shows, locally or remotely.
"""

from __future__ import annotations

import fcntl
import getpass
import hashlib
import os
import shlex
import stat
import subprocess
import tempfile
import time

from xtrain.errors import ConfigError
from xtrain.launcher.runner import TIMED_OUT, LaunchError, Result

# ssh's own messages (stderr) for a connection that could not be made or was cut: worth a retry.
CONNECTION_FAILURES = ("connection refused", "timed out", "no route to host", "network is unreachable",
                       "connection reset", "connection closed", "kex_exchange_identification",
                       "broken pipe", "connection unexpectedly closed", "could not resolve hostname",
                       "temporary failure in name resolution")
# ...except a name the resolver answered does not exist (EAI_NONAME): no retry brings it into being.
# "Temporary failure in name resolution" (EAI_AGAIN: the resolver did not answer) is retried.
UNKNOWN_NAME = "name or service not known"
HOST_KEY_CHANGED = "REMOTE HOST IDENTIFICATION HAS CHANGED"


def login_refused(result: Result) -> bool:
    """ssh reached the host, which refused the key."""
    return result.returncode == 255 and "Permission denied" in result.stderr


def unreachable(result: Result) -> bool:
    """ssh (or rsync over it) did not reach the host: refused, timed out, reset, unresolved."""
    lowered = result.stderr.lower()
    return result.returncode in (255, 12, TIMED_OUT) and any(s in lowered for s in CONNECTION_FAILURES)


def check_identity(cfg) -> None:
    """The launcher's ``identity_file`` exists (a missing key is refused before any VM is looked
    up or connection made)."""
    if not os.path.isfile(os.path.expanduser(cfg.identity_file)):
        raise ConfigError(f"hydra.launcher.identity_file={cfg.identity_file}: no such file "
                          "(gcloud creates ~/.ssh/google_compute_engine on its first "
                          "`gcloud compute tpus tpu-vm ssh`)")


def private_dir(path: str) -> str:
    """Make ``path`` (0700) and check that this user alone owns it and can write to its parent.
    ssh hands a session's stdin, which carries a job's secrets, to whatever listens at its
    ControlPath without asking whose it is, and the path under the shared temp dir is known."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    for where, open_bits in ((os.path.dirname(path), 0o022), (path, 0o077)):
        st = os.lstat(where)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & open_bits:
            raise ConfigError(
                f"{where}, the directory of ssh's shared connections, is not this user's alone "
                f"({stat.filemode(st.st_mode)}, owner uid {st.st_uid}): remove it, or set "
                "hydra.launcher.multiplex=false")
    return path


# A socket's path holds at most 103 bytes on macOS (107 on Linux); ssh binds a master's socket
# at its ControlPath plus 17 characters (a temporary name), and %C is 40
SOCKET_PATH_MAX = 103
CONTROL_PATH_TAIL = len("/xtrain-ssh-/0123456789/") + 40 + 17


def socket_base() -> str:
    """Where the shared connections' sockets go: the temp dir, or /tmp when the temp dir's path
    is too long for them (macOS's per-user $TMPDIR is about 50 characters)."""
    base = tempfile.gettempdir()
    if len(base) + len(str(os.getuid())) + CONTROL_PATH_TAIL > SOCKET_PATH_MAX:
        return "/tmp"
    return base


def ssh_option(key: str, value: str) -> str:
    """``-oKey=value``, the value in double quotes when it holds whitespace or a quote: ssh splits
    an option's value into words (``UserKnownHostsFile`` takes several files, so a path with a
    space in it would silently become two)."""
    if not any(c.isspace() or c in "'\"\\" for c in value):
        return f"-o{key}={value}"
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'-o{key}="{escaped}"'


class Ssh:
    def __init__(self, cfg, runner, log=print):
        self.cfg, self.runner, self.log = cfg, runner, log
        self.user = cfg.user or getpass.getuser()
        self.identity = os.path.expanduser(cfg.identity_file)
        self.known_hosts = os.path.expanduser(cfg.known_hosts)
        self._rekeyed: set[str] = set()

    def check_local(self) -> None:
        """Refuse a missing key before any connection; create xtrain's known_hosts directory."""
        check_identity(self.cfg)
        os.makedirs(os.path.dirname(self.known_hosts) or ".", mode=0o700, exist_ok=True)

    def authorized_key(self) -> str:
        """``user:public key`` for a new VM's ``ssh-keys`` metadata: a VM xtrain creates knows the
        keys of the project's metadata and of its own, and gcloud put this one in the old VM's own
        (its first ``tpu-vm ssh``), which went with it."""
        public = self.identity + ".pub"
        if os.path.isfile(public):
            with open(public) as f:
                key = f.read().strip()
        else:  # the public half derived from the private key (one without a passphrase)
            r = self.runner.run(["ssh-keygen", "-y", "-f", self.identity], timeout=30,
                                label="ssh-keygen")
            if not r.ok:  # its last line says why (a key file open to others: a banner first)
                why = (r.stderr.strip().splitlines() or ["no reason given"])[-1]
                raise ConfigError(f"hydra.launcher.identity_file={self.cfg.identity_file}: no "
                                  f"{public}, and ssh-keygen could not derive it: {why}")
            key = r.stdout.strip()
        return f"{self.user}:{key}"

    def options(self) -> list[str]:
        cfg = self.cfg
        opts = {
            "BatchMode": "yes",  # never prompt: a launch runs unattended
            "IdentitiesOnly": "yes",
            "StrictHostKeyChecking": "accept-new",
            "UserKnownHostsFile": self.known_hosts,
            "HashKnownHosts": "no",  # xtrain's file stays readable: which address has which key
            "ConnectTimeout": str(cfg.connect_timeout_s),
            "ServerAliveInterval": str(cfg.keepalive_s),
            "ServerAliveCountMax": "4",
            "ForwardAgent": "no",
            "ForwardX11": "no",
            "LogLevel": "ERROR",  # keeps "Permanently added ..." out of job output; errors still show
        }
        if cfg.multiplex:
            # %C hashes host, port and user; the directory adds the key and known_hosts, so a
            # connection verified against one trust store is never reused for another
            trust = hashlib.sha256(f"{self.identity}\0{self.known_hosts}".encode()).hexdigest()
            control_dir = private_dir(os.path.join(
                socket_base(), f"xtrain-ssh-{os.getuid()}", trust[:10]))
            opts.update(ControlMaster="auto", ControlPath=os.path.join(control_dir, "%C"),
                        ControlPersist="120")
        return ["-i", self.identity, "-p", str(cfg.port)] + [ssh_option(k, v) for k, v in opts.items()]

    def destination(self, host: str) -> str:
        return f"{self.user}@{host}"

    def rsh(self) -> str:
        """The ssh command for ``rsync -e``."""
        return shlex.join(["ssh", *self.options()])

    def run(self, host: str, script: str, label: str, timeout: float | None = 300) -> Result:
        """Run a bash script on ``host`` (retried on connection failures); returns its result,
        whatever its exit code."""
        argv = ["ssh", *self.options(), self.destination(host), "bash -s"]
        return self.retrying(host, lambda: self.runner.run(argv, input=script, timeout=timeout,
                                                           label=label))

    def try_login(self, host: str) -> str:
        """One login attempt, not retried: "ok", "refused" (the key), "unreachable" (a connection
        failure) or "failed" (anything else: a changed host key, ...)."""
        r = self.runner.run(["ssh", *self.options(), self.destination(host), "true"], timeout=60,
                            label="login")
        if r.ok:
            return "ok"
        return "refused" if login_refused(r) else "unreachable" if unreachable(r) else "failed"

    def stream(self, host: str, command: str, label: str):
        """A long-running remote command (no secrets in it) whose output is read as it comes."""
        return self.runner.stream(["ssh", *self.options(), self.destination(host), command], label)

    def hold(self, host: str, command: str, label: str):
        """A remote command (no secrets in it) that lives while its stdin, a pipe the caller
        holds, stays open: closed by the caller or by the caller's end, whatever that is."""
        return self.runner.stream(["ssh", *self.options(), self.destination(host), command], label,
                                  stdin=subprocess.PIPE)

    def retrying(self, host: str, attempt, rerunnable: bool = False) -> Result:
        """Call ``attempt()`` (an ssh or rsync invocation) until it reaches the host; one that
        outlasted its time limit too when ``rerunnable`` (rsync goes on where it stopped)."""
        tries = self.cfg.retries + 1
        for i in range(tries):
            result = attempt()
            reason = self.connection_failure(host, result, rerunnable)
            if reason == "rekeyed":  # the old key is gone: the same call records the new one
                result = attempt()
                reason = self.connection_failure(host, result, rerunnable)
            if reason is None:
                return result
            if i + 1 < tries:
                wait = self.cfg.backoff_s * 2 ** i
                self.log(f"launch: {host}: {reason}; retrying in {wait:g} s")
                time.sleep(wait)
        raise LaunchError(f"{host}:{self.cfg.port} unreachable after {tries} attempts: {reason}")

    def connection_failure(self, host: str, result: Result, rerunnable: bool = False) -> str | None:
        """None when the remote side ran (any exit code); otherwise why the connection failed.
        A changed host key or a refused login raise: retrying cannot fix them; so does a command
        past its time limit, unless ``rerunnable``."""
        err = result.stderr
        if HOST_KEY_CHANGED in err or "Host key verification failed" in err:
            return self._host_key_changed(host)
        if login_refused(result):
            raise ConfigError(f"{self.destination(host)}: login refused for key {self.identity} "
                              "(hydra.launcher.user / identity_file; gcloud pushes its key on the "
                              "first `gcloud compute tpus tpu-vm ssh`)")
        if result.returncode == 255 and UNKNOWN_NAME in err.lower():
            raise ConfigError(f"{host}: no such host ({err.strip().splitlines()[-1]}); check "
                              "hydra.launcher.hosts")
        if result.returncode == TIMED_OUT and not rerunnable:  # (it ran: not run again)
            raise LaunchError(f"{host}: the remote command did not end: "
                              f"{err.strip().splitlines()[-1]} (not retried: it ran)")
        if unreachable(result):
            return err.strip().splitlines()[-1] if err.strip() else f"exit {result.returncode}"
        if result.returncode == 255:
            raise LaunchError(f"{host}: ssh failed: {err.strip() or 'exit 255'}")
        return None

    def _entry(self, host: str) -> str:
        return host if self.cfg.port == 22 else f"[{host}]:{self.cfg.port}"

    def _host_key_changed(self, host: str) -> str:
        entry = self._entry(host)
        if not self.cfg.rekey or host in self._rekeyed:
            raise ConfigError(
                f"{entry}: host key changed since it was recorded in {self.known_hosts} (a "
                "recreated VM, or someone in between); refused. If the VM was recreated, accept "
                "its new key with hydra.launcher.rekey=true")
        self._rekeyed.add(host)
        self._remove_key(entry, "rekey")
        self.log(f"launch: {entry}: host key changed; old key removed (hydra.launcher.rekey=true)")
        return "rekeyed"

    def _remove_key(self, entry: str, label: str) -> None:
        """Remove ``entry``'s key from known_hosts. ssh-keygen -R rewrites the file whole (read,
        write a copy, rename): two at once lose one's removal, so each holds a lock file (a
        flock is per opening: it keeps out this launch's other workers' threads too)."""
        if not os.path.exists(self.known_hosts):
            return
        with open(f"{self.known_hosts}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            result = self.runner.run(["ssh-keygen", "-R", entry, "-f", self.known_hosts], label=label)
        if result.returncode != 0:
            raise LaunchError(f"{entry}: its old host key could not be removed from "
                              f"{self.known_hosts}: {result.stderr.strip() or result.returncode}")

    def forget(self, host: str) -> None:
        """A VM xtrain itself deleted and recreated: drop the address's recorded key (the new VM
        has a new one, accepted on first contact) and close the connection kept open to the old
        VM, which would otherwise be reused without checking the new key."""
        self._remove_key(self._entry(host), "forget host key")
        if self.cfg.multiplex:
            self.runner.run(["ssh", *self.options(), "-O", "exit", self.destination(host)],
                            timeout=30, label="close connection")
