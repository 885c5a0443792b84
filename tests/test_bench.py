"""bench/stages.py --quick: the stage benchmark runs end to end (trainer + bench/plain_loop.py, 2
processes) and reports what BENCHMARKS.md is made of, so the script cannot rot. Speed is
never asserted (DEVELOPERS.md: no timed assertions); only that the numbers exist and hold
together."""

from __future__ import annotations

import json
import statistics
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
    # --quick: 6 steps, 2 warm-up, windows of 2 -> 2 timed windows each, both wall clock
    assert len(trainer["window_tokens_per_s"]) == len(minimal["window_tokens_per_s"]) == 2
    assert trainer["timed_steps"] == 4 and trainer["span_tokens_per_s"] > 0
    assert r["trainer_tokens_per_s"] > 0 and r["minimal_tokens_per_s"] > 0
    assert r["throughput_ratio"] == pytest.approx(r["trainer_tokens_per_s"] / r["minimal_tokens_per_s"])
    # Two plain-loop arms per pair: torch's default threads (the environment's OMP_NUM_THREADS
    # removed) and OMP_NUM_THREADS=1, which the ranks under the deepspeed launcher really ran with.
    assert r["plain_arms"] == ["default", "1thread"] == result["meta"]["plain_arms"]
    (default,), (one,) = r["plain_default"], r["plain_1thread"]
    assert default["omp_num_threads"] is None and default["torch_threads"] >= 1
    assert one["omp_num_threads"] == "1" and one["torch_threads"] == 1
    # "minimal" (what bench/gpu_checks.py reads) is the pair's faster arm: the best plain loop.
    best = max((default, one), key=lambda x: statistics.median(x["window_tokens_per_s"]))
    assert minimal == best
    assert r["pair_ratios"] == [pytest.approx(statistics.median(trainer["window_tokens_per_s"])
                                              / statistics.median(best["window_tokens_per_s"]))]
    assert r["pair_ratios"][0] <= min(r["pair_ratios_default"][0], r["pair_ratios_1thread"][0])
    assert len(r["peak_bytes_per_rank"]) == 2 and min(r["peak_bytes_per_rank"]) > 100 * 2**20  # max RSS
    assert len(trainer["measured_model_states_per_rank"]) == 2
    assert all(abs(e) < 0.10 for e in r["planner_error_per_rank"]), r["planner_error_per_rank"]
    md = next(tmp_path.glob("stages-*.md")).read_text()
    assert "| zero2 |" in md and "trainer / best plain loop (pairs)" in md
    assert "plain torch default threads tok/s" in md and "plain 1 thread/rank tok/s" in md


def test_bench_rejects_unknown_configs(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "stages.py"), "--quick", "--configs", "zero9",
                           "--out", str(tmp_path)], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "zero9" in proc.stderr and "zero2" in proc.stderr


def test_sp_window_benchmark_reports_each_case(tmp_path):
    """bench/sp_window.py at a short row: every case runs in its own process and reports a peak;
    the dense (T, T) mask holds more than the blocked attention (no timing asserted)."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "sp_window.py"), "--seq", "2048", "--window", "64",
                           "--out", str(tmp_path)], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(next(tmp_path.glob("sp_window-*.json")).read_text())["rows"]}
    assert set(rows) == {"causal", "window dense", "window blocked"} and all("peak_bytes" in r for r in rows.values())
    assert rows["window dense"]["peak_bytes"] > rows["window blocked"]["peak_bytes"], rows
    assert next(tmp_path.glob("sp_window-*.md")).read_text().count("| 2048 | 64 |") == 3
