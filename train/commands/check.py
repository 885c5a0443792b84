"""`zerotrain check`: validate a launch before spending cluster time on it.

    zerotrain check --config run.yaml --ds-config ds_configs/zero3.json --hostfile hostfile \
                    [--accelerate-config ds_configs/accelerate/multinode_zero2.yaml] [--cuda] \
                    [--ssh-port N] [--no-ssh-check]

Checks the run file, the DeepSpeed JSON against the run config at the world size the
hostfile / accelerate YAML implies, the hostfile syntax, and that the accelerate YAML
agrees with the hostfile. With a hostfile it also does what `deepspeed --hostfile` needs
first: passwordless ssh to every host (probed in parallel, never prompting; the launch
directory and this Python must exist there) and pdsh for several hosts (train/launch/hostcheck.py);
skipped with --no-ssh-check or when the accelerate YAML's launch uses no ssh. Exit 0 when
everything is consistent, 2 with one message per problem otherwise. Nothing is launched
and no GPU is needed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zerotrain.train.errors import ConfigError, user_errors
from zerotrain.train.launch.hostcheck import Host, check_hosts, parse_hostfile  # noqa: F401 (Host, parse_hostfile: API)


def check_accelerate_yaml(path: str | Path, hosts: list[Host] | None, ds_config: str | None) -> dict:
    from zerotrain.train.config import read_mapping
    cfg = read_mapping(path)
    problems = []
    nproc, nmach = cfg.get("num_processes"), cfg.get("num_machines", 1)
    if hosts is not None:
        total = sum(h.slots for h in hosts)
        if nproc is not None and nproc != total:
            problems.append(f"{path}: num_processes: {nproc} but the hostfile has {total} slots in total "
                            f"({', '.join(f'{h.name}={h.slots}' for h in hosts)}); num_processes counts all machines")
        if nmach != len(hosts):
            problems.append(f"{path}: num_machines: {nmach} but the hostfile lists {len(hosts)} host(s)")
    dsc = (cfg.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if cfg.get("distributed_type") == "DEEPSPEED":
        if not dsc:
            problems.append(f"{path}: distributed_type DEEPSPEED needs deepspeed_config.deepspeed_config_file "
                            f"(one of ds_configs/*.json)")
        elif not Path(dsc).is_file():
            problems.append(f"{path}: deepspeed_config_file {dsc} not found (paths are relative to the "
                            f"directory you launch from)")
        elif ds_config and Path(ds_config).resolve() != Path(dsc).resolve():
            problems.append(f"{path}: deepspeed_config_file {dsc} differs from --ds-config {ds_config}")
    if problems:
        raise ConfigError("\n".join(problems))
    return cfg


def ssh_not_needed(acc: dict | None) -> str | None:
    """Why the launch described by the accelerate YAML starts no process over ssh (None: it does,
    or there is no YAML and the hostfile is for `deepspeed --hostfile`, which always ssh-checks)."""
    if acc is None:
        return None
    launcher = (acc.get("deepspeed_config") or {}).get("deepspeed_multinode_launcher") or "pdsh"
    if acc.get("distributed_type") != "DEEPSPEED" or acc.get("num_machines", 1) <= 1:
        return "accelerate starts this launch on each machine itself, without ssh"
    if launcher in ("standard", "nossh", "slurm"):
        return f"accelerate's deepspeed_multinode_launcher {launcher} starts every machine's ranks without ssh"
    return None


def run_checks(args) -> list[str]:
    from zerotrain.train.config import load_config
    from zerotrain.train.strategy.ds_config import load_ds_setup
    ok = []
    hosts = None
    if args.hostfile:
        hosts = parse_hostfile(args.hostfile)
        ok.append(f"hostfile {args.hostfile}: {len(hosts)} host(s), {sum(h.slots for h in hosts)} slots")
    acc = None
    if args.accelerate_config:
        acc = check_accelerate_yaml(args.accelerate_config, hosts, args.ds_config)
        ok.append(f"accelerate config {args.accelerate_config}: {acc.get('distributed_type')}, "
                  f"{acc.get('num_processes')} processes on {acc.get('num_machines', 1)} machine(s)")
    if hosts:
        why_not = "--no-ssh-check" if args.no_ssh_check else ssh_not_needed(acc)
        if why_not:
            ok.append(f"ssh to the hosts not probed: {why_not}")
        else:
            ok += check_hosts(hosts, args.hostfile, args.ssh_port)
    world = args.world_size or (sum(h.slots for h in hosts) if hosts else None) or \
        (acc or {}).get("num_processes") or 1
    cfg = load_config(args.config, [])
    ok.append(f"run config {args.config or '(defaults)'}: valid")
    ds_path = args.ds_config or ((acc or {}).get("deepspeed_config") or {}).get("deepspeed_config_file") \
        or cfg.distributed.ds_config or "ds_configs/zero2.json"
    batch = cfg.train.batch(world)
    from zerotrain.models import resolve as resolve_model
    from zerotrain.train.plan.memory_check import auto_dir, is_auto
    from zerotrain.train.plan.estimate import OPTIONS
    paths = [ds_path]
    if is_auto(ds_path):  # every candidate --ds-config auto may choose must be valid for this run
        paths = [str(auto_dir(ds_path) / f) for _, f in OPTIONS if (auto_dir(ds_path) / f).is_file()]
        ok.append(f"--ds-config {ds_path}: chooses at start-up among {', '.join(Path(x).name for x in paths)}")
    width = resolve_model(cfg.model).hidden_size  # before any data: None for linear and vision models
    for path in paths:
        ds = load_ds_setup(path, cfg, batch, cfg.train.max_steps, cuda=args.cuda, hidden_size=width,
                           sizes_later=True, launcher_precision=(acc or {}).get("mixed_precision") or "")
        ok.append(f"{path}: {ds.describe()} at world size {world}: micro {batch.micro} x accum {batch.accum} "
                  f"x world {world} = global {batch.global_size}"
                  + (f" ({ds.precision_why})" if ds.precision_why else ""))
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zerotrain check", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="run file (YAML/JSON)")
    p.add_argument("--strategy", "--ds-config", dest="ds_config", help="the strategy file (ds_configs/*.json: DDP, "
                   "DeepSpeed ZeRO or FSDP2); --ds-config is the same flag")
    p.add_argument("--hostfile", help="DeepSpeed hostfile; every host is also ssh-probed as deepspeed --hostfile "
                   "will use it (in parallel, 5 s connect timeout), and pdsh looked for if there are several")
    p.add_argument("--ssh-port", "--ssh_port", type=int, metavar="N",
                   help="the port of the hosts' sshd, as deepspeed --ssh_port N (default: ~/.ssh/config's, or 22)")
    p.add_argument("--no-ssh-check", action="store_true",
                   help="check the hostfile's syntax only (for launches without ssh: deepspeed --no_ssh, torchrun, "
                        "or checking a cluster's files from another machine)")
    p.add_argument("--accelerate-config", help="accelerate launch YAML")
    p.add_argument("--world-size", type=int, help="total processes (default: from the hostfile / YAML)")
    p.add_argument("--cuda", action="store_true", help="check for a CUDA cluster (allows fp16) from a CPU machine")
    args = p.parse_args(argv)
    if args.cuda is False:
        import torch
        args.cuda = torch.cuda.is_available()
    with user_errors():
        for line in run_checks(args):
            print(f"ok  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
