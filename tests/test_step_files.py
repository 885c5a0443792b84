"""docs/architecture.md "One step, file by file": how many of zerotrain's own files one training
step runs, i.e. how many files a maintainer reads to follow a step (issue 36). The doc states two
counts, a step with no log line, evaluation or checkpoint and one that logs, evaluates and saves;
bench/step_files.py measures them (train/main.py under a profiler, 1 process, ZeRO-2). The doc is
the one place the numbers live: these tests read them from its text.

A step may never run MORE files than the doc states: the number is the reader's upper bound. It
may run up to SLACK = 3 fewer. The count moves a module at a time (a call moved into a module of
its own, or one folded into its caller), so a refactor that takes up to three files out of the
path lands without touching the doc, whose table then lists at most 3 files the step no longer
reaches, about a seventh of a plain step of some 20 files. Four or more fewer and the doc
overstates the reading by more than that: the test asks for its numbers and table to be set from
the measurement (the failure lists the files measured).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from helpers import REPO, free_port, subprocess_env

DOC = REPO / "docs" / "architecture.md"
CLAIM = re.compile(r"A step with no log line, evaluation or checkpoint runs (\d+) of zerotrain's files; "
                   r"one that logs, evaluates and saves, (\d+) ")
SLACK = 3
# The doc's two commands (bench/step_files.py's docstring): the plain step, and the default run's step 10.
RUNS = {"plain": ["--step", "7", "--plain"], "log/eval/save": []}


def doc_claims() -> dict[str, int]:
    text = " ".join(DOC.read_text().split())  # the sentence wraps across lines
    m = CLAIM.search(text)
    assert m, f"{DOC.relative_to(REPO)}: no sentence matching {CLAIM.pattern!r} (section \"One step, file by file\")"
    return {"plain": int(m[1]), "log/eval/save": int(m[2])}


def doc_table() -> list[str]:
    """The files the section's table lists for the plain step, in its order."""
    section = DOC.read_text().split("## One step, file by file", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| \d+ \| `([^`]+)` \|", section, re.M)


def test_the_docs_table_lists_the_files_it_counts():
    """The table names exactly as many files as the plain step's stated count, each once, each a
    file of this checkout: the number cannot be bumped without the table, nor a file renamed."""
    table = doc_table()
    assert len(table) == doc_claims()["plain"], table
    assert len(set(table)) == len(table), table
    assert not [f for f in table if not (REPO / f).is_file()], table


@pytest.mark.multiproc
def test_a_step_runs_no_more_files_than_the_architecture_doc_states(tmp_path):
    """Both of the doc's commands, run at once (two 1-process runs)."""
    claims, procs = doc_claims(), {}
    for i, (kind, args) in enumerate(RUNS.items()):
        cmd = [sys.executable, str(REPO / "bench" / "step_files.py"), *args, "--json",
               "--run-dir", str(tmp_path / f"run{i}")]
        with (tmp_path / f"{i}.out").open("w") as out, (tmp_path / f"{i}.err").open("w") as err:
            procs[kind] = (i, subprocess.Popen(cmd, cwd=REPO, env=subprocess_env({"MASTER_PORT": str(free_port())}),
                                               stdout=out, stderr=err))
    try:
        for _, proc in procs.values():
            proc.wait(timeout=900)
    finally:
        for _, proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    problems = []
    for kind, (i, proc) in procs.items():
        stdout, stderr = (tmp_path / f"{i}.out").read_text(), (tmp_path / f"{i}.err").read_text()
        assert proc.returncode == 0, f"{kind}: exit {proc.returncode}\n{stdout[-3000:]}\n{stderr[-3000:]}"
        result = json.loads(stdout.strip().splitlines()[-1])
        files, stated = result["files"], claims[kind]
        assert result["count"] == len(files) > 0, result
        listing = "".join(f"\n  {f}" for f in files)
        untabled = f"; not in its table: {[f for f in files if f not in doc_table()]}" if kind == "plain" else ""
        if len(files) > stated:
            problems.append(f"the {kind} step (step {result['step']}) runs {len(files)} of zerotrain's files, "
                            f"more than the {stated} docs/architecture.md states{untabled}:{listing}")
        elif stated - len(files) > SLACK:
            problems.append(f"the {kind} step (step {result['step']}) runs {len(files)} of zerotrain's files, "
                            f"{stated - len(files)} fewer than the {stated} docs/architecture.md states (slack "
                            f"{SLACK}):{listing}")
    assert not problems, "\n".join(problems) + "\nset docs/architecture.md \"One step, file by file\" from these"
