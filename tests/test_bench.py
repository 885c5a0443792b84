"""bench/stages.py --quick: the stage benchmark runs end to end (trainer + bench/plain_loop.py, 2
processes) and reports what BENCHMARKS.md is made of, so the script cannot rot. Speed is
never asserted (DEVELOPERS.md: no timed assertions); only that the numbers exist and hold
together."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO, subprocess_env


@pytest.mark.multiproc
def test_quick_benchmark_reports_throughput_memory_and_planner_error(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "stages.py"), "--quick", "--out", str(tmp_path)],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(next(tmp_path.glob("stages-*.json")).read_text())
    assert result["meta"]["machine"]["cpu_cores"] and result["meta"]["command"].startswith("python")
    (r,) = result["results"]
    assert r["config"] == "zero2"
    trainer, minimal = r["trainer"][0], r["minimal"][0]
    # --quick: 6 steps, 2 warm-up, windows of 2 -> 2 timed windows each
    assert len(trainer["window_tokens_per_s"]) == len(minimal["window_tokens_per_s"]) == 2
    assert r["trainer_tokens_per_s"] > 0 and r["minimal_tokens_per_s"] > 0
    assert r["throughput_ratio"] == pytest.approx(r["trainer_tokens_per_s"] / r["minimal_tokens_per_s"])
    assert len(r["peak_bytes_per_rank"]) == 2 and min(r["peak_bytes_per_rank"]) > 100 * 2**20  # max RSS
    assert len(trainer["measured_model_states_per_rank"]) == 2
    assert all(abs(e) < 0.10 for e in r["planner_error_per_rank"]), r["planner_error_per_rank"]
    md = next(tmp_path.glob("stages-*.md")).read_text()
    assert "| zero2 |" in md and "trainer/plain (pairs)" in md


def test_bench_rejects_unknown_configs(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "stages.py"), "--quick", "--configs", "zero9",
                           "--out", str(tmp_path)], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "zero9" in proc.stderr and "zero2" in proc.stderr
