"""What counts as a secret (a key's name, a value's form), and the refusal of one written into the
config, on the command line or in a config file. Secrets come from the environment (W&B's key
also from ~/.netrc, where ``wandb login`` stores it); hydra.launcher.secrets forwards them to
TPU VMs. Masking what a run records is
xtrain/observe/bundle.py's."""

from __future__ import annotations

import codecs
import netrc
import os
import re
from urllib.parse import urlsplit

from xtrain.errors import ConfigError

SECRET_WORDS = {"key", "apikey", "token", "secret", "password", "passwd", "credential",
                "credentials", "auth", "pat"}
# Values that are secrets whatever their key: a URL's [user]:password@ (a private package index's
# token; the user may be an interpolation, read around), an http(s) URL's user alone when it is
# a token (16 or more letters and digits, both mixed: Gemfury's https://TOKEN@pypi.fury.io/...,
# git+https://TOKEN@github.com/...; not a name such as postgres://reader_01@), and the fixed
# formats of GitHub, Hugging Face, OpenAI-style and AWS access keys.
SECRET_VALUE = re.compile(r"://[^/\s:@]*:[^/\s@]+@"
                          r"|(?:(?<=https)|(?<=http))://(?=[A-Za-z0-9]*\d)(?=[A-Za-z0-9]*[A-Za-z])[A-Za-z0-9]{16,}@"
                          r"|\b(gh[pousr]_[A-Za-z0-9]{30,}|github_pat_\w{30,}"
                          r"|hf_[A-Za-z0-9]{30,}|sk-[A-Za-z0-9_-]{30,}|AKIA[0-9A-Z]{16})\b")


# words of a name saying its value is a file (GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN_PATH)
PATH_WORDS = {"credential", "credentials", "file", "path", "dir"}


def _words(name: str) -> list[str]:
    """WANDB_API_KEY, wandb-api-key and wandbApiKey all give wandb, api, key."""
    return re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower())


def is_secret_name(name: str) -> bool:
    """WANDB_API_KEY, HF_TOKEN, hfToken, GOOGLE_APPLICATION_CREDENTIALS: a word of the name says
    secret (``tokenizer`` or ``keep_last`` do not)."""
    return any(word in SECRET_WORDS for word in _words(name))


def has_secret_value(text: str) -> bool:
    return SECRET_VALUE.search(text) is not None


# Names of the variables a launcher forwarded as secrets (hydra.launcher.secrets may name any
# variable, e.g. HF_LOGIN): their values are masked whatever the names say.
SECRET_NAMES_VAR = "XTRAIN_SECRET_NAMES"
MIN_SECRET_CHARS = 8  # shorter values under secret names are flags (HF_HUB_DISABLE_IMPLICIT_TOKEN=1)


def may_be_secret(value: str, name: str = "") -> bool:
    """Whether a value under the secret's name ``name`` can be one: not a short flag
    (``HF_HUB_DISABLE_IMPLICIT_TOKEN=1``) nor a path, which a value starting like one is when the
    name says it is a file (``GOOGLE_APPLICATION_CREDENTIALS=/sa.json``) or the file exists here
    (an AWS secret access key, base64, may start with a slash)."""
    if len(value) < MIN_SECRET_CHARS:
        return False
    if value.startswith(("/", "~", "./", "../")):
        return not (PATH_WORDS & set(_words(name)) or os.path.exists(os.path.expanduser(value)))
    return True


def forwarded_names(environ=os.environ) -> set[str]:
    """The names SECRET_NAMES_VAR lists."""
    return set(filter(None, environ.get(SECRET_NAMES_VAR, "").split(",")))


def declare_secret_names(names, environ=os.environ) -> None:
    """Count the variables ``names`` (hydra.launcher.secrets) as secrets in this process too,
    whatever their names say, as a launched job does: the launching side's checks (the resolved
    launcher config, the code to sync) and its masking then know their values."""
    environ[SECRET_NAMES_VAR] = ",".join(sorted(forwarded_names(environ) | set(names)))


def is_secret_variable(name: str, environ=os.environ) -> bool:
    """A variable whose name says secret, or that SECRET_NAMES_VAR lists."""
    return name != SECRET_NAMES_VAR and (is_secret_name(name) or name in forwarded_names(environ))


def secret_env(environ=os.environ) -> dict[str, str]:
    """Environment variables whose names say they are secret (WANDB_API_KEY, ...), or that a
    launcher forwarded as secrets, with values long enough to be one."""
    return {k: v for k, v in environ.items()
            if is_secret_variable(k, environ) and len(v) >= MIN_SECRET_CHARS}


# W&B's cloud: wandb 0.31 logs in at api.forge.coreweave.com and also reads the entry older
# versions wrote for api.wandb.ai (wandb/sdk/lib/urls.py, FORGE_HOSTS)
WANDB_CLOUD_HOSTS = ("api.forge.coreweave.com", "api.wandb.ai")


def wandb_key(environ=os.environ) -> str | None:
    """The W&B key W&B itself would log in with, without asking for one: WANDB_API_KEY, else the
    password of W&B's host in the netrc file (NETRC, else ~/.netrc), where ``wandb login`` stores
    it (W&B reads the same file: wandb/sdk/lib/wbauth/wbnetrc.py, keyed by the URL's host:port)."""
    if environ.get("WANDB_API_KEY"):
        return environ["WANDB_API_KEY"]
    host = urlsplit(environ.get("WANDB_BASE_URL") or "").netloc
    path = environ.get("NETRC") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".netrc")
    try:
        entries = netrc.netrc(os.path.expanduser(path))
    except (OSError, netrc.NetrcParseError):
        return None
    hosts = WANDB_CLOUD_HOSTS if host in ("", *WANDB_CLOUD_HOSTS) else (host,)
    entry = next(filter(None, map(entries.authenticators, hosts)), None)
    return entry[2] if entry and entry[2] else None


def _stored_key(environ) -> set[str]:
    """A W&B key kept in the netrc file: a secret no variable's name announces."""
    key = wandb_key(environ)
    return {key} if key and len(key) >= MIN_SECRET_CHARS else set()


def secret_values(environ=os.environ) -> set[str]:
    """The values of :func:`secret_env`, and a W&B key stored by ``wandb login``: what a record
    masks."""
    return set(secret_env(environ).values()) | _stored_key(environ)


def forbidden_values(environ=os.environ) -> set[str]:
    """The values of :func:`secret_env` that may be secrets (:func:`may_be_secret`), and a W&B key
    stored by ``wandb login``: what a text written or synced must not hold."""
    return {v for k, v in secret_env(environ).items() if may_be_secret(v, k)} | _stored_key(environ)


# What marks a file as holding a secret (the launchers refuse to sync one,
# xtrain/launcher/sync.py): a private key (a Google service account's key file holds one), a
# value of a secret's form, and a secret-named variable, key or argument set to a literal that
# looks random (:func:`_looks_random`) in a shell, dotenv, Makefile, YAML, JSON or Python line:
# ``export WANDB_API_KEY=1a2b...``, ``WANDB_API_KEY ?= 1a2b...``, ``api_key: 1a2b...``,
# ``"token": "1a2b..."``, ``wandb.login(key="1a2b...")``, ``os.environ["HF_TOKEN"] = "..."``,
# or given to a command: ``wandb login [--relogin] 1a2b...``, ``--api-key=1a2b...``, also as a
# list's items (Python's, JSON's, YAML's): ``["wandb", "login", "1a2b..."]``, ``[--api-key, 1a2b...]``;
# or after a word saying a secret follows (KEYWORD_LITERAL), or in a URL's query (QUERY_LITERAL).
PRIVATE_KEY = re.compile(r"-----BEGIN ([A-Z]+ )*PRIVATE KEY-----")
# A private key's block as a text or a diff holds it: its body up to the footer or, with none
# (a diff's hunk that ends inside the key, a JSON string cut short), the rest of the header's line
# and the lines that follow it and look like a key's (base64, or a legacy PEM's ``DEK-Info:``
# header), a diff's ``+``/``-``/`` `` before each.
PRIVATE_KEY_BLOCK = re.compile(
    r"(-----BEGIN (?:[A-Z]+ )*PRIVATE KEY-----)(?:(.*?)(?=-----END (?:[A-Z]+ )*PRIVATE KEY-----)"
    r"|([^\n]*(?:\n[+\- ]?(?:[A-Za-z0-9+/=]+|[A-Za-z-]+:[^\n]*)?(?=\n|$))*))", re.DOTALL)
LITERAL = r"""(['"]?)([A-Za-z0-9_+/=.-]{16,})"""  # (its quote, then the literal)
ASSIGNED_LITERAL = re.compile(  # (a line may start with a diff's + or -; := ?= += are Make's;
    # a name, its annotation and = share a line: a Makefile's "setup:" is no annotation)
    r"""(?:^[+-]?|[\s;({,.\[])(?:export\s+)?(['"]?)([A-Za-z_][\w-]*)\1\]?[ \t]*(?::[ \t]*\w+[ \t]*)?"""
    r"""([:?+]?=|:)\s*"""
    + LITERAL + r"""\4(?=[\s,;)\]}]|$)(.*)$""", re.MULTILINE)
# A command's words are apart by spaces, or are a list's items, a comma between and each maybe
# quoted (``["wandb", "login", "1a2b..."]``, ``[wandb, login, 1a2b...]``). ``wandb login``'s
# options before the key may take a value (``--host URL``).
# (Each quote and value can be read one way only: a text that almost matches takes linear time.)
ARG_SEP = r"""['"]?(?:[ \t]*,\s*|\s+)['"]?"""
OPTION = rf"""{ARG_SEP}--[\w-]+(?:(?:=['"]?|{ARG_SEP})[^\s,'"-][^\s,'"]*)?"""
COMMAND_LITERAL = re.compile(
    rf"""(?:\b(wandb{ARG_SEP}login)(?:{OPTION})*{ARG_SEP}|(?<![\w-])(--[A-Za-z][\w-]*)(?:=\s*|{ARG_SEP}))"""
    + LITERAL + r"""\3(?=[\s,;)\]}'"]|$)""")
# A literal after a word that says what follows is a secret, a space between: an HTTP header's
# ``Authorization: Bearer 1a2b...`` (or ``Basic``), a netrc file's ``password 1a2b...``; and one a
# registry login is given by its short option (``docker login -u me -p 1a2b...``; its long
# ``--password`` is COMMAND_LITERAL's).
KEYWORD_LITERAL = re.compile(
    r"""(?:\b(Bearer|Basic|password|passwd)[ \t]+"""
    r"""|\b((?:docker|podman|nerdctl|helm[ \t]+registry)[ \t]+login)\b[^\n;|&]*?[ \t]-p(?:=|[ \t]+))"""
    + LITERAL + r"""\3(?=[\s,;)\]}'"]|$)""")
# A URL query's parameter (``?access_token=1a2b...&``): judged by its name, as a variable is
QUERY_LITERAL = re.compile(r"[?&]([A-Za-z_][\w-]*)=([A-Za-z0-9_+/.%~-]{16,})(?=[&#\s'\"]|$)")
DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")  # rfc4357.Gost28147_89_EncryptedKey


def _looks_random(value: str, dotted: bool = False) -> bool:
    """A run of 8 or more letters and digits mixed, between the ``_ . -`` that join words: a key
    or a token (``0f1e2d3c...``), not a name (``checkpoint_step_00001000``, ``some_identifier_2024``,
    a dotted one, unless ``dotted``: after ``Bearer`` a JWT or Google's ``ya29.`` token is dotted)."""
    return (dotted or not DOTTED_NAME.fullmatch(value)) and any(
        len(part) >= 8 and re.search(r"[A-Za-z]", part) and re.search(r"\d", part)
        for part in re.split(r"[_.-]+", value))


def _assigned_secrets(text: str):
    """(what, start, end) of each literal in ``text`` that is a secret: what names it
    (``HF_TOKEN set to``, ``wandb login given``), start and end its place. An unquoted value after a
    colon is YAML's only where the line ends with it (``api_key: PKCS7KeyTypes,`` is an
    annotation)."""
    for m in ASSIGNED_LITERAL.finditer(text):
        name, separator, quote, value, rest = m[2], m[3], m[4], m[5], m[6]
        if separator == ":" and not quote and rest.strip() and not rest.strip().startswith("#"):
            continue
        if is_secret_name(name) and may_be_secret(value, name) and _looks_random(value):
            yield f"{name} set to", m.start(5), m.end(5)
    for m in COMMAND_LITERAL.finditer(text):
        name, value = "wandb login" if m[1] else m[2], m[4]
        if (m[1] or is_secret_name(name)) and may_be_secret(value, name) and _looks_random(value):
            yield f"{name} given", m.start(4), m.end(4)
    for m in KEYWORD_LITERAL.finditer(text):
        if may_be_secret(m[4]) and _looks_random(m[4], dotted=True):
            yield (f"{m[1]} followed by" if m[1] else f"{m[2]} -p given"), m.start(4), m.end(4)
    for m in QUERY_LITERAL.finditer(text):
        if is_secret_name(m[1]) and _looks_random(m[2]):
            yield f"the URL query's {m[1]} set to", m.start(2), m.end(2)


def mask_assigned(text: str, mask: str) -> str:
    """``text`` with the literals secret-named variables or keys are set to, or commands are given,
    replaced by ``mask``."""
    places = {start: end for _, start, end in _assigned_secrets(text)}  # (one place, two forms)
    for start in sorted(places, reverse=True):
        text = text[:start] + mask + text[places[start]:]
    return text


def mask_private_keys(text: str, mask: str) -> str:
    """``text`` with the body of each private key block (:data:`PRIVATE_KEY_BLOCK`) replaced by
    ``mask`` line by line (a diff's ``+``/``-``/`` `` kept, so a masked code.diff keeps its lines);
    the header and footer stay, saying what was there."""
    def line_masked(line: str) -> str:
        prefix = line[:1] if line[:1] in ("+", "-", " ") else ""
        return prefix + mask if line[len(prefix):].strip() else line

    def masked(m):
        body = m[2] if m[2] is not None else m[3]
        return m[1] + "\n".join(map(line_masked, body.split("\n")))

    return PRIVATE_KEY_BLOCK.sub(masked, text)


def secret_in_text(text: str, known=frozenset()) -> str | None:
    """Why ``text`` (a file's) holds a secret, without the secret; None when it seems not to.
    ``known``: secret values to look for (:func:`forbidden_values`)."""
    if PRIVATE_KEY.search(text):
        return "a private key"
    if has_secret_value(text):
        return "a value of a secret's form (an access token, a URL's user:password@ or token@)"
    assigned = next(_assigned_secrets(text), None)
    if assigned:
        return f"{assigned[0]} a literal"
    if any(secret in text for secret in known):
        return KNOWN_SECRET
    return None


KNOWN_SECRET = "the value of a secret environment variable or of a W&B key stored by `wandb login`"


def secret_in_file(data: bytes, known=frozenset()) -> str | None:
    """:func:`secret_in_text` of a file's bytes: UTF-8 text, or UTF-16 or UTF-32 with its
    byte-order mark (PowerShell 5 writes UTF-16); in any other file holding a NUL byte (binary,
    or such text without the mark) only ``known`` values are looked for, in each encoding."""
    for marks, encoding in (((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE), "utf-32"),
                            ((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE), "utf-16")):
        if data.startswith(marks):  # (UTF-32's little-endian mark begins as UTF-16's)
            return secret_in_text(data.decode(encoding, errors="replace"), known)
    if b"\0" not in data[:8192]:
        return secret_in_text(data.decode("utf-8", errors="replace"), known)
    encoded = (secret.encode(encoding) for secret in known
               for encoding in ("utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"))
    return KNOWN_SECRET if any(e in data for e in encoded) else None


def _instead(name: str, value: str) -> str:
    """What to do instead of writing ``value`` under the key named ``name``."""
    read = next(filter(is_secret_variable, ENV_READ.findall(value)), None)
    if read and not is_secret_name(name):
        return (f"read {read} only into a key whose name says secret (as in "
                f"hardware.env.{read}=${{oc.env:{read}}}), whose value is masked wherever it is "
                "written")
    how = f"export {name} in the environment" if is_secret_name(name) else \
        "pass it in an environment variable"
    return f"{how} instead; hydra.launcher.secrets=[...] forwards such variables to TPU VMs"


def check_no_secret_overrides(args: list[str]) -> None:
    """Refuse an override that sets a secret-named key (``+hardware.env.HF_TOKEN=...``, at any
    depth of a dict or list value: ``+hydra.job.env_set={X: {WANDB_API_KEY: ...}}``) or a value of
    a secret's form, before Hydra writes anything: its value would land in the run's name and
    directory, .hydra/, multirun.yaml, W&B's record of the command, remote command lines and the
    process list. Arguments are read by Hydra's own override parser, as Hydra will read them. A
    value holding a secret environment variable's (``+hardware.env.X=$WANDB_API_KEY``, expanded by
    the shell) is refused too, whatever its key."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    known = forbidden_values()
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        name = re.split(r"[./@]", key)[-1]  # a value goes by its key's last part
        try:
            found = _secret_values(_plain(parser.parse_overrides([arg])[0].value()), key, name, known)
        except OverrideParseException:  # Hydra refuses it too, but prints it: read it as text
            found = _unparsed_secrets(key, name, value, known)
        if found:
            raise ConfigError(
                f"{key}: a secret is never given on the command line (it would be written to the "
                f"run's name, .hydra/ and the process list): {_instead(*found[0][1:])}")


def _plain(value):
    """An override's value as parsed by Hydra, as plain data for :func:`_secret_values`: a sweep's
    choices as a list, quoted strings and numbers as strings (digits can be a key too)."""
    from hydra.core.override_parser.types import ChoiceSweep, Glob, QuotedString, Sweep

    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, ChoiceSweep)):
        return [_plain(v) for v in (value.list if isinstance(value, ChoiceSweep) else value)]
    if isinstance(value, Glob):
        return value.include + value.exclude
    if isinstance(value, QuotedString):
        return value.text
    if value is None or isinstance(value, Sweep):  # (range and interval sweeps: numbers)
        return None
    return str(value)


def _unparsed_secrets(key: str, name: str, value: str,
                      known: set[str]) -> list[tuple[str, str, str]]:
    """(key, name, value) of the secrets in an override's value Hydra cannot parse
    (``{'HF_TOKEN': ...}``): the value under the key's name, and each ``name: value`` pair in it
    (a value ends at a brace, so a nested dict's pairs are read too); and the value itself when
    it is of a secret's form or holds one of ``known``."""
    pairs = [(name, value), *re.findall(r"[{,]\s*['\"]?([A-Za-z_][\w-]*)['\"]?\s*:\s*['\"]?([^,{}'\"]*)",
                                         value)]
    found = [(key, n, v) for n, v in pairs if is_secret_name(n) and may_be_secret(v.strip(), n)]
    whole = has_secret_value(value) or any(secret in value for secret in known)
    return found + ([(key, "", value)] if whole else [])


def check_no_secret_values(cfg, prefix: str = "", resolved: bool = False) -> None:
    """Refuse a secret written into a config file (``HF_TOKEN: hf_...`` under hardware.env, or in
    its ``hydra:`` section): Hydra copies the composed config into .hydra/ and multirun.yaml, and
    the launchers sync conf/ to TPU VMs. A value that reads the environment
    (``${oc.env:HF_TOKEN}``) is no secret there, unless ``resolved``: values are written resolved
    (hydra.launcher.env, into the job's run script), and then one that holds a secret
    environment variable's value is refused too. ``prefix``: where ``cfg`` sits in the whole
    config (``hydra.``, ``hydra.launcher.``)."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=resolved)
    found = _secret_values(plain, prefix.rstrip("."), "", forbidden_values() if resolved else set())
    if found:
        raise ConfigError(f"{found[0][0]}: a secret is never written into a config (it would be "
                          "copied into .hydra/, multirun.yaml, the code synced to TPU VMs or a "
                          f"launched job's run script): {_instead(*found[0][1:])}")


def check_no_secret_in_names(names: dict[str, str]) -> None:
    """Refuse a resolved name (``{key: value}``: the run's name, its dir) that holds a secret.
    One read through another key (``run.name=${hardware.env.WANDB_API_KEY}``, that key reading
    the environment) passes :func:`check_no_secret_values`, which sees the interpolation; names
    are written out unmasked (the run's dir, W&B's run name, a launch's command lines)."""
    known = forbidden_values()
    for key, value in names.items():
        if has_secret_value(value) or any(secret in value for secret in known):
            raise ConfigError(f"{key}: resolves to a secret's value (read through an interpolation): "
                              "a name is written out unmasked (the run's dir, W&B's run name, "
                              "command lines); name the run without it")


INTERPOLATION = re.compile(r"\$\{[^${}]*\}")
ENV_READ = re.compile(r"\$\{oc\.env:\s*['\"]?([A-Za-z_]\w*)")  # (the variable an interpolation reads)
# Hydra's records of the command line: ``key=value`` strings, each judged by its own key
# (:func:`check_no_secret_overrides`), not by the record's
COMMAND_LINE_RECORDS = ("hydra.overrides.", "hydra.job.override_dirname")


def _secret_values(node, path: str, name: str, known: set[str]) -> list[tuple[str, str, str]]:
    """(key, its last part, the string) of each string in the plain ``node`` that is a secret:
    by its form (in the text around any interpolations), by the name of its key (unless it reads
    the environment, or is a short flag or a path), or by holding one of ``known``; and of each that
    reads a secret variable (``${oc.env:WANDB_API_KEY}``) into a key whose name does not say
    secret: masking goes by the key's name, so its value would be written out as it is (in a
    run's name, its dir and W&B's record of it; on a command line)."""
    if isinstance(node, dict):
        return [found for key, value in node.items()
                for found in _secret_values(value, f"{path}.{key}" if path else str(key), str(key), known)]
    if isinstance(node, list):  # a list's items go by the list's key
        return [found for i, value in enumerate(node)
                for found in _secret_values(value, f"{path}[{i}]", name, known)]
    if not isinstance(node, str) or node == "???":  # (a missing value)
        return []
    literal = node
    while INTERPOLATION.search(literal):
        literal = INTERPOLATION.sub("", literal)
    by_name = literal == node and is_secret_name(name) and may_be_secret(node, name)
    reads_secret = (not is_secret_name(name) and not path.startswith(COMMAND_LINE_RECORDS)
                    and any(map(is_secret_variable, ENV_READ.findall(node))))
    if by_name or reads_secret or has_secret_value(literal) or any(s in node for s in known):
        return [(path, name, node)]
    return []
