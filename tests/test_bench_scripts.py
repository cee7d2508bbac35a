"""The measurement scripts in bench/ still run: each starts (imports, arguments), and those that need no large
checkpoint run end to end on small ones or the built-in model. They are benchmarks, so only their working is checked
here, not figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "bench").glob("*.py"))


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_starts(script):
    done = run(str(script), "--help", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:")


def test_serve_load_runs_its_phases_on_the_built_in_model(tmp_path):
    """Load phase, the short-during-long prefill phase and a small soak against a live server."""
    out = tmp_path / "load.json"
    done = run("bench/serve_load.py", "--model", "qwenrt/tiny/model", "--quantize", "none", "--clients", "1,2",
               "--requests-per-client", "1", "--prompt-len", "16", "--gen-len", "8", "--long-prompt", "256",
               "--soak", "12", "--soak-concurrency", "4", "--max-model-len", "1024", "--serve-args",
               "--prefix-cache-size 1MiB", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert [row["clients"] for row in figures["load"]] == [1, 2]
    assert all(row["tokens"] == 8 * row["clients"] and row["decode_tok_s"] > 0 for row in figures["load"])
    assert figures["prefill"][0]["long_prompt"] == 256
    soak = next(iter(figures["soak"].values()))
    assert soak["requests"] == 12 and not soak["failures"] and soak["running_after"] == 0
    assert "| configuration | clients |" in done.stdout


def test_profile_decode_times_the_engine_decode_path(dense_ckpt):
    done = run("bench/profile_decode.py", str(dense_ckpt[0]), "--prompt-len", "16", "--steps", "4")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "engine decode path (native layer stack)" in done.stdout, done.stdout
    # the second pass times the stack's kernels one by one: every projection role, the head, the mixers' steps
    rows = {line.split(" | ")[0].strip("| "): line for line in done.stdout.splitlines() if line.startswith("| ")}
    for name in ("LM head", "DeltaNet in-projections", "MLP down", "attention out-projection", "gdn_decode_step",
                 "attention_decode_step", "rms_norm"):
        assert name in rows, (name, done.stdout)
    assert float(rows["LM head"].split("|")[4]) > 0  # its weight GB/s


def test_quality_scores_per_tensor_formats_on_the_built_in_model():
    """bench/quality.py on the built-in model's tasks: a library format and a per-tensor variant, with the variant's
    bytes for the 35B-A3B shape (from its sizes: nothing built)."""
    done = run("bench/quality.py", "--tasks", "--prompts", "2", "--tokens", "32", "--shape", "35b-a3b",
               "--configs", "int4 g64,int4: out_proj int8")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split(" | ")[0].strip("| "): line for line in done.stdout.splitlines() if line.startswith("| int4")}
    assert rows.keys() == {"int4 g64", "int4: out_proj int8"}, done.stdout
    assert "MiB (+0.54%) / " in rows["int4: out_proj int8"]  # the 35B-A3B's 30 DeltaNet out_proj at 8 bits


def test_mtp_cost_times_a_speculative_step_on_the_built_in_model():
    """bench/mtp_cost.py sets up a sequence's queued MTP inputs by hand: it must follow the engine's layout."""
    done = run("bench/mtp_cost.py", "--model", "qwenrt/tiny/model", "--prompt-len", "16", "--repeats", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1].strip() for line in done.stdout.splitlines() if line.startswith("| ")]
    assert {"decode step", "verify 3", "draft 3"} <= set(rows), done.stdout


def test_hostile_review_runs_a_quick_class(tmp_path):
    """bench/hostile_review.py --quick on the checkpoint class: a table whose counts add up, every case ended in an
    outcome of qwenrt's (none from a fault of the review itself, none a hang), and its control (a hub-cache layout as
    the hub writes it) is loaded."""
    out = tmp_path / "review.json"
    done = run("bench/hostile_review.py", "--quick", "--only", "checkpoints", "--workdir", str(tmp_path / "work"),
               "--json", str(out), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["checkpoints"]
    assert len(rows) >= 20 and not [r for r in rows if "(review harness)" in r["detail"] or r["outcome"] == "hang"]
    assert rows[0]["label"] == "hub cache: the layout as the hub writes it" and rows[0]["outcome"] == "handled"
    line = next(line for line in done.stdout.splitlines() if line.startswith("| checkpoints |"))
    cases, *outcomes = map(int, line.strip("| ").split(" | ")[1:])
    assert cases == len(rows) == sum(outcomes), line


def test_clients_reports_libraries_that_are_not_installed(tmp_path):
    """bench/clients.py with every client library failing to import (a package that raises ImportError stands in
    for each): a table of "not installed" rows, not a traceback; no server is contacted."""
    modules = ["openai", "langchain_openai", "litellm", "agents", "pydantic_ai", "instructor", "smolagents", "lm_eval"]
    for module in modules:
        (tmp_path / module).mkdir()
        (tmp_path / module / "__init__.py").write_text(f"raise ImportError('no {module} here')\n")
    done = subprocess.run([sys.executable, "bench/clients.py", "--base-url", "http://127.0.0.1:9", "--model", "m",
                           "--overflow-words", "10"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}"))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.strip("| ").split(" | ") for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[0][:3] == ["client", "version", "chat"] and len(rows) == 1 + 8, done.stdout
    assert all(row[2:] == ["not installed"] * 8 for row in rows[1:]), done.stdout
