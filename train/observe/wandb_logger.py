"""Weights & Biases through Accelerate's WandBTracker, on the main process only.

The mode: logging.wandb.mode online / offline / disabled wins (as wandb.init's mode= does). auto
follows wandb's own rules: $WANDB_DISABLED=true (transformers' switch) turns W&B off; else the mode
wandb's settings resolve to ($WANDB_MODE over its settings files); when that is wandb's default,
online, the run goes online when wandb finds credentials for its server (its own lookup, no
network, no prompt) and offline under <run_dir>/wandb (or $WANDB_DIR) for a later `wandb sync`
when it finds none; off with a note without the wandb package. auto's online run that cannot
start (no network, rejected key) becomes an offline run; a requested mode fails instead.

Only rank 0 talks to W&B; trackers.py shares its verdicts with every rank. Resuming: the run id
lives in TrainState.wandb_run_id (saved with each checkpoint) and goes back to wandb.init with
resume="allow". The API key is never read out, printed or logged.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from accelerate.tracking import WandBTracker

from zerotrain.train.errors import ConfigError

LOGIN_HINT = "`wandb login` or WANDB_API_KEY to log online"


@dataclass(frozen=True)
class WandbMode:
    """What W&B will do and why (the why goes into the start-up line). `requested`: asked for (run
    file, CLI, env, settings file), so it fails when it cannot be honoured; auto's guess falls back."""
    mode: str         # online | offline | disabled
    reason: str       # e.g. "WANDB_MODE=offline", "auto: no W&B credentials; ..."
    requested: bool


def installed() -> bool:
    return importlib.util.find_spec("wandb") is not None


def _scrub(text: str) -> str:
    key = os.environ.get("WANDB_API_KEY")
    return text.replace(key, "***") if key else text


def _oneline(e: BaseException, limit: int = 300) -> str:
    """An exception's message for a one-line error: whitespace collapsed, shortened, key removed."""
    text = " ".join(_scrub(str(e)).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _settings():
    """wandb's own settings for this process (env vars over settings files; the ones wandb.init
    starts from). An empty WANDB_* variable counts as unset (wandb would reject "" as a mode)."""
    for name in [k for k, v in os.environ.items() if k.startswith("WANDB_") and not v.strip()]:
        del os.environ[name]
    from wandb.sdk import wandb_setup
    try:
        return wandb_setup.singleton().settings
    except Exception as e:  # a bad WANDB_MODE or settings file: pydantic's validation error
        raise ConfigError(f"wandb rejects its settings ({_oneline(e)}); fix the WANDB_* environment variable "
                          f"or wandb settings file it names, or set --logging.wandb.mode") from None


def has_credentials(settings) -> bool:
    """Whether wandb finds credentials for its server (settings.base_url) without prompting."""
    from wandb.sdk.lib import wbauth
    try:
        return wbauth.authenticate_session(host=wbauth.HostUrl(settings.base_url, app_url=settings.app_url),
                                           source="zerotrain", prompt=False, update_session=False) is not None
    except Exception as e:  # a malformed key: wandb.init would fail the same way
        raise ConfigError(f"W&B credentials are unusable ({_oneline(e)}); fix them (`wandb login --relogin`, "
                          f"WANDB_API_KEY) or use --logging.wandb.mode offline") from None


def choose(configured: Optional[str]) -> WandbMode:
    """The mode W&B runs in (module docstring: the precedence)."""
    if configured not in (None, "auto"):
        return WandbMode(configured, f"logging.wandb.mode {configured}", True)
    disabled, env = os.environ.get("WANDB_DISABLED", "").strip(), os.environ.get("WANDB_MODE", "").strip()
    if disabled.lower() in ("1", "true", "yes", "on"):
        return WandbMode("disabled", f"WANDB_DISABLED={disabled}", True)
    if env == "disabled":  # wandb's own top source: settled without importing wandb
        return WandbMode("disabled", "WANDB_MODE=disabled", True)
    if not installed():
        return WandbMode("disabled", "the wandb package is not installed", False)
    settings = _settings()
    mode = {"dryrun": "offline", "run": "online", "shared": "online"}.get(settings.mode, settings.mode)
    if mode != "online" or env:
        return WandbMode(mode, f"WANDB_MODE={env}" if env else f"mode = {mode} in wandb's settings", True)
    if has_credentials(settings):
        return WandbMode("online", "W&B credentials found", False)
    return WandbMode("offline", f"auto: no W&B credentials; {LOGIN_HINT}", False)


def problem(cfg) -> Optional[str]:
    """Rank 0, before the model is built: why W&B cannot run as asked (None: it can). A requested
    online mode needs credentials (wandb would prompt on a terminal and block the other ranks, or
    fail only after the model is built); a requested online / offline mode needs the package."""
    choice = choose(cfg.logging.wandb.mode)
    if choice.mode != "disabled" and not installed():
        return (f"W&B is on ({choice.reason}) but the wandb package is not installed; pip install wandb, "
                f"or turn W&B off with --logging.wandb.mode disabled")
    if choice.mode == "online" and choice.requested and not has_credentials(_settings()):
        return (f"logging.wandb.mode is online but W&B has no API key on this machine (online via {choice.reason}); "
                "run `wandb login`, set WANDB_API_KEY (under the deepspeed launcher put it in .deepspeed_env, see "
                "docs/observability.md), or use --logging.wandb.mode offline and `wandb sync` later")
    return None


class WandbTracker(WandBTracker):
    """Accelerate's WandBTracker that finishes with the run's outcome (its finish() always
    reports success), keeps events in the summary and says where the run went."""
    exit_code = 0

    def event(self, values: dict, step: Optional[int] = None):
        """Also in the run's summary: after a resume W&B drops rows whose step is below the last
        one it recorded (its steps only grow), and the event is logged at the resumed step."""
        self.run.summary.update(values)
        self.log(values, step=step)

    def mark_preempting(self):
        """Stopped by a signal, checkpointed, to be resumed: W&B's contract for that is
        mark_preempting() plus a non-zero exit code (exit 0 would read as "finished")."""
        self.run.mark_preempting()
        self.exit_code = 1

    def fail(self):  # Loggers.close(failed=True)
        self.exit_code = 1

    def finish(self):
        self.run.finish(exit_code=self.exit_code)

    @property
    def location(self) -> str:
        """Online: the run's URL. Offline: the directory `wandb sync` uploads (the summary's line)."""
        sync_dir = Path(self.run.dir).parent  # <wandb dir>/offline-run-<time>-<id>
        return f"{sync_dir}  (upload: wandb sync {sync_dir})" if self.run.settings._offline else (self.run.url or self.run.id)

    def status(self, note: str = "") -> str:
        """The start-up line: where this run's W&B data goes."""
        where, _, sync = self.location.partition("  (upload: ")
        line = f"W&B offline run in {where}; upload with: {sync[:-1]}" if sync else f"W&B run {where}"
        return line + (f"  ({note})" if note else "")


def start(cfg, run_id: Optional[str], run_dir: Path, config: dict) -> tuple[Optional[WandbTracker], str]:
    """Rank 0: start (or resume, from `run_id`) the W&B run. Returns (the started tracker, or
    None when W&B is off; the start-up line). auto's online run that cannot start becomes an
    offline run with the same id; a requested mode raises ConfigError instead."""
    choice = choose(cfg.logging.wandb.mode)
    if choice.mode == "disabled":
        return None, (f"W&B off: {choice.reason} (pip install wandb to log there)" if not choice.requested
                      else f"W&B disabled ({choice.reason})")
    from wandb.sdk.lib.runid import generate_id
    run_id = run_id or generate_id()  # auto's offline retry keeps it (a resumed run's too)
    try:
        tracker = _init(cfg, run_dir, config, choice.mode, run_id)
        return tracker, tracker.status("" if choice.requested or choice.mode == "online" else choice.reason)
    except Exception as e:  # network, auth, permissions: say what to do, keep the key out
        why = f"{type(e).__name__}: {_oneline(e)}"
        if choice.requested or choice.mode != "online":
            raise ConfigError(f"W&B could not start the run ({why}); check logging.wandb.project/entity and "
                              f"network access, or use --logging.wandb.mode offline") from None
    import wandb
    wandb.teardown()  # its service keeps the failed run's id reserved ("run ID ... is in use")
    tracker = _init(cfg, run_dir, config, "offline", run_id)
    return tracker, tracker.status(f"auto: online failed, {why}")


def _init(cfg, run_dir: Path, config: dict, mode: str, run_id: str) -> WandbTracker:
    wcfg = cfg.logging.wandb
    init = {"id": run_id, "resume": "allow", "mode": mode, "name": wcfg.name or Path(run_dir).name,
            "tags": list(wcfg.tags), "group": wcfg.group, "entity": wcfg.entity}
    if "WANDB_DIR" not in os.environ:
        init["dir"] = str(run_dir)  # <run_dir>/wandb/, next to metrics.jsonl
    if not any(os.environ.get(k) for k in ("WANDB_QUIET", "WANDB_SILENT")):
        # The banner and the summary say where the run is; wandb's own start lines and its
        # ~30-line history/summary footer would bury them (warnings and errors still show).
        init["settings"] = {"quiet": True}
    tracker = WandbTracker(wcfg.project, **{k: v for k, v in init.items() if v is not None})
    tracker.start()
    tracker.store_init_configuration(config)
    return tracker
