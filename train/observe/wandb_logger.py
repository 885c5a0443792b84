"""Weights & Biases through Accelerate's tracker API, on the main process only.

The mode comes from logging.wandb.mode (run file / CLI; default "auto"):
- online / offline / disabled set there win over the environment, as in wandb.init itself;
- auto: $WANDB_DISABLED=true -> disabled, else $WANDB_MODE, else a mode set by `wandb offline`
  / `wandb disabled` in wandb's settings files, else online when W&B credentials exist on this
  machine (credential_source: no network, no import of wandb, the key is never read out) and
  an offline run under <run_dir>/wandb (or $WANDB_DIR) for a later `wandb sync` when they do
  not. Without the wandb package auto turns W&B off with a note; an explicit mode fails. When
  auto's online run cannot start (no network, rejected key) it becomes an offline run; an
  explicit online fails with one error.
"disabled" never imports wandb. Rank 0 prints where the run went (Trainer.start's banner).

Only rank 0 talks to W&B, but every rank must learn the outcome: a rank-0-only failure
would leave the other ranks blocked in their next collective until the timeout. So both
the credential check (preflight) and the run start end in one broadcast from rank 0, and
every rank raises the same error.

Resuming: the run id lives in TrainState.wandb_run_id (saved with each checkpoint and
restored before Trainer.start()); it is passed back with resume="allow", so a resumed
training appends to the same run. The API key is never printed or logged.
"""

from __future__ import annotations

import configparser
import importlib.util
import netrc
import os
import queue
import secrets
import string
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional
from urllib.parse import urlsplit

from zerotrain.train.errors import ConfigError

MODES = ("online", "offline", "disabled")
_WANDB_ALIASES = {"dryrun": "offline", "run": "online"}  # older spellings wandb still accepts
_TRUE = ("1", "true", "yes", "on")
DEFAULT_BASE_URL = "https://api.forge.coreweave.com"  # wandb 0.31's; earlier versions: https://api.wandb.ai
# CoreWeave Forge hosts and the W&B API host behind each (wandb.sdk.lib.urls.FORGE_HOSTS): a
# netrc entry for either name holds the key, as `wandb login` of any version may have written.
_FORGE_HOSTS = {"forge.coreweave.com": "api.wandb.ai", "qa.forge.coreweave.com": "api.qa.wandb.ai"}
LOGIN_HINT = "`wandb login` or WANDB_API_KEY to log online"


@dataclass(frozen=True)
class WandbMode:
    """What W&B will do and why (the why goes into the start-up line)."""
    mode: str         # online | offline | disabled
    reason: str       # e.g. "WANDB_MODE=offline", "credentials from ~/.netrc", "auto: no W&B credentials; ..."
    requested: bool   # asked for (run file, CLI, env, settings file) rather than guessed by auto:
    #                   a requested mode fails when it cannot be honoured, a guessed one falls back


def _home(env: Mapping[str, str]) -> Path:
    return Path(env["HOME"]) if env.get("HOME") else Path.home()


def _settings(env: Mapping[str, str], cwd: Optional[Path] = None) -> tuple[dict[str, str], dict[str, Path]]:
    """wandb's settings files, as wandb reads them: the global one ($WANDB_CONFIG_DIR/settings,
    else ~/.config/wandb/settings), overridden by the workspace one (./wandb/settings, written
    by `wandb offline` / `wandb disabled`); section [default]. Unreadable files count as empty.
    Returns the merged settings and the file each came from."""
    config_dir = Path(env["WANDB_CONFIG_DIR"]).expanduser() if env.get("WANDB_CONFIG_DIR") else \
        _home(env) / ".config" / "wandb"
    merged, origin = {}, {}
    for path in (config_dir / "settings", (cwd or Path.cwd()) / "wandb" / "settings"):
        parser = configparser.ConfigParser(interpolation=None)
        try:
            if not path.is_file() or not parser.read(path) or not parser.has_section("default"):
                continue
        except (OSError, configparser.Error, UnicodeDecodeError):
            continue
        merged.update(parser["default"])
        origin.update((key, path) for key in parser["default"])
    return merged, origin


def _netrc_path(env: Mapping[str, str]) -> Path:
    """The file wandb reads: $NETRC, else ~/.netrc, else ~/_netrc, else ~/.netrc."""
    if env.get("NETRC"):
        return Path(env["NETRC"]).expanduser()
    home = _home(env)
    for name in (".netrc", "_netrc"):
        if (home / name).exists():
            return home / name
    return home / ".netrc"


def _netrc_hosts(base_url: str) -> list[str]:
    """The netrc machine names wandb looks up for its server: the URL's host[:port], then, for
    a Forge host, the W&B API host behind it (wandb.sdk.lib.wbauth.wbnetrc)."""
    parts = urlsplit(base_url)
    hosts = [parts.netloc] if parts.netloc else []
    for forge, api in _FORGE_HOSTS.items():
        if parts.hostname in (forge, f"api.{forge}", api) and api not in hosts:
            hosts.append(api)
    return hosts


def credential_source(env: Optional[Mapping[str, str]] = None, cwd: Optional[Path] = None) -> Optional[str]:
    """Where wandb would find credentials for its server, without network, without importing
    wandb and without reading the key out: "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", the
    netrc file holding a password for the server's host ($WANDB_BASE_URL, else base_url in
    wandb's settings, else W&B's cloud: what `wandb login` writes), or "wandb settings" (an
    api_key there). None when there are none (wandb would prompt, or fail without a terminal)."""
    env = os.environ if env is None else env
    if env.get("WANDB_API_KEY"):
        return "WANDB_API_KEY"
    if env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "WANDB_IDENTITY_TOKEN_FILE"
    settings, _ = _settings(env, cwd)
    hosts = _netrc_hosts(env.get("WANDB_BASE_URL") or settings.get("base_url") or DEFAULT_BASE_URL)
    path = _netrc_path(env)
    try:
        entries = netrc.netrc(str(path)) if path.is_file() else None
    except (OSError, netrc.NetrcParseError, UnicodeDecodeError):  # wandb warns and ignores it too
        entries = None
    creds = next((c for c in (entries.authenticators(h) for h in hosts) if c), None) if entries else None
    if creds and creds[2]:
        home = _home(env)
        return f"~/{path.relative_to(home)}" if path.is_relative_to(home) else str(path)
    if settings.get("api_key"):
        return "wandb settings"
    return None


def installed() -> bool:
    return importlib.util.find_spec("wandb") is not None


def choose(configured: Optional[str], env: Optional[Mapping[str, str]] = None, cwd: Optional[Path] = None,
           have_wandb: Optional[bool] = None) -> WandbMode:
    """The mode W&B runs in (module docstring: the precedence)."""
    env = os.environ if env is None else env
    if configured not in (None, "auto"):
        return WandbMode(configured, f"logging.wandb.mode {configured}", True)
    disabled = env.get("WANDB_DISABLED", "").strip()
    if disabled.lower() in _TRUE:
        return WandbMode("disabled", f"WANDB_DISABLED={disabled}", True)
    raw = env.get("WANDB_MODE", "").strip()
    if raw:
        mode = _WANDB_ALIASES.get(raw.lower(), raw.lower())
        if mode not in MODES:
            raise ConfigError(f'environment variable WANDB_MODE="{raw}" is not online, offline or disabled; '
                              f"fix or unset it, or set --logging.wandb.mode")
        return WandbMode(mode, f"WANDB_MODE={raw}", True)
    settings, origin = _settings(env, cwd)
    mode = settings.get("mode", "").strip().lower()
    mode = _WANDB_ALIASES.get(mode, mode)
    if mode in ("offline", "disabled"):  # `wandb offline` / `wandb disabled`; "online" is just the default
        return WandbMode(mode, f"mode = {mode} in {origin['mode']}", True)
    if not (installed() if have_wandb is None else have_wandb):
        return WandbMode("disabled", "the wandb package is not installed", False)
    source = credential_source(env, cwd)
    if source:
        return WandbMode("online", f"credentials from {source}", False)
    return WandbMode("offline", f"auto: no W&B credentials; {LOGIN_HINT}", False)


def resolve_mode(configured: Optional[str], env: Optional[Mapping[str, str]] = None) -> str:
    return choose(configured, env).mode


def log_with(cfg) -> Optional[str]:
    """The Accelerator's log_with: "wandb" unless W&B is disabled."""
    return None if resolve_mode(cfg.logging.wandb.mode) == "disabled" else "wandb"


def _scrub(text: str) -> str:
    key = os.environ.get("WANDB_API_KEY")
    return text.replace(key, "***") if key else text


def _oneline(e: BaseException, limit: int) -> str:
    """An exception's message for a one-line error: whitespace collapsed, shortened, key removed."""
    text = " ".join(_scrub(str(e)).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check(acc, problem: Optional[str]):
    """Rank 0's verdict to every rank; all raise the same ConfigError."""
    from accelerate.utils import broadcast_object_list
    verdict = broadcast_object_list([problem], from_process=0)[0]
    if verdict:
        raise ConfigError(verdict)


def preflight(acc, cfg):
    """Fail before the model is built: a requested online mode needs credentials (wandb would
    otherwise prompt on a terminal and block the other ranks, or fail only after the model is
    built), and a requested online / offline mode needs the wandb package."""
    problem = None
    if acc.is_main_process:
        try:
            choice = choose(cfg.logging.wandb.mode)
            if choice.mode != "disabled" and not installed():
                problem = (f"W&B is on ({choice.reason}) but the wandb package is not installed; pip install wandb, "
                           f"or turn W&B off with --logging.wandb.mode disabled")
            elif choice.mode == "online" and choice.requested and credential_source() is None:
                problem = (f"logging.wandb.mode is online but W&B has no API key on this machine (online via "
                           f"{choice.reason}); run `wandb login`, set WANDB_API_KEY (under the deepspeed launcher "
                           "put it in .deepspeed_env, see docs/observability.md), or use --logging.wandb.mode offline "
                           "and `wandb sync` later")
        except ConfigError as e:
            problem = str(e)
    _check(acc, problem)


class WandbSink:
    """Metrics sink (log/close) over Accelerate's wandb tracker; only exists on the main process.

    Every call into wandb runs on one background writer thread, in order (a queue), so that a
    log line costs the training step no wandb work (issue 24: the offline writer cost a small
    CPU model ~9% of its step time when called inline). close() drains the queue and joins it."""

    def __init__(self, acc, run):
        self.acc, self.run = acc, run
        self.preempted = False
        self.mode = "offline" if run.settings.mode in ("offline", "dryrun") else "online"
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: Optional[BaseException] = None
        self._writer = threading.Thread(target=self._drain, name="zerotrain-wandb", daemon=True)
        self._writer.start()

    def _drain(self):
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - re-raised on the training thread (close / next call)
                self._error = self._error or e

    def _submit(self, job):
        if self._error is not None:
            e, self._error = self._error, None
            raise e
        self._queue.put(job)

    @property
    def run_dir(self) -> Path:
        """offline: the directory `wandb sync` uploads (<wandb dir>/offline-run-<time>-<id>)."""
        return Path(self.run.dir).parent

    @property
    def location(self) -> str:
        if self.mode == "online":
            return self.run.url or self.run.id
        return f"{self.run_dir}  (upload: wandb sync {self.run_dir})"

    def status(self, note: str = "") -> str:
        """The start-up line: where this run's W&B data goes."""
        if self.mode == "online":
            return f"W&B run {self.run.url or self.run.id}" + (f"  ({note})" if note else "")
        return (f"W&B offline run in {self.run_dir}; upload with: wandb sync {self.run_dir}"
                + (f"  ({note})" if note else ""))

    def log(self, metrics: dict, step: int):
        metrics = dict(metrics)  # the caller may reuse its dict
        self._submit(lambda: self.acc.log(metrics, step=step))

    def event(self, metrics: dict, step: int):
        """Also in the run's summary: after a resume W&B drops rows whose step is below the last
        one it recorded (its steps only grow), and the event is logged at the resumed step."""
        metrics = dict(metrics)
        self._submit(lambda: self.run.summary.update(metrics))
        self.log(metrics, step)

    def mark_preempting(self):
        """Stopped by a signal, checkpointed, to be resumed. W&B's contract for that is
        mark_preempting() plus a non-zero exit code (exit 0 would read as "finished")."""
        self._submit(self.run.mark_preempting)
        self.preempted = True

    def flush(self):
        """Wait until every queued call has run (and raise the first error one raised)."""
        done = threading.Event()
        self._queue.put(done.set)
        done.wait()
        self._submit(lambda: None)  # raises a stored error

    def close(self, failed: bool = False):
        # Accelerate's end_training() would finish with exit code 0 even after a crash.
        exit_code = 1 if failed or self.preempted else 0
        self._queue.put(lambda: self.run.finish(exit_code=exit_code))
        self._queue.put(None)
        self._writer.join()
        if self._error is not None:
            e, self._error = self._error, None
            raise e


def start(acc, cfg, run_id: Optional[str], run_dir: Path,
          resolved_config: dict) -> tuple[Optional[WandbSink], Optional[str], Optional[str]]:
    """Start (or resume, from `run_id`: the TrainState's, which checkpoints save) the W&B run on
    rank 0 and share its id with every rank. Returns (the sink on rank 0 when W&B is on, else
    None; rank 0's start-up line: the run URL, the offline directory and its `wandb sync`, or why
    W&B is off; the run id every rank keeps in its TrainState). auto mode that chose online falls back to an offline
    run when the run cannot start online (no network, rejected key); a requested mode stops every
    rank with one error instead. `resolved_config` becomes the W&B run's config."""
    wcfg = cfg.logging.wandb
    sink, status, problem = None, None, None
    if acc.is_main_process:
        try:
            choice = choose(wcfg.mode)
            if choice.mode == "disabled":
                status = (f"W&B off: {choice.reason} (pip install wandb to log there)"
                          if not choice.requested else f"W&B disabled ({choice.reason})")
            else:
                run_id = run_id or new_run_id()  # auto's offline retry keeps it (a resumed run's too)
                try:
                    sink = _init_run(acc, cfg, run_dir, resolved_config, choice.mode, run_id)
                    note = "" if choice.requested or choice.mode == "online" else choice.reason
                except Exception as e:
                    _drop_tracker(acc)
                    if choice.requested or choice.mode != "online" or isinstance(e, ConfigError):
                        raise
                    why = f"{type(e).__name__}: {_oneline(e, 200)}"
                    import wandb
                    wandb.teardown()  # its service keeps the failed run's id reserved ("run ID ... is in use")
                    sink = _init_run(acc, cfg, run_dir, resolved_config, "offline", run_id)
                    note = f"auto: online failed, {why}"
                status = sink.status(note)
                run_id = sink.run.id
        except Exception as e:  # network, auth, permissions: say what to do, keep the key out
            problem = str(e) if isinstance(e, ConfigError) else (
                f"W&B could not start the run ({type(e).__name__}: {_oneline(e, 500)}); check "
                f"logging.wandb.project/entity and network access, or use --logging.wandb.mode offline")
            _drop_tracker(acc)
    from accelerate.utils import broadcast_object_list
    problem, run_id = broadcast_object_list([problem, run_id], from_process=0)
    if problem:
        raise ConfigError(problem)
    return sink, status, run_id  # every rank keeps it: whichever rank writes the checkpoint state has it


def _drop_tracker(acc):
    """A tracker whose wandb.init failed has no run; end_training() would then raise
    AttributeError during clean-up and hide the message (and a retry would start it twice)."""
    acc.trackers = [t for t in acc.trackers if t.name != "wandb"]


def new_run_id() -> str:
    """8 characters of [a-z0-9], the shape of wandb's own run ids."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _init_run(acc, cfg, run_dir: Path, resolved_config: dict, mode: str, run_id: Optional[str]) -> WandbSink:
    wcfg = cfg.logging.wandb
    if "wandb" not in [str(t) for t in acc.log_with or []]:
        raise RuntimeError('W&B is on but the Accelerator was built without log_with="wandb" '
                           "(build it with wandb_logger.log_with(cfg))")
    init = {"id": run_id or new_run_id(), "resume": "allow", "mode": mode,
            "name": wcfg.name or Path(run_dir).name, "tags": list(wcfg.tags), "group": wcfg.group,
            "entity": wcfg.entity}
    if "WANDB_DIR" not in os.environ:
        init["dir"] = str(run_dir)  # <run_dir>/wandb/, next to metrics.jsonl
    for name in [k for k, v in os.environ.items() if k.startswith("WANDB_") and not v.strip()]:
        # Empty means unset here (choose()); wandb 0.31 rejects "" as a mode or a boolean.
        del os.environ[name]
    if not any(os.environ.get(k) for k in ("WANDB_QUIET", "WANDB_SILENT")):
        # The banner and the summary say where the run is; wandb's own start lines and its
        # ~30-line history/summary footer would bury them (warnings and errors still show).
        init["settings"] = {"quiet": True}
    acc.init_trackers(wcfg.project, config=resolved_config,
                      init_kwargs={"wandb": {k: v for k, v in init.items() if v is not None}})
    return WandbSink(acc, acc.get_tracker("wandb", unwrap=True))
