"""The launchers' local half, without SSH: the Hydra plugin, targets from gcloud, the code file
list, the environment's requirements and check, the remote command. gcloud is the stand-in from
tests/sshd.py (a real gcloud cannot reach Google Cloud here); everything else is real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.sshd import gcloud, git_tree, tpu_node  # noqa: F401  (gcloud is a fixture)
from xtrain.errors import ConfigError
from xtrain.launcher.config import LauncherConfig
from xtrain.launcher.envcheck import problems
from xtrain.launcher.gcloud import Gcloud
from xtrain.launcher.runner import Runner
from xtrain.launcher.sync import code_files, filter_rules
from xtrain.launcher.targets import resolve_targets

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch"


def cli_env(**extra) -> dict:
    """`python -m xtrain` of this checkout with the plugin importable (packaging installs it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(LAUNCH)]), **extra)
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def launcher(**fields):
    return OmegaConf.structured(LauncherConfig(**fields))


def hardware(compose_config, name: str, *overrides):
    return compose_config([f"hardware={name}", *overrides]).hardware


def test_a_command_is_the_same_whatever_the_order_of_its_distinct_overrides():
    """A relaunch (after a Ctrl-C, to reattach) may type the overrides in another order: the same
    config, so the same command (it was refused as "other overrides"). Where the order changes
    the config (one key twice, a key and one inside it) it still tells two commands apart."""
    from types import SimpleNamespace

    from xtrain.launcher.job import command_digest
    from xtrain.launcher.launch import remote_command

    worker = SimpleNamespace(venv="/w/venv", root="/w")

    def digest(*overrides):
        return command_digest(remote_command(worker, list(overrides), "cc", "cc"))

    assert digest("trainer.max_steps=9", "checkpoint.every=2", "model=d2") == \
        digest("model=d2", "checkpoint.every=2", "trainer.max_steps=9")
    assert digest("trainer.max_steps=9") != digest("trainer.max_steps=8")
    assert digest("optim.matrix_lr=0.1", "optim.matrix_lr=0.2") != digest("optim.matrix_lr=0.2", "optim.matrix_lr=0.1")
    assert digest("+hardware.env.X=1", "hardware.env={X: 2}") != digest("hardware.env={X: 2}", "+hardware.env.X=1")


def test_plugin_is_listed_and_composes(tmp_path):
    info = subprocess.run([sys.executable, "-m", "xtrain", "--info", "plugins"], env=cli_env(),
                          capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    assert "XtrainLauncher" in info.stdout.split("Launcher:")[1].split("Sweeper:")[0]
    cfg = subprocess.run([sys.executable, "-m", "xtrain", "--cfg", "hydra", "hydra/launcher=tpu_pod",
                          "hydra.launcher.hosts=[10.0.0.1,10.0.0.2]", "hydra.launcher.stop_grace_s=5"],
                         env=cli_env(), capture_output=True, text=True, timeout=120)
    assert cfg.returncode == 0, cfg.stderr
    node = OmegaConf.create(cfg.stdout.split("# @package")[0] if "# @package" in cfg.stdout
                            else cfg.stdout).hydra.launcher
    assert node.kind == "pod" and list(node.hosts) == ["10.0.0.1", "10.0.0.2"]
    assert node.stop_grace_s == 5 and node._target_.endswith("XtrainLauncher")
    from xtrain.launcher import is_remote

    assert is_remote(node)
    assert not is_remote(OmegaConf.create({"_target_": "hydra._internal.core_plugins.basic_launcher"
                                                       ".BasicLauncher"}))


def test_a_misspelt_launcher_field_is_refused():
    r = subprocess.run([sys.executable, "-m", "xtrain", "--cfg", "hydra", "hydra/launcher=tpu_vm",
                        "hydra.launcher.zonee=x"], env=cli_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "zonee" in r.stderr


@pytest.mark.parametrize("sweep", [False, True])
def test_a_config_from_elsewhere_is_refused_before_a_launch(tmp_path, sweep):
    """The workers compose conf/train.yaml from the synced conf/ with the job's overrides: a job
    composed from another primary config or another config dir would train something else there.
    Refused before any worker is reached (the host is one nothing listens on), leaving nothing."""
    import shutil

    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "ablation.yaml").write_text("defaults:\n  - train\n  - _self_\n"
                                                    "optim:\n  matrix_lr: 0.05\n")
    shutil.copytree(ROOT / "conf", tmp_path / "copy")
    cwd = tmp_path / "work"
    cwd.mkdir()
    (tmp_path / "key").write_text("")  # a placeholder: no connection is made
    launch = ["hydra/launcher=tpu_vm", "hydra.launcher.hosts=[127.0.0.1]", "hydra.launcher.port=9",
              "hydra.launcher.retries=0", f"hydra.launcher.identity_file={tmp_path / 'key'}",
              "optim.embedding_lr=0.1,0.2" if sweep else "optim.embedding_lr=0.1"]

    def launched(*chosen):
        return subprocess.run([sys.executable, "-m", "xtrain", *(["-m"] if sweep else []), *chosen,
                               *launch], cwd=cwd, env=cli_env(), capture_output=True, text=True,
                              timeout=120)

    conf = tmp_path / "conf"
    for chosen, named in ([["--config-dir", str(conf), "--config-name", "ablation"],
                           f"--config-name=ablation, configs from {conf}:"],
                          [["--config-dir", str(conf)], f"configs from {conf}:"],
                          [["--config-path", str(tmp_path / "copy")], f"configs from {tmp_path / 'copy'}:"],
                          [[f"hydra.searchpath=[file://{conf}]"], f"configs from {conf}:"]):
        r = launched(*chosen)
        assert r.returncode == 2, r.stderr
        assert named in r.stderr and "choose it with +experiment=<name>" in r.stderr
        assert r.stderr.count("\n") == 1 and not list(cwd.iterdir())
    # conf/train.yaml spelled otherwise is conf/train.yaml: the launch goes on, takes its record
    # and fails on the host nothing listens on; it gives its record back (a single run's goes)
    r = launched("--config-name", "train.yaml")
    assert r.returncode == 1 and "127.0.0.1:9 unreachable" in r.stderr, r.stderr
    assert not list(cwd.rglob(".hydra-held-*")), sorted(cwd.rglob("*"))
    assert len(list(cwd.rglob(".hydra-pending"))) == 1 if sweep else not list(cwd.iterdir())


def test_targets_from_gcloud_describe(gcloud, compose_config):
    gcloud.add(tpu_node("pod", "us-central2-b", "v4-32",
                        [(f"10.0.0.{i}", f"34.1.1.{i}") for i in range(4)]))
    hw = hardware(compose_config, "v4_32")
    external = resolve_targets(launcher(kind="pod", tpu="pod", zone="us-central2-b"), hw,
                               Gcloud(Runner()))
    assert [t.host for t in external] == [f"34.1.1.{i}" for i in range(4)]
    assert [t.internal for t in external] == [f"10.0.0.{i}" for i in range(4)]  # MASTER_ADDR
    internal = resolve_targets(launcher(kind="pod", tpu="pod", zone="us-central2-b",
                                        address="internal", project="p1"), hw, Gcloud(Runner()))
    assert [t.host for t in internal] == [f"10.0.0.{i}" for i in range(4)]
    assert gcloud.calls()[-1] == ["compute", "tpus", "tpu-vm", "describe", "pod",
                                  "--zone=us-central2-b", "--project=p1", "--format=json"]


@pytest.mark.parametrize("case, expected", [
    ("unknown", "NOT_FOUND: Resource 'projects/xtrain-test/locations/asia-northeast1-b/nodes/nope'"),
    ("count", "TPU two has 2 host(s), hardware=v6e4 expects 1"),
    ("preempted", "TPU gone is PREEMPTED, not READY"),
    ("type", "TPU small is a v6e-1, hardware=v6e4 is a v6e-4"),
])
def test_bad_tpu_targets_are_refused_with_the_reason(gcloud, compose_config, case, expected):
    zone = "asia-northeast1-b"
    gcloud.add(tpu_node("two", zone, "v6e-4", [("10.0.0.2", "34.0.0.2"), ("10.0.0.3", "34.0.0.3")]))
    gcloud.add(tpu_node("gone", zone, "v6e-4", [("10.0.0.2", "34.0.0.2")], state="PREEMPTED"))
    gcloud.add(tpu_node("small", zone, "v6e-1", [("10.0.0.2", "34.0.0.2")]))
    name = {"unknown": "nope", "count": "two", "preempted": "gone", "type": "small"}[case]
    with pytest.raises(ConfigError) as e:
        resolve_targets(launcher(tpu=name, zone=zone), hardware(compose_config, "v6e4"),
                        Gcloud(Runner()))
    assert expected in str(e.value)


def test_gcloud_creates_and_deletes_a_vm_of_the_profile(gcloud, compose_config):
    """The spot fleet's building blocks: create a VM of the profile's type and runtime, delete it."""
    cloud = Gcloud(Runner())
    hw = hardware(compose_config, "v6e4")
    cloud.create("fresh", "asia-northeast1-b", hw)
    assert gcloud.calls()[-1] == ["compute", "tpus", "tpu-vm", "create", "fresh",
                                  "--zone=asia-northeast1-b", "--accelerator-type=v6e-4",
                                  "--version=v2-alpha-tpuv6e", "--spot"]
    node = cloud.describe("fresh", "asia-northeast1-b")
    assert (node["state"], node["acceleratorType"]) == ("READY", "v6e-4")
    cloud.delete("fresh", "asia-northeast1-b")
    assert gcloud.calls()[-1][3:] == ["delete", "fresh", "--zone=asia-northeast1-b", "--quiet"]
    with pytest.raises(ConfigError, match="NOT_FOUND"):
        cloud.describe("fresh", "asia-northeast1-b")


def test_a_pod_profile_needs_tpu_pod(compose_config):
    with pytest.raises(ConfigError, match="spans 4 hosts.*hydra/launcher=tpu_pod"):
        resolve_targets(launcher(hosts=["a", "b", "c", "d"]), hardware(compose_config, "v4_32"),
                        None)
    with pytest.raises(ConfigError, match="has 3 host.*expects 4"):
        resolve_targets(launcher(kind="pod", hosts=["a", "b", "c"]),
                        hardware(compose_config, "v4_32"), None)
    with pytest.raises(ConfigError, match="tpu=NAME"):
        resolve_targets(launcher(), hardware(compose_config, "v6e4"), None)


def test_code_files_are_tracked_and_untracked_not_ignored_minus_secrets_and_data(tmp_path):
    root = git_tree(tmp_path / "repo")
    assert code_files(root, Runner()) == [".gitignore", "new_untracked.py", "pkg/mod.py"]
    secret = ["secrets.yaml", "prod.env", "hf_token", "token.txt", "api_key.txt", "db-password.txt",
              ".aws/credentials", ".ssh/config", ".kube/config", ".docker/config.json",
              ".huggingface/token", "cache.pkl", "ckpt/step_1/tensors/__0_0.distcp",
              "ckpt/step_1/tensors/.metadata", "outputs2/.hydra/config.yaml",
              "old/.hydra-pending/config.yaml", "store.jks",
              # names that say secret in another case or form
              "WANDB_API_KEY.txt", "Secrets.yaml", "HF_TOKEN", "wandb_key.txt", "conf/.ENV"]
    code = ["pkg/secrets.py", "pkg/tokenizer.py", "conf/tokenizer.yaml", "pkg/passwords_check.py",
            "pkg/auth.py", "docs/key_points.md", "conf/Tokenizer.yaml", "conf/model/key_value.yaml",
            "conf/data/token_stream.yaml", "scripts/auth.sh", "src/key.cpp"]  # (their text is read)
    for rel in secret + code:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x\n")
    files = code_files(root, Runner())
    assert files == sorted([".gitignore", "new_untracked.py", "pkg/mod.py", *code])
    assert code_files(root, Runner(), exclude=["new_*"]) == [f for f in files if f != "new_untracked.py"]
    rules = filter_rules(files)
    assert "+ /pkg/\n" in rules and "+ /pkg/mod.py\n" in rules and rules.endswith("- *\n")


def test_the_code_record_a_launch_sends_is_the_checkouts_state_masked(tmp_path, monkeypatch):
    """The workers get no .git: the launcher sends its checkout's commit and the diff of the files
    it syncs, and the bundle's code.json of the synced tree reads them (before any git tree
    around it). A secret in that diff (a line removed from a file, which the sync's own check of
    the files cannot see) is masked before it leaves; a file that is not synced sends no diff
    (it may hold anything); a diff over MAX_CODE_DIFF is left out, said in the facts."""
    import base64
    import json

    from xtrain.launcher import sync
    from xtrain.observe.bundle import SYNCED_CODE_RECORD, code_state

    def record(files) -> dict:
        return json.loads(base64.b64decode(sync.code_record(root, files)))

    root = git_tree(tmp_path / "repo")
    commit = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    leaked = "0f1e2d3c4b5a6978" + "8796a5b4c3d2e1f0a1b2c3d4"  # (in pieces: this file is synced)
    (root / "pkg/run.sh").write_text(f"export WANDB_API_KEY={leaked}\necho go\n")
    (root / "notes.txt").write_text("kept out\n")
    subprocess.run(["git", "-C", str(root), "add", "pkg/run.sh", "notes.txt"], check=True)
    subprocess.run(commit + ["commit", "-qm", "init"], check=True)
    (root / "pkg/run.sh").write_text("echo go\n")  # the key removed: only the diff still has it
    (root / "notes.txt").write_text(f"db password {leaked}\n")  # never synced: excluded below
    files = code_files(root, Runner(), exclude=["notes.txt"])
    sent = record(files)
    assert leaked not in json.dumps(sent) and "notes.txt" not in sent["diff"]
    synced = tmp_path / "worker-code"
    (synced / "xtrain").mkdir(parents=True)
    (synced / SYNCED_CODE_RECORD).write_text(json.dumps(sent))
    subprocess.run(["git", "init", "-q", str(synced)], check=True)  # a git tree around it: not it
    facts, diff = code_state(synced / "xtrain")
    head = subprocess.run(commit + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert facts["git"] and facts["commit"] == head.strip() and facts["dirty"]
    assert facts["changed"] == ["notes.txt", "pkg/run.sh"] and facts["synced_to"] == str(synced)
    assert "-export WANDB_API_KEY=***" in diff and "+echo go" not in diff  # (the line unchanged)
    assert code_state(tmp_path / "elsewhere")[0]["git"] is False  # no record there either
    monkeypatch.setattr(sync, "MAX_CODE_DIFF", 100)
    big = record(files)
    assert big["diff"] == "" and big["facts"]["diff_left_out"].endswith("a launch sends")


def test_a_checkout_without_a_commit_records_no_commit_instead_of_failing(tmp_path):
    from xtrain.observe.bundle import SYNCED_CODE_RECORD, code_state

    root = git_tree(tmp_path / "repo")  # files added, nothing committed
    facts, diff = code_state(root, only=["pkg/mod.py"])
    assert facts["git"] and facts["commit"] is None and "HEAD" in facts["unreadable"]
    assert diff == ""
    # committed, then changed into bytes that are not UTF-8: the diff still reads
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com",
                    "commit", "-qm", "init"], check=True)
    (root / "pkg/mod.py").write_bytes(b"# caf\xe9\nx = 2\n")
    facts, diff = code_state(root, only=["pkg/mod.py"])
    assert facts["changed"] == ["pkg/mod.py"] and "+x = 2" in diff
    # a code record cut short on a worker: said, not raised at the run's start
    (tmp_path / "synced" / "xtrain").mkdir(parents=True)
    (tmp_path / "synced" / SYNCED_CODE_RECORD).write_text('{"facts": {"git": tr')
    facts, diff = code_state(tmp_path / "synced" / "xtrain")
    assert facts["git"] is None and facts["unreadable"] and diff == ""


@pytest.mark.parametrize("rel, text, why", [
    # a service account key as Google names its download (private key shortened; key headers are
    # spelled in pieces, as this file is synced too)
    ("my-project-1a2b3c4d5e6f.json", '{"type": "service_account", "project_id": "p",\n'
     ' "private_key": "-----BEGIN ' + 'PRIVATE KEY-----\\nMIIEvQ\\n-----END PRIVATE KEY-----\\n"}\n',
     "a private key"),
    ("deploy/host", "-----BEGIN OPENSSH " + "PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjE\n", "a private key"),
    ("run_tpu.sh", "#!/bin/bash\nexport WANDB_API_KEY=0f1e2d3c4b5a69788796a5b4c3d2e1f0a1b2c3d4\n",
     "WANDB_API_KEY set to a literal"),
    ("conf/private.yaml", "model: d4\napi_key: '9a8b7c6d5e4f3a2b1c0d'  # prod\n", "api_key set to a literal"),
    ("notes.bak", "pip install --index-url https://ci:" + "pw4ever@pypi.example.com/simple x\n",
     "a value of a secret's form"),
    ("pkg/env_copy.py", "# HOME_TOKEN_VALUE\n", "the value of a secret environment variable"),
    ("train.py", 'import wandb\nwandb.login(key="' + '0f1e2d3c4b5a69788796a5b4c3d2e1f0a1b2c3d4")\n',
     "key set to a literal"),
    ("card.json", '{"model": "d4", "hf_token": "' + '9a8b7c6d5e4f3a2b1c0d"}\n', "hf_token set to a literal"),
])
def test_a_file_whose_text_holds_a_secret_is_refused_whatever_its_name(tmp_path, monkeypatch, rel,
                                                                      text, why):
    root = git_tree(tmp_path / "repo")
    monkeypatch.setenv("HOME_TOKEN", "HOME_TOKEN_VALUE")
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)
    with pytest.raises(ConfigError) as e:
        code_files(root, Runner())
    assert str(e.value).startswith(f"1 file(s) to sync hold a secret: {rel} ({why}")
    assert "hydra.launcher.exclude" in str(e.value)
    for secret in ("MIIEvQ", "b3BlbnNzaC1rZXktdjE", "0f1e2d3c", "9a8b7c6d", "pw4ever", "HOME_TOKEN_VALUE"):
        assert secret not in str(e.value)
    assert rel not in code_files(root, Runner(), exclude=[Path(rel).name])


def test_a_secret_a_launch_forwards_or_written_in_utf16_is_not_synced(tmp_path, monkeypatch):
    """A variable hydra.launcher.secrets forwards is a secret whatever its name (HF_LOGIN): a file
    holding its value is not synced once the launch collected it. A file of UTF-16 text
    (PowerShell 5 writes it) is read as text; a file with NUL bytes and no byte-order mark still
    has this environment's secrets looked for, in UTF-8 and UTF-16."""
    from xtrain.config.secrets import SECRET_NAMES_VAR
    from xtrain.launcher import secrets

    login = "Zq7mK2pX" + "9vL4nR8tY3wB6cF1"  # (in pieces: this file is synced too)
    monkeypatch.setenv("HF_LOGIN", login)
    monkeypatch.setenv(SECRET_NAMES_VAR, "")  # (restored after the test: collect adds to it)
    monkeypatch.setenv("HOME", str(tmp_path))  # no key of `wandb login` in ~/.netrc
    for name in secrets.ALWAYS:
        monkeypatch.delenv(name, raising=False)
    root = git_tree(tmp_path / "repo")
    (root / "setup_env.sh").write_text(f"export HF_LOGIN={login}\n")
    assert "setup_env.sh" in code_files(root, Runner())  # (nothing says HF_LOGIN is a secret yet)
    secrets.collect(["HF_LOGIN"])
    with pytest.raises(ConfigError, match=r"^1 file\(s\) to sync hold a secret: setup_env.sh \(the "
                                          "value of a secret environment variable"):
        code_files(root, Runner())
    (root / "setup_env.sh").unlink()
    index = "https://ci:" + "pw4ever@pypi.example.com/simple"  # (a secret by its form alone)
    for name, data in (("win.ps1", f"pip install --index-url {index} x\r\n".encode("utf-16")),
                       ("wide.txt", f"pip install --index-url {index} x\n".encode("utf-32")),
                       ("wide.bin", b"\0\1" + login.encode("utf-32-le")),
                       ("dump.bin", b"\0\1" + login.encode("utf-16-le") + b"\0"),
                       ("blob.bin", b"\0\2" + login.encode() + b"\0")):
        (root / name).write_bytes(data)
        with pytest.raises(ConfigError, match=rf"^1 file\(s\) to sync hold a secret: {name} "):
            code_files(root, Runner())
        (root / name).unlink()
    (root / "plain.bin").write_bytes(b"\0\1" + "no secret".encode("utf-16-le"))
    assert "plain.bin" in code_files(root, Runner())


KEY = "0f1e2d3c" + "4b5a69788796a5b4c3d2e1f0a1b2c3d4"  # (in pieces: this file is synced too)


@pytest.mark.parametrize("line, why", [
    ("WANDB_API_KEY := {key}", "WANDB_API_KEY set to a literal"),  # Make's assignments
    ("WANDB_API_KEY ?= {key}", "WANDB_API_KEY set to a literal"),
    ("HF_TOKEN += {key}", "HF_TOKEN set to a literal"),
    ("wandb login {key}", "wandb login given a literal"),
    ("wandb login --relogin --host https://w.example.com '{key}'", "wandb login given a literal"),
    ("python train.py --api-key={key}", "--api-key given a literal"),
    ("python train.py --api-key {key} --seed 1", "--api-key given a literal"),
    ('subprocess.run(["x", "--hf-token", "{key}"])', "--hf-token given a literal"),
    # a command as a list: Python's, JSON's, YAML's
    ('subprocess.run(["wandb", "login", "{key}"])', "wandb login given a literal"),
    ("subprocess.run(['wandb','login','--relogin','{key}'], check=True)", "wandb login given a literal"),
    ('{{"args": ["wandb", "login", "--host", "https://w.example.com", "{key}"]}}',
     "wandb login given a literal"),
    ("cmd: [wandb, login, {key}]", "wandb login given a literal"),
    ("args: [python, train.py, --api-key, {key}, --seed, 1]", "--api-key given a literal"),
    # a header, a netrc line, a URL's query, a registry login's short option
    ("curl -H 'Authorization: Bearer {key}' https://api.example.com", "Bearer followed by a literal"),
    ("echo 'machine api.example.com login me password {key}' >> ~/.netrc",
     "password followed by a literal"),
    ("curl 'https://api.example.com/v1?page=2&access_token={key}'",
     "the URL query's access_token set to a literal"),
    ("docker login -u me -p {key} ghcr.io", "docker login -p given a literal"),
])
def test_a_secret_set_in_a_makefile_or_given_to_a_command_is_refused_and_masked(tmp_path, line, why):
    """Found with no such variable in the environment: not synced, masked in code.diff."""
    from xtrain.observe.bundle import mask_secrets

    root = git_tree(tmp_path / "repo")
    (root / "Makefile").write_text(f"setup:\n\t{line.format(key=KEY)}\n")
    with pytest.raises(ConfigError) as e:
        code_files(root, Runner())
    assert str(e.value).startswith(f"1 file(s) to sync hold a secret: Makefile ({why})")
    assert KEY not in str(e.value)
    diff = f"+\t{line.format(key=KEY)}\n"
    assert mask_secrets(diff, {}) == f"+\t{line.format(key='***')}\n"


def test_a_dotted_token_after_bearer_is_a_secret():
    """A JWT, or Google's ``ya29.`` access token, is dotted like a name (which a literal after a
    variable's name may be): after ``Bearer`` it is a token all the same, found and masked whole."""
    from xtrain.config.secrets import mask_assigned, secret_in_text

    for token in ("ya29" + ".a0AfB_" + KEY, "eyJhbGciOi" + ".eyJzdWIiOi" + KEY + ".SflKxw"):
        line = f"curl -H 'Authorization: Bearer {token}' https://api.example.com\n"
        assert secret_in_text(line) == "Bearer followed by a literal", token
        assert mask_assigned(line, "***") == "curl -H 'Authorization: Bearer ***' https://api.example.com\n"


def test_a_private_key_in_an_uncommitted_change_is_refused_at_sync_and_left_out_of_code_diff(tmp_path):
    """A key pasted into a tracked file (no key file by its name): not synced, and code.diff (``git
    diff HEAD``) leaves that file out, naming it in code.json; so does a change in the middle of a
    committed key, whose hunk shows neither its header nor its footer. Keys in other text keep
    their header, footer and lines, not their body. (Headers spelled in pieces: this file is
    synced too.)"""
    from xtrain.observe.bundle import code_state, mask_secrets

    root = git_tree(tmp_path / "repo")
    commit = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm"]
    body = ["MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7", "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUA"]
    middle = [f"{i:02d}" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVphYmNkZWZnaGlqa2xtbm9wcXJz"[:60] for i in range(12)]
    begin, end = "-----BEGIN RSA " + "PRIVATE KEY-----", "-----END RSA " + "PRIVATE KEY-----"
    (root / "pkg/deploy.pem").write_text("\n".join([begin, *middle, end]) + "\n")
    subprocess.run(["git", "-C", str(root), "add", "pkg/deploy.pem"], check=True)
    subprocess.run(commit + ["init"], check=True)
    (root / "pkg/mod.py").write_text(f'x = 1\nKEY = """{begin}\n' + "\n".join(body) + f'\n{end}\n"""\n')
    (root / "pkg/deploy.pem").write_text("\n".join([begin, *middle[:6], body[1], *middle[7:], end]) + "\n")
    (root / "pkg/other.py").write_text("y = 2\n")
    subprocess.run(["git", "-C", str(root), "add", "pkg/other.py"], check=True)
    with pytest.raises(ConfigError, match=r"pkg/mod.py \(a private key\)"):
        code_files(root, Runner())
    facts, diff = code_state(root)
    assert facts["changed"] == ["pkg/deploy.pem", "pkg/mod.py", "pkg/other.py"]
    assert facts["diff_omits"] == ["pkg/deploy.pem", "pkg/mod.py"]
    assert "+y = 2" in diff and "deploy.pem" not in diff and "mod.py" not in diff
    assert not any(line[:8] in diff for line in body + middle)
    # keys in text masking reads (a diff's lines, a JSON string's key, a hunk ending inside a key)
    masked = mask_secrets(f'+KEY = """{begin}\n+' + "\n+".join(body) + f'\n+{end}\n+"""\n', {})
    assert masked == f'+KEY = """{begin}\n+***\n+***\n+{end}\n+"""\n'
    assert mask_secrets(f'+  "private_key": "{begin}\\n{body[0]}\\n{end}\\n",\n', {}) == (
        f'+  "private_key": "{begin}***{end}\\n",\n')
    assert mask_secrets(f"@@ -1,3 +1,3 @@\n {begin}\n-{body[0]}\n+{body[1]}\n@@ -9 +9 @@\n x = 1\n", {}) == (
        f"@@ -1,3 +1,3 @@\n {begin}\n-***\n+***\n@@ -9 +9 @@\n x = 1\n")


def test_a_key_stored_by_wandb_login_is_forwarded_masked_and_never_synced(tmp_path, monkeypatch):
    """`wandb login` keeps the key in ~/.netrc (a real file here): local runs go online with it, so
    a launched job gets it as WANDB_API_KEY (the workers have no ~/.netrc), and it is masked and
    looked for in synced code like an exported key."""
    from xtrain.config.secrets import SECRET_NAMES_VAR
    from xtrain.launcher.secrets import collect
    from xtrain.observe.bundle import mask_secrets
    from xtrain.observe.wandb_run import has_key

    for name in ("WANDB_API_KEY", "HF_TOKEN", "NETRC", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert collect() == {} and not has_key()
    key = os.urandom(20).hex()  # a W&B key's form: 40 hex digits
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {key}\n")
    assert has_key()
    from wandb.sdk.lib import urls, wbauth  # what `wandb login` writes, where W&B's cloud is now

    (tmp_path / "home" / ".netrc").unlink()
    wbauth.wbnetrc.write_netrc_auth(host=urls.DEFAULT_BASE_URL, api_key=key)
    assert has_key()
    assert collect() == {"WANDB_API_KEY": key, SECRET_NAMES_VAR: "WANDB_API_KEY"}
    assert mask_secrets(f"CommError: key {key} refused") == "CommError: key *** refused"
    root = git_tree(tmp_path / "repo")
    (root / "notes.txt").write_text(f"logged in with {key}\n")
    with pytest.raises(ConfigError, match=r"notes.txt \(the value of a secret") as e:
        code_files(root, Runner())
    assert key not in str(e.value)
    monkeypatch.setenv("WANDB_API_KEY", "exported" + key)  # the environment's key goes first
    assert collect()["WANDB_API_KEY"] == "exported" + key


def test_a_corpus_built_inside_the_checkout_is_synced_without_its_data(tmp_path, compose_config):
    """A build's manifest.json names its inputs' sha256 (a random-looking hex) under a name that
    must not read as a secret's; its shards and token bytes are data, left out by name."""
    from xtrain.data import prepare

    root = git_tree(tmp_path / "repo")
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"f{i}.cpp").write_text("".join(f"struct Shape{i}_{j} {{ double width_{j}; int count{i}; }};\n"
                                               for j in range(40)))
    cfg = compose_config(["data.vocab_size=300"])
    cfg.data.build_sources = [str(src)]
    cfg.data.build_dir = str(root / "corpus")
    prepare(cfg.data, log=lambda _: None)
    built = [f for f in code_files(root, Runner()) if f.startswith("corpus/")]
    assert built == ["corpus/.xtrain-corpus", "corpus/manifest.json", "corpus/tokenizer/tokenizer.json"]


def test_code_that_names_secrets_is_synced():
    """This checkout (its tests spell fake secrets in pieces) and code that only handles them."""
    from xtrain.config.secrets import secret_in_text

    code_files(ROOT, Runner())  # refuses nothing
    for text in ('token = tokenizer.encode_ordinary(text_chunk)\n', 'api_key: ${oc.env:WANDB_API_KEY}\n',
                 'export HF_TOKEN="$HF_TOKEN"\n', 'GOOGLE_APPLICATION_CREDENTIALS=/home/me/sa-key-0123.json\n',
                 'password_field: password_input_box\n', "keep_last: 3\n",
                 # names and hashes, not secrets: dotted names, words joined, an annotation, a
                 # lock file's hash (under no secret's name)
                 'key = "transformer.h.0.attn.c_attn.weight"\n', 'pat = "checkpoint_step_00001000"\n',
                 "eos_token: endoftext_50256_token\n", "Gost2814789Key = rfc4357.Gost28147_89_Key\n",
                 "def sign(private_key: PKCS7PrivateKeyTypes2, data): ...\n",
                 'hash = "sha256:0f1e2d3c4b5a69788796a5b4c3d2e1f0"\n',
                 # commands given a variable, no key, or a hash under a flag that says nothing
                 'wandb login --relogin\n', 'python train.py --api-key="$WANDB_API_KEY"\n',
                 'wandb login "$(cat ~/.wandb_key)"\n', "git commit --fixup 0f1e2d3c4b5a69788796a5b4c3d2\n",
                 "TOKENIZER ?= /cache/tokenizer_2024_v2\n", "--key transformer.h.0.attn.c_attn.weight\n",
                 # a command as a list, given a variable, no key, or a name
                 'subprocess.run(["wandb", "login", key])\n', "cmd: [wandb, login, --relogin]\n",
                 'subprocess.run(["wandb", "login", os.environ["WANDB_API_KEY"]], check=True)\n',
                 "['wandb', 'login', '--relogin', wandb_api_key_from_vault]\n",
                 '["python", "train.py", "--api-key", "${WANDB_API_KEY}"]\n',
                 'subprocess.run(["git", "log", "0f1e2d3c4b5a69788796a5b4c3d2"])\n',
                 # a header, a query, a login given a variable or a name
                 'headers = {"Authorization": f"Bearer {token}"}\n', "Bearer token_from_the_vault\n",
                 "https://example.com/list?page_token=next_page&per_page=100\n",
                 'docker login -u me -p "$REGISTRY_PASSWORD" ghcr.io\n', "password reset_link_2024\n",
                 # options read one way only (two ways each would take 2**40 tries here)
                 '["wandb", "login"' + ', "--host", "h"' * 40 + "]\n"):
        assert secret_in_text(text) is None, text


def test_a_big_file_is_refused_before_anything_is_copied(tmp_path):
    root = git_tree(tmp_path / "repo")
    (root / "weights.bin").write_bytes(b"\0" * (3 * 2**20))
    with pytest.raises(ConfigError, match=r"weights.bin is 3 MB .*max_file_mb=2"):
        code_files(root, Runner(), max_file_mb=2)
    # many files under max_file_mb: their total counts too, the folder holding most named
    (root / "weights.bin").unlink()
    for i in range(6):
        (root / "data" / "shards").mkdir(parents=True, exist_ok=True)
        (root / "data" / "shards" / f"shard{i}.bin").write_bytes(b"\0" * 2**20)
    assert len(code_files(root, Runner(), max_file_mb=2, max_total_mb=7)) == 9
    with pytest.raises(ConfigError, match=r"^the files to sync come to 6 MB \(hydra.launcher."
                                          r"max_total_mb=5\), most in data/ \(6 MB\), "):
        code_files(root, Runner(), max_file_mb=2, max_total_mb=5)


def test_requirements_are_the_dependencies_with_the_profile_pins(compose_config):
    from xtrain.launcher.env import requirements

    reqs = requirements(ROOT, hardware(compose_config, "v6e4").pins)
    assert "torch==2.9.1" in reqs and "libtpu==0.0.21" in reqs and "jax==0.7.0" in reqs
    assert not any(r.startswith("torch_xla==2.9.0;") for r in reqs)  # the pin replaced it
    assert any(r.startswith("hydra-core") for r in reqs)  # an unpinned dependency stays
    assert requirements(ROOT, {}) == __import__("tomllib").load(
        open(ROOT / "pyproject.toml", "rb"))["project"]["dependencies"]


def test_envcheck_names_what_does_not_match():
    import omegaconf

    assert problems([f"omegaconf=={omegaconf.__version__}", "pytest>=1",
                     "torch_xla==0.0.1; sys_platform == 'nonexistent'"]) == []
    found = problems(["omegaconf==0.0.1", "xtrain-no-such-package==1.0"])
    assert found[0] == f"omegaconf {omegaconf.__version__} is installed, wanted ==0.0.1"
    assert found[1].startswith("xtrain-no-such-package is not installed")


def test_remote_command_runs_the_jobs_own_overrides_with_a_fixed_name_and_dir():
    from types import SimpleNamespace

    from xtrain.launcher.launch import job_name, remote_command

    w = SimpleNamespace(venv="/r/venv", root="/r")
    cmd = remote_command(w, ["model=d2", "run.name=old", "data.build_sources=[a,b]"], "d2-x,[y]",
                         job_name("d2-x,[y]"))
    assert cmd[:4] == ["/r/venv/bin/python", "-u", "-m", "xtrain"]
    assert cmd[4:6] == ["model=d2", "data.build_sources=[a,b]"]  # no run.name=old, no launcher
    assert cmd[6] == "run.name='d2-x,[y]'"
    assert cmd[7] == f"hydra.run.dir=/r/runs/{job_name('d2-x,[y]')}"
    assert job_name("d16-v6e4-cpp16k") == "d16-v6e4-cpp16k"
    # names that are not plain paths get a hash, so two of them never share a job directory
    assert job_name("d2-x,[y]").startswith("d2-x_y-") and job_name("d2-x,[y]") != job_name("d2-x[y]")


@pytest.mark.parametrize("name", ["a\\b", "it's", "a\\'b", "ends\\", "x,y=z[1]", "two\\\\x'", "nl\\\n"])
def test_the_run_name_reaches_the_worker_as_written(name):
    """The remote command's run name, read back by Hydra's own override parser, is the name."""
    from types import SimpleNamespace

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from xtrain.launcher.launch import job_name, remote_command

    cmd = remote_command(SimpleNamespace(venv="/r/venv", root="/r"), [], name, job_name(name))
    assert OverridesParser.create().parse_override(cmd[4]).value() == name


def test_a_pool_sweep_refused_once_its_jobs_hold_their_records_gives_them_back(tmp_path, gcloud):
    """A sweep over a pool refused before or after its jobs hold their .hydra records leaves no
    record held: its second job refused, or two jobs sharing a checkpoint dir on GCS (by the
    sweep's checks of every job: it leaves no sweep dir); VMs gcloud does not know; VMs whose
    workers refuse connections (each job's own failure). gcloud is the stand-in (tests/sshd.py: Google
    Cloud cannot be reached from here)."""
    (tmp_path / "key").write_text("")  # placeholders: no login is made
    (tmp_path / "key.pub").write_text("ssh-ed25519 AAAA placeholder")
    sweep = ["-m", "hardware=v6e4", "optim.matrix_lr=0.01,0.02", "hydra/launcher=tpu_vm",
             "hydra.launcher.pool=[vm-a,vm-b]", "hydra.launcher.zone=asia-northeast1-b",
             f"hydra.launcher.identity_file={tmp_path / 'key'}"]
    unreachable = ["hydra.sweep.dir=unreachable", "hydra.launcher.port=9", "hydra.launcher.retries=0"]
    for extra, code, refused in (
            [["hydra.sweep.dir=second", "hydra.launcher.recreate=true", "checkpoint.dir=gs://b/c,local"],
             2, "hydra.launcher.recreate=true needs checkpoint.dir=gs://"],
            [["checkpoint.dir=gs://bucket/shared"], 2, "checkpoint.dir=gs://bucket/shared is sweep job 1's too"],
            [["hydra.sweep.dir=unknown"], 2, "gcloud does not know TPU vm-a"],
            [unreachable, 1, "no VM of the pool is left to run it"]):
        if extra == unreachable:
            for name in ("vm-a", "vm-b"):
                gcloud.add(tpu_node(name, "asia-northeast1-b", "v6e-4", [("127.0.0.1", "127.0.0.1")]))
        r = subprocess.run([sys.executable, "-m", "xtrain", *sweep, *extra], cwd=tmp_path,
                           env=cli_env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == code and refused in r.stderr, r.stderr
    assert not (tmp_path / "second").exists() and not (tmp_path / "multirun").exists()
    assert len(list(tmp_path.rglob(".hydra-pending"))) == 4, sorted(tmp_path.rglob("*"))
    assert not list(tmp_path.rglob(".hydra-held-*"))


@pytest.mark.parametrize("extra, refused", [
    (["run.name=lr_sweep"], "sweep job 1 is run lr_sweep too"),
    (["hydra.sweep.subdir=x"], "has this job's dir multirun/"),
], ids=["name", "dir"])
def test_a_launched_sweep_whose_jobs_share_a_run_name_or_dir_is_refused(tmp_path, gcloud, extra,
                                                                         refused):
    """Launched jobs are found on their workers by run name and here by job dir (launch record,
    W&B id): on one VM the second job resumed the first's finished run and trained nothing, and
    a pool took the two for one. Refused before any job runs, also with a checkpoint dir each;
    gcloud is the stand-in (tests/sshd.py): it is never called."""
    (tmp_path / "key").write_text("")  # placeholders: no login is made
    (tmp_path / "key.pub").write_text("ssh-ed25519 AAAA placeholder")
    r = subprocess.run([sys.executable, "-m", "xtrain", "-m", "hardware=v6e4",
                        "optim.matrix_lr=0.01,0.02", "checkpoint.dir=gs://b/${optim.matrix_lr}",
                        "hydra/launcher=tpu_vm", "hydra.launcher.tpu=vm-a",
                        "hydra.launcher.zone=asia-northeast1-b",
                        f"hydra.launcher.identity_file={tmp_path / 'key'}", *extra],
                       cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "sweep job 2 of 2" in r.stderr and refused in r.stderr, r.stderr
    assert not gcloud.calls() and not (tmp_path / "multirun").exists()


@pytest.mark.parametrize("sweep", [[], ["-m", "optim.matrix_lr=0.01,0.02"]], ids=["run", "sweep"])
def test_a_missing_key_is_refused_before_any_vm_is_looked_up(tmp_path, gcloud, sweep):
    """Also with a pool, which looks up its VMs before it runs a job there. gcloud is the
    stand-in (tests/sshd.py), which records its calls: none is made. A sweep is refused with the
    checks of its jobs' configs: it leaves no multirun/ (its multirun.yaml and a job's held
    record stayed)."""
    cwd = tmp_path / "work"
    cwd.mkdir()
    r = subprocess.run([sys.executable, "-m", "xtrain", *sweep, "hardware=v6e4",
                        "hydra/launcher=tpu_vm", "hydra.launcher.pool=[vm-a]",
                        "hydra.launcher.zone=asia-northeast1-b",
                        f"hydra.launcher.identity_file={tmp_path / 'no_key'}"],
                       cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"hydra.launcher.identity_file={tmp_path / 'no_key'}: no such file" \
        in r.stderr, r.stderr
    assert not gcloud.calls() and not list(cwd.iterdir())
