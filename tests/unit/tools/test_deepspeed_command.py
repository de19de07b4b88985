"""The `deepspeed` command that `zeroshard install-deepspeed-alias` installs: where it goes, what
RECORD and entry_points.txt say of it (what pip reads to remove it), and a foreign one refused.
`pip uninstall deepspeed` removing it: test_deepspeed_alias.py; a real launch through it:
tests/dist/launch/test_deepspeed_command.py."""

from __future__ import annotations

import base64
import configparser
import hashlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from zeroshard.tools import deepspeed_command
from zeroshard.tools.deepspeed_alias import DIST_INFO, AliasError, install, uninstall

REPO = Path(__file__).resolve().parents[3]


def _sha256(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def test_target_install_writes_an_executable_command_listed_in_record(tmp_path: Path) -> None:
    install(tmp_path)
    command = tmp_path / "bin" / "deepspeed"  # where `pip install --target` puts scripts
    data = command.read_bytes()
    assert data.startswith(f"#!{sys.executable}\n".encode())
    assert os.access(command, os.X_OK)
    rows = (tmp_path / DIST_INFO / "RECORD").read_text().splitlines()
    assert f"bin/deepspeed,{_sha256(data)},{len(data)}" in rows
    entry_points = configparser.ConfigParser()
    entry_points.read(tmp_path / DIST_INFO / "entry_points.txt")
    assert dict(entry_points["console_scripts"]) == {"deepspeed": "zeroshard.launch.deepspeed_launcher:main"}
    # It runs a launch: tests/dist/launch/test_deepspeed_command.py; `--help` below.


def test_uninstall_removes_the_command_and_its_folder(tmp_path: Path) -> None:
    install(tmp_path)
    assert uninstall(tmp_path) is True
    assert not (tmp_path / "bin").exists()


def test_a_deepspeed_command_that_is_not_ours_is_refused_and_kept(tmp_path: Path) -> None:
    scripts = tmp_path / "bin"
    scripts.mkdir()
    foreign = scripts / "deepspeed"
    foreign.write_text("#!/usr/bin/python\nfrom deepspeed.launcher.runner import main\nmain()\n")
    with pytest.raises(AliasError, match=r"bin/deepspeed exists and is not the zeroshard alias's command.*remove it"):
        install(tmp_path)
    assert foreign.read_text().startswith("#!/usr/bin/python\nfrom deepspeed")
    assert not (tmp_path / "deepspeed").exists() and not (tmp_path / DIST_INFO).exists()


def test_reinstall_replaces_our_own_command(tmp_path: Path) -> None:
    install(tmp_path)
    install(tmp_path)
    assert deepspeed_command.is_ours(tmp_path / "bin" / "deepspeed")


def test_the_default_place_is_this_environments_scripts_folder(tmp_path: Path) -> None:
    assert deepspeed_command.scripts_dir(None) == Path(sysconfig.get_path("scripts"))
    site = tmp_path / "env" / "lib" / "python3.11" / "site-packages"
    assert deepspeed_command.record_path(tmp_path / "env" / "bin" / "deepspeed", site) == "../../../bin/deepspeed"


def test_a_python_path_the_kernel_cannot_take_gets_the_sh_form(tmp_path: Path) -> None:
    """A space in the interpreter's path: `/bin/sh` starts python on the file, whose next lines
    are a string to Python; the command runs and is still recognised as ours."""
    folder = tmp_path / "my env"
    folder.mkdir()
    python = folder / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    command, _ = deepspeed_command.write_script(tmp_path / "bin", str(python))
    assert command.read_text().startswith("#!/bin/sh\n'''exec' '")
    assert deepspeed_command.is_ours(command)
    assert deepspeed_command.shebang("/usr/bin/python3") == "#!/usr/bin/python3\n"
    assert deepspeed_command.shebang("/" + "p" * 130).startswith("#!/bin/sh\n")
    result = subprocess.run([str(command), "--help"], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: deepspeed [-h] [-H HOSTFILE] [-i INCLUDE]")
    assert "--num_gpus NUM_GPUS, --num_accelerators NUM_GPUS" in result.stdout


def test_without_target_the_cli_installs_the_command_into_this_environments_scripts(monkeypatch) -> None:
    """`zeroshard install-deepspeed-alias` (no --target) must not put the command in site-packages/bin."""
    from zeroshard.cli import main
    from zeroshard.tools import deepspeed_alias

    calls = []
    monkeypatch.setattr(deepspeed_alias, "install", lambda target=None, scripts=None: calls.append(target) or Path("x"))
    assert main(["install-deepspeed-alias"]) == 0
    assert calls == [None]
