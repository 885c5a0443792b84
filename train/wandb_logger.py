"""Weights & Biases through Accelerate's tracker API, on the main process only.

The mode comes from logging.wandb.mode (run file / CLI), else $WANDB_MODE, else "disabled";
an explicit setting wins, as in wandb.init itself. "disabled" never imports wandb.

Only rank 0 talks to W&B, but every rank must learn the outcome: a rank-0-only failure
would leave the other ranks blocked in their next collective until the timeout. So both
the credential check (preflight) and the run start end in one broadcast from rank 0, and
every rank raises the same error.

Resuming: the run id lives in TrainState.wandb_run_id (saved with each checkpoint and
restored before Trainer.start()); it is passed back with resume="allow", so a resumed
training appends to the same run. The API key is never printed or logged.
"""

from __future__ import annotations

import os
import secrets
import string
from pathlib import Path
from typing import Optional

from train.errors import ConfigError

MODES = ("online", "offline", "disabled")
_WANDB_ALIASES = {"dryrun": "offline", "run": "online"}  # older spellings wandb still accepts


def resolve_mode(configured: Optional[str], env=None) -> str:
    env = os.environ if env is None else env
    if configured:
        return configured
    raw = env.get("WANDB_MODE", "").strip()
    if not raw:
        return "disabled"
    mode = _WANDB_ALIASES.get(raw.lower(), raw.lower())
    if mode not in MODES:
        raise ConfigError(f'environment variable WANDB_MODE="{raw}" is not online, offline or disabled; '
                          f"fix or unset it, or set --logging.wandb.mode")
    return mode


def log_with(cfg) -> Optional[str]:
    """The Accelerator's log_with: "wandb" unless W&B is disabled."""
    return None if resolve_mode(cfg.logging.wandb.mode) == "disabled" else "wandb"


def credential_source() -> Optional[str]:
    """Where wandb would find an API key, without network and without reading it out:
    the env var, ~/.netrc (or $NETRC) for the configured host, or wandb's settings file."""
    if os.environ.get("WANDB_API_KEY"):
        return "WANDB_API_KEY"
    if os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "WANDB_IDENTITY_TOKEN_FILE"
    from wandb.sdk import wandb_setup
    settings = wandb_setup.singleton().settings
    try:
        from wandb.sdk.lib.wbauth import read_netrc_auth
        if read_netrc_auth(host=settings.base_url):
            return "netrc"
    except ImportError:  # other wandb versions: read the netrc ourselves
        import netrc
        from urllib.parse import urlsplit
        try:
            if netrc.netrc(os.environ.get("NETRC")).authenticators(urlsplit(settings.base_url).netloc):
                return "netrc"
        except (OSError, netrc.NetrcParseError):
            pass
    except Exception as e:  # a malformed key: wandb names the problem (not the key)
        raise ConfigError(f"W&B credentials are unusable ({_scrub(str(e))}); run `wandb login --relogin`") from None
    if settings.api_key:
        return "wandb settings"
    return None


def _scrub(text: str) -> str:
    key = os.environ.get("WANDB_API_KEY")
    return text.replace(key, "***") if key else text


def _check(acc, problem: Optional[str]):
    """Rank 0's verdict to every rank; all raise the same ConfigError."""
    from accelerate.utils import broadcast_object_list
    verdict = broadcast_object_list([problem], from_process=0)[0]
    if verdict:
        raise ConfigError(verdict)


def preflight(acc, cfg):
    """Fail before the model is built: online mode needs credentials (wandb would otherwise
    prompt on a terminal and block the other ranks, or fail only after the model is built)."""
    problem = None
    if acc.is_main_process:
        try:
            if resolve_mode(cfg.logging.wandb.mode) == "online" and credential_source() is None:
                problem = ("logging.wandb.mode is online but W&B has no API key on this machine; run `wandb login`, "
                           "set WANDB_API_KEY (under the deepspeed launcher put it in .deepspeed_env, see "
                           "docs/observability.md), or use --logging.wandb.mode offline and `wandb sync` later")
        except ConfigError as e:
            problem = str(e)
    _check(acc, problem)


class WandbSink:
    """Metrics sink (log/close) over Accelerate's wandb tracker; only exists on the main process."""

    def __init__(self, acc, run):
        self.acc, self.run = acc, run
        self.preempted = False
        self.mode = "offline" if run.settings.mode in ("offline", "dryrun") else "online"

    @property
    def location(self) -> str:
        if self.mode == "online":
            return self.run.url or self.run.id
        return f"{Path(self.run.dir).parent}  (upload: wandb sync {Path(self.run.dir).parent})"

    def log(self, metrics: dict, step: int):
        self.acc.log(metrics, step=step)

    def mark_preempting(self):
        """Stopped by a signal, checkpointed, to be resumed. W&B's contract for that is
        mark_preempting() plus a non-zero exit code (exit 0 would read as "finished")."""
        self.run.mark_preempting()
        self.preempted = True

    def close(self, failed: bool = False):
        # Accelerate's end_training() would finish with exit code 0 even after a crash.
        self.run.finish(exit_code=1 if failed or self.preempted else 0)


def start(trainer) -> Optional[WandbSink]:
    """Start (or resume) the W&B run on rank 0 and share its id with every rank.
    Returns the sink on rank 0 when W&B is on, else None."""
    acc, cfg, st = trainer.acc, trainer.cfg, trainer.state
    wcfg = cfg.logging.wandb
    sink, problem, run_id = None, None, st.wandb_run_id
    if acc.is_main_process:
        try:
            mode = resolve_mode(wcfg.mode)
            if mode != "disabled":
                sink = _init_run(acc, cfg, trainer, mode, run_id)
                run_id = sink.run.id
        except Exception as e:  # network, auth, permissions: say what to do, keep the key out
            problem = str(e) if isinstance(e, ConfigError) else (
                f"W&B could not start the run ({type(e).__name__}: {_scrub(str(e)).strip()[:500]}); check "
                f"logging.wandb.project/entity and network access, or use --logging.wandb.mode offline")
            # A tracker whose wandb.init failed has no run; end_training() would then raise
            # AttributeError during clean-up and hide this message.
            acc.trackers = [t for t in acc.trackers if t.name != "wandb"]
    from accelerate.utils import broadcast_object_list
    problem, run_id = broadcast_object_list([problem, run_id], from_process=0)
    if problem:
        raise ConfigError(problem)
    st.wandb_run_id = run_id  # every rank: whichever rank writes the checkpoint state has it
    return sink


def new_run_id() -> str:
    """8 characters of [a-z0-9], the shape of wandb's own run ids."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _init_run(acc, cfg, trainer, mode: str, run_id: Optional[str]) -> WandbSink:
    wcfg = cfg.logging.wandb
    if "wandb" not in [str(t) for t in acc.log_with or []]:
        raise RuntimeError('W&B is on but the Accelerator was built without log_with="wandb" '
                           "(build it with wandb_logger.log_with(cfg))")
    init = {"id": run_id or new_run_id(), "resume": "allow", "mode": mode,
            "name": wcfg.name or Path(trainer.run_dir).name, "tags": list(wcfg.tags), "group": wcfg.group,
            "entity": wcfg.entity}
    if "WANDB_DIR" not in os.environ:
        init["dir"] = str(trainer.run_dir)  # <run_dir>/wandb/, next to metrics.jsonl
    acc.init_trackers(wcfg.project, config=trainer.resolved_config,
                      init_kwargs={"wandb": {k: v for k, v in init.items() if v is not None}})
    return WandbSink(acc, acc.get_tracker("wandb", unwrap=True))
