"""Every user error of `python -m jtree.launch.train` and `jtree` is one line on stderr,
`<prog>: error: <ExceptionType>: <message>` naming the key or file at fault, exit code 2, and no
traceback unless `--debug` or JTREE_DEBUG asks for it (`jtree.cli`)."""

import argparse
import os
import subprocess
import sys

import pytest

from jtree.cli import parse_args
from tests.run_util import WORKTREE, finish, launch


def _one_line_error(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


@pytest.mark.parametrize("override, expected", [
    ("model.hiden_size=3", "error: ValueError: configs/tiny.yaml: model.hiden_size: unknown config key"),
    ("data.path=missing.jsonl", "error: FileNotFoundError: data.path: no such file: missing.jsonl"),
], ids=["bad_key", "missing_data_file"])
def test_launcher_errors_are_one_line(tmp_path, override, expected):
    code, out, err = finish(launch(["--config", "configs/tiny.yaml", override], tmp_path / "log"),
                            tmp_path / "log")
    assert code == 2
    assert _one_line_error(err).startswith(f"python -m jtree.launch.train: {expected}")


def test_debug_shows_the_traceback(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"group": 0, "tokens": [1, -1]}\n')
    command = [sys.executable, "-m", "jtree.cli", "stats", str(bad)]
    plain = subprocess.run(command, cwd=WORKTREE, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2
    assert _one_line_error(plain.stderr).startswith(
        "jtree stats: error: ValueError: ") and "bad.jsonl:1" in plain.stderr
    for extra, env in (["--debug"], {}), ([], {"JTREE_DEBUG": "1"}):
        done = subprocess.run(command[:4] + extra + command[4:], cwd=WORKTREE, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "JTREE_DEBUG": "0", **env})
        assert done.returncode != 0
        assert "Traceback" in done.stderr and "bad.jsonl:1" in done.stderr


def test_a_config_that_is_not_yaml_is_one_line_naming_the_file(tmp_path, capsys):
    from jtree.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hidden_size: [1\n")
    assert main(["train", "--config", str(bad)]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert line.startswith("jtree train: error: ParserError: ") and f'"{bad}", line 2' in line


def test_every_command_reports_a_missing_file_in_one_line(tmp_path, capsys):
    from jtree.cli import main

    missing = str(tmp_path / "missing")
    for argv in (["stats", missing], ["export-hf", "--config", missing, "--checkpoint", missing,
                                      "--out", missing],
                 ["train", "--config", missing]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert _one_line_error(err).startswith(f"jtree {argv[0]}: error: FileNotFoundError: ")
        assert missing in err


def test_overrides_may_follow_options():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parse_args(parser, ["a.b=1", "--config", "c.yaml", "--resume", "c.d=2", "e=3"])
    assert args.resume and args.config == "c.yaml" and args.overrides == ["a.b=1", "c.d=2", "e=3"]
    with pytest.raises(SystemExit):
        parse_args(parser, ["--resume", "--bogus"])
