"""Every command and Python snippet that README.md and docs/ show runs, against the built CLI and
package, as the docs say it runs.

The conventions (README.md, "The manual", states them for readers):

* ```sh blocks: each line is a command (a trailing backslash continues it), run by bash in a
  fresh folder per page that holds a link to the repository's `scenarios/`. `ferry` is the
  console script `pip install` makes: the package's commands (trace, probe, validate, auto,
  --help, --version) through `python -m ferry`, the others through the CLI binary (FERRY_CLI,
  as `python -m ferry` finds it); `python` is this interpreter. Each must exit 0.
* ```console blocks: `$ COMMAND` lines run the same way; the lines after one, up to the next,
  are its output: each must begin a line of what it printed (stdout, then stderr), in order;
  `...` stands for lines left out.
* ```python blocks run on their own, each in its own process, in the page's folder.
* A comment on a command's line, or a comment line opening a block (then for the whole block),
  carries a mark in brackets: `[exit N]` expects exit status N; `[needs GPU]`,
  `[needs network]`, `[takes minutes]` and `[covered by PATH]` (a test or CI script, which must
  exist, that runs it) say why the command is not run here: such commands are listed by
  `test_commands_not_run_here_are_marked_and_listed`.
* The scripts CI runs itself (COVERED_BY_CI) are not run here either, and are listed too.
* ```json blocks holding a `ferry.program/1` document must load (`ferry check` exits 0 or 1,
  never 2).

The pages under docs/reference/ are generated (scripts/gen_reference.py) and hold no commands:
`test_reference_pages_are_current` checks that they say what the CLI and package say now.

Two pages run at a time (the host's cores), each page's commands in the page's order.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import ferry_cli

REPO = Path(ferry_cli.REPO)
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
GENERATED = REPO / "docs" / "reference"
#: Scripts CI runs itself (.ci/run: setup.sh, test.sh; run.sh builds and runs what test.sh does).
COVERED_BY_CI = ("scripts/setup.sh", "scripts/run.sh", "scripts/test.sh")
#: The package's own commands: the `ferry` console script runs them in Python.
PACKAGE_COMMANDS = ("trace", "probe", "validate", "auto", "--help", "-h", "--version")
MARK = re.compile(r"\[(needs GPU|needs network|takes minutes|covered by [^\]]+|exit \d+)\]")
COMMAND_TIMEOUT_S = 600


@dataclasses.dataclass
class Step:
    """One command or snippet of a page."""

    page: str
    line: int
    kind: str  # "shell" or "python"
    text: str
    expected_output: list[str] = dataclasses.field(default_factory=list)
    exit_code: int = 0
    not_run: str | None = None  # why it is not run here


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def marks_of(text: str) -> list[str]:
    """The marks in a line's comment (after ` #` or at a line's start)."""
    comment = text[text.index("#") :] if "#" in text else ""
    return MARK.findall(comment)


def apply_marks(step: Step, marks: list[str]) -> None:
    for mark in marks:
        if mark.startswith("exit "):
            step.exit_code = int(mark.split()[1])
        else:
            step.not_run = mark
    first = step.text.split()[0] if step.text.split() else ""
    if step.kind == "shell" and first in COVERED_BY_CI and step.not_run is None:
        step.not_run = f"covered by CI ({first})"


def blocks(path: Path):
    """(info, first line number, lines) of each fenced block of a page."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m.group(2), m.group(3).lower(), i + 1
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        yield info, start, body
        i += 1


def shell_commands(body: list[str]):
    """(offset, command) of each command of a shell block, continuations joined."""
    pending, at = "", 0
    for offset, line in enumerate(body):
        if not pending:
            at = offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = (pending + line).strip()
        pending = ""
        if command and not command.startswith("#"):
            yield at, command


def steps_of(path: Path, page: str | None = None) -> list[Step]:
    page, steps = page or rel(path), []
    for info, start, body in blocks(path):
        block_marks = marks_of(body[0]) if body and body[0].lstrip().startswith("#") else []
        if info in ("sh", "bash", "shell"):
            for offset, command in shell_commands(body):
                step = Step(page, start + 1 + offset, "shell", command)
                apply_marks(step, block_marks + marks_of(command))
                steps.append(step)
        elif info == "console":
            for offset, line in enumerate(body):
                if line.startswith("$ "):
                    step = Step(page, start + 1 + offset, "shell", line[2:].strip())
                    apply_marks(step, marks_of(line))
                    steps.append(step)
                elif steps and steps[-1].page == page and steps[-1].kind == "shell":
                    steps[-1].expected_output.append(line.rstrip())
        elif info == "python":
            step = Step(page, start + 1, "python", "\n".join(body) + "\n")
            apply_marks(step, block_marks)
            steps.append(step)
    return steps


def program_blocks(path: Path):
    for info, start, body in blocks(path):
        text = "\n".join(body)
        if info == "json" and '"ferry.program/1"' in text:
            yield start + 1, text


def manual_pages() -> list[Path]:
    return [p for p in PAGES if GENERATED not in p.parents]


def environment(cli: str) -> dict[str, str]:
    env = dict(os.environ)
    env["FERRY_CLI"] = cli
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["PY"] = sys.executable
    env["COLUMNS"] = "100"
    return env


PRELUDE = (
    'ferry() { case "${1:-}" in ' + "|".join(PACKAGE_COMMANDS) + '|"") "$PY" -m ferry "$@";; '
    '*) "$FERRY_CLI" "$@";; esac; }\n'
    'python() { "$PY" "$@"; }\n'
    'python3() { "$PY" "$@"; }\n'
)


def output_matches(expected: list[str], printed: str) -> str | None:
    """None when each expected line begins a printed line, in order; else the first that does
    not."""
    lines = [line.rstrip() for line in printed.splitlines()]
    at = 0
    for want in expected:
        if want.strip() in ("", "..."):
            continue
        while at < len(lines) and not lines[at].startswith(want):
            at += 1
        if at == len(lines):
            return want
        at += 1
    return None


def run_step(step: Step, workdir: Path, env: dict[str, str]) -> str | None:
    """None when the step ran as its page says; else what went wrong."""
    if step.kind == "shell":
        argv = ["bash", "-c", PRELUDE + "set -o pipefail\n" + step.text]
    else:
        script = workdir / f"snippet_{step.line}.py"
        script.write_text(step.text, encoding="utf-8")
        argv = [sys.executable, script.name]
    try:
        done = subprocess.run(
            argv,
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"did not finish in {COMMAND_TIMEOUT_S} s"
    printed = done.stdout + done.stderr
    if done.returncode != step.exit_code:
        return f"exited {done.returncode}, the page expects {step.exit_code}:\n{printed[-3000:]}"
    missing = output_matches(step.expected_output, done.stdout + "\n" + done.stderr)
    if missing is not None:
        return f"printed no line beginning {missing!r}; it printed:\n{printed[-3000:]}"
    return None


def run_page(path: Path, env: dict[str, str]) -> tuple[list[str], list[tuple[Step, float]]]:
    """The failures of a page's steps, and each step run with its wall time."""
    failures, ran = [], []
    with tempfile.TemporaryDirectory(prefix="ferry-docs-") as tmp:
        workdir = Path(tmp)
        (workdir / "scenarios").symlink_to(REPO / "scenarios")
        for step in steps_of(path):
            if step.not_run:
                continue
            start = time.monotonic()
            why = run_step(step, workdir, env)
            ran.append((step, time.monotonic() - start))
            if why:
                failures.append(f"{step.page}:{step.line}: {step.text.splitlines()[0]!r} {why}")
        for line, text in program_blocks(path):
            (workdir / "program.json").write_text(text, encoding="utf-8")
            done = subprocess.run(
                [env["FERRY_CLI"], "check", "program.json"],
                cwd=workdir,
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode not in (0, 1):
                failures.append(f"{rel(path)}:{line}: the program does not load: {done.stderr}")
    return failures, ran


@pytest.fixture(scope="session")
def page_results():
    """Every manual page's steps run, two pages at a time; page -> (failures, steps run)."""
    env = environment(ferry_cli.cli())
    pages = manual_pages()
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(pages, pool.map(lambda p: run_page(p, env), pages)))
    ran = [s for _, steps in results.values() for s in steps]
    print(
        f"\ndocs: {sum(1 for s, _ in ran if s.kind == 'shell')} commands and "
        f"{sum(1 for s, _ in ran if s.kind == 'python')} Python snippets run from "
        f"{len(pages)} pages in {time.monotonic() - start:.1f} s"
    )
    for step, seconds in sorted(ran, key=lambda r: -r[1])[:5]:
        print(f"  {seconds:5.1f} s  {step.page}:{step.line}  {step.text.splitlines()[0][:70]}")
    return results


@pytest.mark.parametrize("page", manual_pages(), ids=rel)
def test_every_command_of_the_page_runs(page, page_results):
    failures, _ = page_results[page]
    assert not failures, "\n\n".join(failures)


def test_commands_not_run_here_are_marked_and_listed():
    """The commands the test does not run, each with its mark; a mark's reason must be one of
    the conventions', and a covering test or script must exist."""
    listed, bad = [], []
    for page in manual_pages():
        for step in steps_of(page):
            if not step.not_run:
                continue
            listed.append(f"{step.page}:{step.line}: [{step.not_run}] {step.text.splitlines()[0]}")
            if step.not_run.startswith("covered by ") and "CI" not in step.not_run:
                target = step.not_run.removeprefix("covered by ").split("::")[0]
                if not (REPO / target).exists():
                    bad.append(f"{step.page}:{step.line}: {target} does not exist")
    print(f"\ndocs: {len(listed)} commands not run here:\n" + "\n".join(listed))
    assert not bad, "\n".join(bad)


def test_the_conventions_are_followed():
    """Every shell command is one the test can run or is marked; planted faults are caught."""
    runnable = re.compile(r"^(ferry|python3?|cd|ls|cat|echo)\b")
    unknown = [
        f"{s.page}:{s.line}: {s.text!r}: neither ferry nor python, and not marked"
        for page in manual_pages()
        for s in steps_of(page)
        if s.kind == "shell" and not s.not_run and not runnable.match(s.text)
    ]
    assert not unknown, "\n".join(unknown)
    # The checks can fail: a wrong output line, a wrong exit status.
    assert output_matches(["b", "..."], "a\nb c\n") is None
    assert output_matches(["c"], "a\nb\n") == "c"
    assert output_matches(["b", "a"], "a\nb\n") == "a"
    step = Step("x.md", 1, "shell", "ferry check scenarios/programs/reload_without_wait.json")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "scenarios").symlink_to(REPO / "scenarios")
        why = run_step(step, Path(tmp), environment(ferry_cli.cli()))
    assert why is not None and why.startswith("exited 1, the page expects 0")


def test_marks_are_read_from_the_page_source():
    page = "```sh\nferry a  # [needs GPU]\nferry b \\\n  --c  # [exit 1]\n```\n"
    page += "```console\n$ ferry d\nout\n...\n```\n```python\n# [takes minutes]\nx = 1\n```\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.md"
        path.write_text(page, encoding="utf-8")
        steps = steps_of(path, "p.md")
    shown = [
        (s.kind, " ".join(s.text.split("#")[0].split()), s.not_run, s.exit_code) for s in steps
    ]
    assert shown == [
        ("shell", "ferry a", "needs GPU", 0),
        ("shell", "ferry b --c", None, 1),
        ("shell", "ferry d", None, 0),
        ("python", "", "takes minutes", 0),
    ]
    assert steps[2].expected_output == ["out", "..."]


def test_reference_pages_are_current():
    """docs/reference/ says what the CLI's and the package's help say now."""
    env = environment(ferry_cli.cli())
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_reference.py"), "--check"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_the_docs_check_passes():
    """scripts/docs_check.py: word counts and links (scripts/lint.sh runs it too)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "docs_check.py")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
