"""`zerotrain deepspeed-env`: write the `.deepspeed_env` that remote ranks need.

`deepspeed --hostfile` (pdsh / MPI launchers) starts the ranks of other nodes over ssh
with the launcher's absolute python, but forwards only variables starting with PYTHON,
MLFLOW, MV2, UCX (and NCCL on GPUs). Everything else - the venv's PATH (ninja for
DeepSpeed's JIT ops), TORCH_EXTENSIONS_DIR, OMP_NUM_THREADS, GLOO_SOCKET_IFNAME, WANDB_* -
has to be listed in `.deepspeed_env` in the launch directory or in ~/.deepspeed_env.

The launcher reads that file as `KEY=VALUE` lines and puts `export KEY=VALUE;` (quoted
with "..." when needed) into the remote shell command: a blank or comment line crashes
it ("not enough values to unpack"), and `$`, backquotes, `"` or `\\` in a value would be
expanded or break the remote command, so they are refused here.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from zerotrain.train import paths
from zerotrain.train.cli_args import ArgumentParser, Value
from zerotrain.train.errors import ConfigError, user_errors

USAGE = """usage: zerotrain deepspeed-env [--output FILE] [--set KEY=VALUE ...] [--add KEY ...] [--print]
       zerotrain deepspeed-env --check FILE

Write FILE (default ./.deepspeed_env; the deepspeed launcher reads ./.deepspeed_env in the
directory you launch from, and ~/.deepspeed_env) with the variables that ranks on other
nodes need and that the launcher does not forward by itself:
  PATH (this venv's bin first), VIRTUAL_ENV, TORCH_EXTENSIONS_DIR, OMP_NUM_THREADS,
  LD_LIBRARY_PATH, GLOO_SOCKET_IFNAME, TP_SOCKET_IFNAME, NCCL_*, WANDB_*, HF_*,
  TRANSFORMERS_OFFLINE - each only if set here (PATH/VIRTUAL_ENV/TORCH_EXTENSIONS_DIR always).
PYTHON* variables are not written: the launcher forwards them itself (PYTHONPATH with the
launch directory prepended, which a copy in the file would undo).

  --output FILE    where to write (an existing file is replaced)
  --set KEY=VALUE  add or override a variable (repeatable)
  --add KEY        also copy KEY from this environment (repeatable)
  --print          show what would be written instead (secret values hidden)
  --check FILE     validate an existing file (e.g. one accelerate appended to) and exit

The file may hold secrets (WANDB_API_KEY, HF_TOKEN): it is written mode 0600 and their
values are never printed. Keep it out of version control.
"""

ALWAYS = ("PATH", "VIRTUAL_ENV", "TORCH_EXTENSIONS_DIR")
IF_SET = ("OMP_NUM_THREADS", "LD_LIBRARY_PATH", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "TRANSFORMERS_OFFLINE")
PREFIXES = ("NCCL_", "WANDB_", "HF_")
# Set per rank by the launchers: a copy from the launch node would be wrong on every other.
LAUNCHER_OWNED = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|LOCAL_SIZE|CROSS_RANK|CROSS_SIZE|"
                            r"GROUP_RANK|NODE_RANK|MASTER_ADDR|MASTER_PORT|CUDA_VISIBLE_DEVICES|PYTHON.*)$")
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.I)
KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
UNSAFE = re.compile(r'[\n\r$`"\\]')


def is_secret(key: str) -> bool:
    return bool(SECRET.search(key))


def shown(key: str, value: str) -> str:
    """The value as it may appear on a console or in a log."""
    return f"<hidden, {len(value)} chars>" if is_secret(key) else value


def default_extensions_dir() -> str:
    # Same default as train.launch.distributed.normalize_env: every rank, local or remote, must
    # build and load DeepSpeed's JIT ops in one place.
    return str(paths.EXTENSIONS_CACHE)


def collect(environ: dict | None = None, add: tuple[str, ...] = ()) -> dict[str, str]:
    """The variables remote ranks need, from `environ` (default: this process's)."""
    env = dict(os.environ if environ is None else environ)
    out: dict[str, str] = {}
    venv_bin = str(Path(sys.executable).parent)
    # The venv's tools (ninja for DeepSpeed's JIT ops, deepspeed) first, as after
    # `source .venv/bin/activate`.
    rest = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin]
    out["PATH"] = os.pathsep.join([venv_bin, *rest])
    out["VIRTUAL_ENV"] = env.get("VIRTUAL_ENV") or (sys.prefix if sys.prefix != sys.base_prefix else "")
    if not out["VIRTUAL_ENV"]:
        del out["VIRTUAL_ENV"]
    out["TORCH_EXTENSIONS_DIR"] = env.get("TORCH_EXTENSIONS_DIR") or default_extensions_dir()
    for key in sorted(env):
        if key in IF_SET or key.startswith(PREFIXES) or key in add:
            if LAUNCHER_OWNED.match(key):
                continue
            out[key] = env[key]
    missing = [k for k in add if k not in env]
    if missing:
        raise ConfigError(f"--add {' '.join(missing)}: not set in this environment; use --set KEY=VALUE")
    return out


def check_entry(key: str, value: str, where: str) -> None:
    if not KEY_RE.match(key):
        raise ConfigError(f"{where}: {key!r} is not a valid variable name")
    if LAUNCHER_OWNED.match(key):
        raise ConfigError(f"{where}: {key} is set per rank by the launcher (or forwarded by it); "
                          f"remove it from the file")
    bad = UNSAFE.search(value)
    if bad:
        raise ConfigError(f"{where}: the value of {key} contains {bad.group(0)!r}, which the deepspeed launcher "
                          f"pastes into a remote shell command unescaped; set it in the remote nodes' shell "
                          f"profile instead, or use a value without $ ` \" \\ or newlines")


def render(entries: dict[str, str]) -> str:
    for k, v in entries.items():
        check_entry(k, v, "deepspeed-env")
    return "".join(f"{k}={v}\n" for k, v in entries.items())


def check_file(path: Path) -> dict[str, str]:
    """Parse a .deepspeed_env exactly as strictly as the launcher does, with line numbers."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    entries = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        where = f"{path}:{n}"
        if not line.strip() or line.lstrip().startswith("#"):
            raise ConfigError(f"{where}: blank and comment lines crash the deepspeed launcher (it splits every "
                              f"line on '='); delete the line, or regenerate with `zerotrain deepspeed-env`")
        if "=" not in line:
            raise ConfigError(f"{where}: expected KEY=VALUE, got {line[:60]!r}")
        key, value = line.split("=", 1)
        check_entry(key.strip(), value.strip(), where)
        entries[key.strip()] = value.strip()
    return entries


def write(path: Path, entries: dict[str, str]) -> None:
    text = render(entries)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # may hold API keys
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def summary(entries: dict[str, str]) -> str:
    return "\n".join(f"  {k}={shown(k, v)}" for k, v in entries.items())


def _key_value(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq:
        raise ConfigError(f"deepspeed-env: --set expects KEY=VALUE, got {text!r}")
    return key, value


def parse(argv: list[str]) -> dict:
    p = ArgumentParser("zerotrain deepspeed-env", USAGE, needs_value="deepspeed-env: {flag} needs a value",
                       empty_is_missing=True)
    p.add_argument("--output", action=Value, default=".deepspeed_env")
    p.add_argument("--set", action=Value, convert=_key_value, append=True, default=[])
    p.add_argument("--add", action=Value, append=True, default=[])
    p.add_argument("--print", action="store_true")
    p.add_argument("--check", action=Value)
    opts, rest = p.parse_known_args(argv)
    if rest:
        raise ConfigError(f"deepspeed-env: unknown argument {rest[0]!r} (see zerotrain deepspeed-env --help)")
    return {**vars(opts), "set": dict(opts.set)}  # a repeated --set KEY: the last one wins


def main(argv: list[str]) -> int:
    with user_errors():
        opts = parse(argv)
        if opts["check"]:
            entries = check_file(Path(opts["check"]))
            print(f"{opts['check']}: {len(entries)} variables, format OK for the deepspeed launcher\n"
                  + summary(entries))
            return 0
        entries = {**collect(add=tuple(opts["add"])), **opts["set"]}
        if opts["print"]:
            render(entries)  # same checks as writing
            print(summary(entries))
            return 0
        path = Path(opts["output"])
        write(path, entries)
        secrets = [k for k in entries if is_secret(k)]
        print(f"wrote {len(entries)} variables to {path} (mode 0600):\n{summary(entries)}")
        if secrets:
            print(f"note: {path} holds {', '.join(secrets)}; keep it out of version control")
        if path.resolve().parent != Path.cwd().resolve() and path.resolve() != (Path.home() / ".deepspeed_env"):
            print("note: the deepspeed launcher reads ./.deepspeed_env in the directory you launch from, "
                  "~/.deepspeed_env, or the file named by DS_ENV_FILE (a name, looked up in those two places)")
    return 0
