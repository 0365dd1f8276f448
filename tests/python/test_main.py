"""`python -m ferry`: one entry point for the `ferry` CLI's commands and the package's own, with
the CLI's output and exit codes passed through unchanged."""

import json
import os
import re
import subprocess
import sys

import pytest

import ferry
import ferry._cli.main as entry
import ferry._sim as sim
from conftest import run_module


def env_with(**values):
    env = dict(os.environ)
    env.update(values)
    return env


def listed(name, text):
    return re.search(rf"^  {re.escape(name)}(\s|$)", text, re.MULTILINE) is not None


def test_help_lists_the_cli_and_python_commands(cli):
    out = run_module("--help", env=env_with(FERRY_CLI=cli))
    assert out.returncode == 0, out.stderr
    commands = [name for name, _ in entry.cli_commands(cli)]
    assert {"check", "simulate", "compare"} <= set(commands)
    for name in commands:
        assert listed(name, out.stdout), f"{name} missing from:\n{out.stdout}"
    present = {name for name, _ in entry.python_commands()}
    for name in entry.PYTHON_COMMANDS:
        assert listed(name, out.stdout) == (name in present), name


def test_the_cli_lists_its_commands_as_json_exactly_as_its_help_does(cli):
    """`ferry --commands` (what the package reads) names the subcommands of `ferry --help`, in
    its order, each with its summary."""
    out = subprocess.run([cli, "--commands"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    assert document["format"] == "ferry.commands/1"
    helped = subprocess.run([cli, "--help"], capture_output=True, text=True, timeout=60).stdout
    section = helped[helped.lower().index("subcommands:") :]
    lines = [line.strip() for line in section.splitlines()[1:]]
    end = lines.index("") if "" in lines else len(lines)
    rows = [line.split(None, 1) for line in lines[:end]]
    assert [(c["name"], c["summary"]) for c in document["commands"]] == [
        (name, summary.strip()) for name, summary in rows
    ]
    assert {"check", "simulate", "compare", "plan", "probe"} <= {
        c["name"] for c in document["commands"]
    }


def test_a_cli_without_a_command_list_is_named(tmp_path):
    fake = tmp_path / "ferry"
    fake.write_text("#!/bin/sh\necho 'no such option' >&2\nexit 2\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"--commands gave no command list \(exit 2\): no such"):
        entry.cli_commands(str(fake))


def test_python_commands_are_listed_only_when_their_module_exists(tmp_path, monkeypatch, capsys):
    (tmp_path / "ferry_test_hello.py").write_text(
        '"""Says hello and returns 7.\n\nMore text."""\n'
        "calls = []\n"
        "def main(argv):\n"
        "    calls.append(argv)\n"
        "    return 7\n"
    )
    (tmp_path / "ferry_test_greet.py").write_text(
        '"""``python -m ferry greet``: greets."""\ndef main(argv):\n    return 0\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(
        entry,
        "PYTHON_COMMANDS",
        {
            "hello": "ferry_test_hello:main",
            "absent": "ferry_test_no_such_module:main",
            "greet": "ferry_test_greet:main",
        },
    )
    assert entry.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^  hello\s+Says hello and returns 7\.$", text, re.MULTILINE), text
    assert re.search(r"^  greet\s+greets\.$", text, re.MULTILINE), text  # not the name twice
    assert not listed("absent", text)
    assert "ferry_test_hello" not in sys.modules  # --help imports no command

    assert entry.main(["hello", "--flag", "x"]) == 7
    assert sys.modules["ferry_test_hello"].calls == [["--flag", "x"]]


@pytest.mark.parametrize(
    "args",
    [
        ["simulate", "--model", "tiny-gpt", "--steps", "1"],
        ["simulate", "--model", "tiny-gpt", "--policy", "lifo"],  # bad input: exit 2
        ["compare", "--help"],
    ],
)
def test_cli_commands_give_the_binarys_output_and_exit_code(cli, args):
    direct = subprocess.run([cli, *args], capture_output=True, text=True, timeout=120)
    through = run_module(*args, env=env_with(FERRY_CLI=cli))
    assert (through.returncode, through.stdout, through.stderr) == (
        direct.returncode,
        direct.stdout,
        direct.stderr,
    )
    assert direct.stdout or direct.stderr


def test_version_is_the_packages_and_the_clis(cli):
    out = run_module("--version", env=env_with(FERRY_CLI=cli))
    assert out.returncode == 0
    assert out.stdout == f"ferry {ferry.__version__}\n"
    direct = subprocess.run([cli, "--version"], capture_output=True, text=True, timeout=60)
    assert direct.stdout == out.stdout


def test_an_unknown_command_exits_2_naming_it(cli):
    out = run_module("no-such-command", "--x", env=env_with(FERRY_CLI=cli))
    assert out.returncode == 2
    assert "unknown command 'no-such-command'" in out.stderr
    assert "simulate" in out.stderr and "--help" in out.stderr
    assert out.stdout == ""


def test_no_command_exits_2_with_the_usage():
    out = run_module()
    assert out.returncode == 2
    assert out.stderr.startswith("usage: python -m ferry COMMAND")


def test_a_missing_cli_named_by_ferry_cli_is_a_clear_error(tmp_path):
    missing = tmp_path / "bin" / "ferry"
    out = run_module("simulate", "--model", "tiny-gpt", env=env_with(FERRY_CLI=str(missing)))
    assert out.returncode == 127
    assert f"FERRY_CLI={missing} is not an executable file" in out.stderr


def test_the_console_script_on_path_is_not_taken_for_the_cli(tmp_path, monkeypatch):
    # `pip install .` puts a `ferry` script on PATH that runs this package: finding it as the
    # CLI would run the package again, and again.
    monkeypatch.delenv("FERRY_CLI", raising=False)
    script = tmp_path / "ferry"
    script.write_text("#!/usr/bin/python3\nimport sys\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sim, "PACKAGED_CLI", str(tmp_path / "none" / "ferry"))
    with pytest.raises(sim.CliNotFound):
        sim.find_cli()
    binary = tmp_path / "bin" / "ferry"
    binary.parent.mkdir()
    binary.write_bytes(b"\x7fELF")
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", f"{binary.parent}")
    assert sim.find_cli() == str(binary)


def test_a_missing_cli_names_every_place_searched(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FERRY_CLI", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no `ferry` on PATH
    packaged = tmp_path / "ferry" / "bin" / "ferry"
    monkeypatch.setattr(sim, "PACKAGED_CLI", str(packaged))
    with pytest.raises(sim.CliNotFound) as e:
        sim.find_cli()
    assert "FERRY_CLI is not set" in str(e.value)
    assert str(packaged) in str(e.value)
    assert "no `ferry` binary is on PATH" in str(e.value)

    assert entry.main(["simulate", "--model", "tiny-gpt"]) == 127
    err = capsys.readouterr().err
    assert "'simulate' is no command of the Python package" in err and str(packaged) in err

    assert entry.main(["--help"]) == 0  # the Python commands are still listed
    assert "Commands of the ferry CLI: none, the ferry CLI binary was not found" in (
        capsys.readouterr().out
    )
