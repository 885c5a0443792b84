"""How long an elastic membership change takes: two torchrun agents on loopback ("nodes" A and
B, `--nnodes 1:2 --max-restarts 3`, c10d), the tiny GPT in ZeRO-2 fp32, checkpoints every 3
steps; B dies (its agent and rank, ZEROTRAIN_INJECT_KILL_NODE) after step 8 and A finishes alone.
Prints, from the metrics rows and the agent's log, the time from B's death to: A's rank failing,
A's new rank starting, its membership line, its first resumed step.

    .venv/bin/python bench/elastic_recovery.py              # the tests' short rendezvous timeouts
    .venv/bin/python bench/elastic_recovery.py --defaults   # torchrun's default ones
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SHORT = "last_call_timeout=2,join_timeout=300,keep_alive_interval=1,keep_alive_max_attempt=3"
ARGS = ["--model.name", "gpt-tiny", "--data.seq_len", "64", "--data.max_bytes", "300000", "--train.micro_batch_size",
        "4", "--train.global_batch_size", "16", "--logging.progress", "false", "--train.sample_tokens", "0",
        "--train.max_steps", "12", "--train.eval_every", "0", "--logging.every_steps", "1", "--checkpoint.every_steps",
        "3", "--checkpoint.export", "false", "--checkpoint.save_at_end", "false", "--distributed.timeout_s", "60"]
LOG_TIME = re.compile(r"^\S*[EWI]\d{4} (\d\d:\d\d:\d\d\.\d+) \d+ .*?(failed \(exitcode|cpp_extension)", re.M)


def main():
    defaults = "--defaults" in sys.argv
    work = Path(tempfile.mkdtemp(prefix="zt-elastic-bench-"))
    run = work / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "ZEROTRAIN_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    procs = {}
    for name, host in (("B", 0), ("A", 1)):   # the client first: both join the first round together
        conf = f"is_host={host}" + ("" if defaults else f",{SHORT}")
        cmd = [str(BIN / "torchrun"), "--nnodes", "1:2", "--nproc_per_node", "1", "--max-restarts", "3",
               "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", f"bench{port}",
               "--rdzv_conf", conf, "--local_addr", "127.0.0.1", str(REPO / "train" / "main.py"), *ARGS,
               "--ds-config", str(REPO / "ds_configs" / "zero2_fp32.json"), "--train.run_dir", str(run)]
        with open(work / f"{name}.log", "w") as fh:
            procs[name] = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                           env={**env, **({"ZEROTRAIN_INJECT_KILL_NODE": "8"} if name == "B" else {})})
    try:
        codes = {n: p.wait(timeout=900) for n, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, 9)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    death = max(r["time"] for r in rows if r.get("step") == 8 and "loss" in r and r["time"] < min(
        x["time"] for x in rows if x.get("event") == "membership"))
    day = datetime.fromtimestamp(death).strftime("%Y-%m-%d")
    stamps = [(datetime.strptime(f"{day} {t}", "%Y-%m-%d %H:%M:%S.%f").timestamp(), what)
              for t, what in LOG_TIME.findall((work / "A.log").read_text())]
    failed = min(t for t, w in stamps if w.startswith("failed"))
    new_rank = min(t for t, w in stamps if w == "cpp_extension" and t > failed)
    line = min(r["time"] for r in rows if r.get("event") == "membership")
    first = min(r["time"] for r in rows if r.get("step") == 7 and "loss" in r and r["time"] > line)
    print(json.dumps({"rdzv_conf": "torchrun defaults" if defaults else SHORT, "exit_codes": codes,
                      "death_to_rank_failed_s": round(failed - death, 2),
                      "death_to_new_rank_importing_s": round(new_rank - death, 2),
                      "death_to_membership_line_s": round(line - death, 2),
                      "death_to_first_resumed_step_s": round(first - death, 2),
                      "event": next(r for r in rows if r.get("event") == "membership")}, indent=1))
    if sorted(codes.values()) != [-9, 0]:
        sys.exit(f"unexpected exit codes {codes}; logs in {work}")


if __name__ == "__main__":
    main()
