"""The stand-in for ``gcloud compute tpus tpu-vm|queued-resources describe|create|delete``: Google
Cloud cannot be reached from here, so this is the one mock of the launcher tests (tests/sshd.py's
FakeGcloud puts it first on PATH). Everything else they use is real: OpenSSH, rsync, the training.

It records every call (argv, one JSON line each in calls.jsonl) and replays resources in gcloud's
``--format=json`` shapes (TPU API v2 Node and QueuedResource) from its state directory:

    nodes/NAME.json       a TPU VM; a describe prints it (its x-states and x-health lists, if
                          any, give its state and health one describe at a time, the last stays;
                          a state of ANSWERLESS fails that describe as gcloud does when it
                          cannot refresh its auth token)
    queued/NAME.json      a queued resource (its node is nodes/NAME.json)
    scenarios/NAME.json   what happens to NAME next (all optional):
      creates      outcomes of the next creates, in order: "ok", "no-capacity" (the TPU API's
                   stockout, code 8 RESOURCE_EXHAUSTED), "quota" (a regional quota of 0 chips,
                   RESOURCE_EXHAUSTED, HTTP 429), "answerless" (gcloud's auth-token refresh
                   failing, nothing created), "made-answerless" (the same failure after the
                   VM was created) or "invalid" (the request refused: INVALID_ARGUMENT); once
                   used up, creates succeed
      deletes      the same for deletes: "ok" or "answerless" (nothing deleted)
      states       states the created resource goes through, one per describe; the last stays
      endpoints    [[internal, external], ...] of the created node (default 127.0.0.2)
      wipe         directories a delete empties: the VM's disk goes with it
      host_key     an sshd host key file a create replaces: a new VM has a new host key
      authorized_keys  the sshd's AuthorizedKeysFile a create rewrites with the keys of the
                   create's ``ssh-keys`` metadata for this user: a new VM knows no other key;
                   ``keys_after_s`` later (default 0), as a VM's guest agent does after boot

An unknown name gets gcloud's NOT_FOUND error and exit code 1, like the real one.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import subprocess
import sys

STATE = os.environ["XTRAIN_FAKE_GCLOUD"]
NO_CAPACITY = ('{"code": 8, "message": "There is no more capacity in the zone \\"%s\\"; you can '
               'try in another zone where Cloud TPU Nodes are offered (see '
               'https://cloud.google.com/tpu/docs/regions) [EID: 0x5e0b1a2f]"}')
TOKEN_REFRESH = ("There was a problem refreshing your current auth tokens: ('Connection aborted.', "
                 "RemoteDisconnected('Remote end closed connection without response'))")
QUOTA = ("RESOURCE_EXHAUSTED: Quota limit 'TPUV6EPreemptiblePerProjectPerRegionForTPUAPI' has been "
         "exceeded. Limit: 0 in region %s.")


def load(path: str, default=None):
    if not os.path.exists(path):
        return default
    with open(path) as f:
        return json.load(f)


def save(path: str, value) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=1)
    os.replace(path + ".tmp", path)


def fail(args, what: str, code: int = 1) -> None:
    sys.stderr.write(f"ERROR: (gcloud.compute.tpus.{args[2]}.{args[3]}) {what}\n")
    sys.exit(code)


def node(name: str, zone: str, accelerator: str, version: str, spot: bool, endpoints) -> dict:
    return {"name": f"projects/xtrain-test/locations/{zone}/nodes/{name}",
            "acceleratorType": accelerator, "runtimeVersion": version,
            "schedulingConfig": {"spot": spot}, "state": "READY",
            "networkEndpoints": [{"ipAddress": i, "port": 8470, "accessConfig": {"externalIp": e}}
                                 for i, e in endpoints]}


def next_outcome(name: str, verb: str) -> tuple[str, dict]:
    """The outcome of this ``verb`` ("creates", "deletes") of ``name``, taken from its scenario
    ("ok" once none is left), and the scenario."""
    scenario_path = os.path.join(STATE, "scenarios", name + ".json")
    scenario = load(scenario_path, {})
    outcomes = scenario.get(verb, [])
    outcome = outcomes.pop(0) if outcomes else "ok"
    save(scenario_path, scenario)
    return outcome, scenario


def create(args, flags, name, queued: bool) -> None:
    outcome, scenario = next_outcome(name, "creates")
    if outcome == "no-capacity":
        fail(args, NO_CAPACITY % flags["zone"])
    if outcome == "quota":
        fail(args, QUOTA % flags["zone"].rsplit("-", 1)[0])
    if outcome == "answerless":
        fail(args, TOKEN_REFRESH)
    if outcome == "invalid":
        fail(args, f"INVALID_ARGUMENT: Runtime version {flags.get('version')!r} is not supported")
    if scenario.get("host_key"):
        key = scenario["host_key"]
        for old in (key, key + ".pub"):
            if os.path.exists(old):
                os.remove(old)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True,
                       stdin=subprocess.DEVNULL)
    if scenario.get("authorized_keys"):
        write_authorized_keys(scenario["authorized_keys"], flags.get("metadata-from-file", ""),
                              scenario.get("keys_after_s", 0))
    version = flags["runtime-version" if queued else "version"]
    states = list(scenario.get("states", []))
    vm = node(flags.get("node-id", name), flags["zone"], flags["accelerator-type"], version,
              "--spot" in args, scenario.get("endpoints", [["127.0.0.2", "127.0.0.2"]]))
    if queued:
        save(os.path.join(STATE, "nodes", vm["name"].rsplit("/", 1)[-1] + ".json"), vm)
        resource = {"name": f"projects/xtrain-test/locations/{flags['zone']}/queuedResources/{name}",
                    "tpu": {"nodeSpec": [{"nodeId": flags["node-id"], "node": {
                        "acceleratorType": flags["accelerator-type"], "runtimeVersion": version}}]},
                    "spot": {} if "--spot" in args else None, "state": {"state": "ACTIVE"}}
        save(os.path.join(STATE, "queued", name + ".json"), {**resource, "x-states": states})
    else:
        save(os.path.join(STATE, "nodes", name + ".json"), {**vm, "x-states": states})
    if outcome == "made-answerless":
        fail(args, TOKEN_REFRESH)


def write_authorized_keys(path: str, metadata_files: str, after_s: float) -> None:
    """The guest agent's part: ``ssh-keys`` lines (``user:key``) of this user become its keys,
    ``after_s`` seconds from now (none until then)."""
    files = dict(item.split("=", 1) for item in metadata_files.split(",") if "=" in item)
    lines = []
    if "ssh-keys" in files:
        with open(files["ssh-keys"]) as f:
            lines = [line.strip() for line in f if line.strip()]
    user = getpass.getuser()
    keys = "".join(line.split(":", 1)[1] + "\n" for line in lines if line.split(":", 1)[0] == user)
    with open(path, "w") as f:
        f.write("" if after_s else keys)
    if after_s:  # a detached writer: gcloud's create has returned by then
        subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1])); "
                          "open(sys.argv[2], 'w').write(sys.argv[3])", str(after_s), path, keys],
                         start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def describe(path: str, queued: bool) -> None:
    resource = load(path)
    states = resource.get("x-states", [])
    if states:  # replay: one state per describe, the last one stays
        state = states.pop(0) if len(states) > 1 else states[0]
        resource["state"] = {"state": state} if queued else state
        save(path, {**resource, "x-states": states})
        if state == "ANSWERLESS":
            fail(["compute", "tpus", "queued-resources" if queued else "tpu-vm", "describe"],
                 TOKEN_REFRESH)
    healths = resource.get("x-health", [])
    if healths:  # the node's Node.health, replayed the same way
        resource["health"] = healths.pop(0) if len(healths) > 1 else healths[0]
        save(path, {**resource, "x-health": healths})
    print(json.dumps({k: v for k, v in resource.items() if not k.startswith("x-")}, indent=1))


def delete(args, name: str, path: str, queued: bool) -> None:
    outcome, scenario = next_outcome(name, "deletes")
    if outcome == "answerless":
        fail(args, TOKEN_REFRESH)
    for directory in scenario.get("wipe", []):
        shutil.rmtree(directory, ignore_errors=True)
    if queued:
        if "--force" not in args and os.path.exists(os.path.join(STATE, "nodes", name + ".json")):
            fail(args, "FAILED_PRECONDITION: the queued resource still has a node (use --force)")
        node_path = os.path.join(STATE, "nodes", name + ".json")
        if os.path.exists(node_path):
            os.remove(node_path)
    os.remove(path)


def main(args: list[str]) -> None:
    with open(os.path.join(STATE, "calls.jsonl"), "a") as f:
        f.write(json.dumps(args) + "\n")
    flags = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
    if args[:2] != ["compute", "tpus"] or len(args) < 5 or \
            args[2] not in ("tpu-vm", "queued-resources") or \
            args[3] not in ("describe", "create", "delete"):
        fail(args + ["?"] * 4, "the gcloud stand-in has no recording for: " + " ".join(args), 2)
    queued, verb, name = args[2] == "queued-resources", args[3], args[4]
    path = os.path.join(STATE, "queued" if queued else "nodes", name + ".json")
    if verb == "create":
        create(args, flags, name, queued)
    elif not os.path.exists(path):
        kind = "queuedResources" if queued else "nodes"
        fail(args, f"NOT_FOUND: Resource 'projects/{flags.get('project', 'xtrain-test')}/"
                   f"locations/{flags.get('zone')}/{kind}/{name}' was not found")
    elif verb == "describe":
        describe(path, queued)
    else:
        delete(args, name, path, queued)


if __name__ == "__main__":
    main(sys.argv[1:])
