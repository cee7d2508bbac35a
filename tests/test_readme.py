"""The README's examples run as written, against tiny checkpoints.

Every ```bash / ```python block carries a marker on the line before it:
    <!-- readme-test: run -->                        executed, in order, in a scratch directory
    <!-- readme-test: run with A = B -->             executed with A replaced by B (a hub id by a tiny checkpoint)
    <!-- readme-test: skip: REASON -->               not executed (a download, minutes of work); its syntax is checked
Plain ``` blocks holding `$ ` command lines are transcripts: each command runs (unless the block is marked skip) and
must succeed, or fail with exactly the `qwenrt: error:` line shown; `qwenrt inspect` must print what is shown.
`/tmp/` in the README means the scratch directory. New sections are covered by marking their blocks.
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from qwenrt.cli import main

README = Path(__file__).resolve().parent.parent / "README.md"
MARKER = re.compile(r"^<!-- readme-test: (run|run with (.+?) = (.+?)|skip: .+) -->$")


@dataclass
class Block:
    lang: str
    text: str
    marker: str | None  # the marker's words ("run", "run with ...", "skip: ..."), or None
    line: int

    @property
    def skipped(self) -> bool:
        return self.marker is not None and self.marker.startswith("skip")


def readme_blocks() -> list[Block]:
    lines, blocks, i = README.read_text().splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, lang = i, lines[i][3:].strip()
            i += 1
            while not lines[i].startswith("```"):
                i += 1
            marker = MARKER.match(lines[start - 1]) if start else None
            blocks.append(Block(lang, "\n".join(lines[start + 1:i]), marker and marker.group(1), start + 1))
        i += 1
    return blocks


def substitute(text: str, block: Block, scratch: Path) -> str:
    if block.marker and block.marker.startswith("run with"):
        _, old, new = MARKER.match(f"<!-- readme-test: {block.marker} -->").groups()
        text = text.replace(old, new)
    return text.replace("/tmp/", f"{scratch}/")


def run_command(argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    """A README command in this process (qwenrt, python -m, python -c), else in a shell: (exit code, out, err)."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.argv, sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if argv[0] == "qwenrt":
                code = main(argv[1:])
            elif argv[:2] == ["python", "-m"]:
                sys.argv = argv[2:]
                runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
                code = 0
            elif argv[:2] == ["python", "-c"]:
                exec(argv[2], {"__name__": "__main__"})
                code = 0
            else:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
                code, out, err = done.returncode, io.StringIO(done.stdout), io.StringIO(done.stderr)
    finally:
        sys.argv, sys.stdin = saved
    return code, out.getvalue(), err.getvalue()


def check_syntax(block: Block) -> None:
    if block.lang == "python":
        compile(block.text, f"README.md:{block.line}", "exec")
    elif block.lang == "bash":
        subprocess.run(["bash", "-n"], input=block.text, text=True, check=True)


def run_transcript(block: Block, scratch: Path) -> int:
    """Run each `$ ` command of a transcript; returns how many ran."""
    chunks = re.split(r"^\$ ", substitute(block.text, block, scratch), flags=re.M)[1:]
    for chunk in chunks:
        command, *shown = chunk.splitlines()
        stdin = "".join(line[4:] + "\n" for line in shown if line.startswith(">>> "))
        code, out, err = run_command(shlex.split(command), stdin)
        errors = [line for line in shown if line.startswith("qwenrt: error:")]
        where = f"README.md:{block.line}: $ {command}"
        if errors:
            assert code == 1 and err.strip().splitlines()[-1] == errors[0], (where, err)
        else:
            assert code == 0, (where, err)
        if command.startswith("qwenrt inspect"):
            assert out.splitlines() == shown, (where, out)
    return len(chunks)


def test_every_example_block_is_marked():
    for block in readme_blocks():
        if block.lang in ("bash", "python"):
            assert block.marker is not None, f"README.md:{block.line}: mark the block run or skip"
        if block.skipped:
            check_syntax(block)


def test_readme_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing is downloaded: a hub id left unsubstituted fails here
    ran = 0
    for block in readme_blocks():
        if block.skipped:
            continue
        text = substitute(block.text, block, tmp_path)
        if block.lang == "bash":
            for command in filter(None, (shlex.split(line, comments=True) for line in text.splitlines())):
                code, _, err = run_command(command)
                assert code == 0, (f"README.md:{block.line}: {' '.join(command)}", err)
                ran += 1
        elif block.lang == "python":
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(text, f"README.md:{block.line}", "exec"), {"__name__": "__readme__"})
            ran += 1
        elif "\n$ " in "\n" + block.text:
            ran += run_transcript(block, tmp_path)
    assert ran >= 12, ran
