"""`zeroshard install-deepspeed-alias` (issue 24, item 1): install into a `--target` folder,
reinstall, uninstall, refuse a real DeepSpeed, and `pip uninstall deepspeed`.

What `import deepspeed` then gives is checked in a fresh interpreter (the alias changes
sys.modules and sys.meta_path, which this test process must not carry), together with the
integrations' imports: tests/unit/compat/test_deepspeed_alias_imports.py.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

from zeroshard.cli import main
from zeroshard.tools import deepspeed_alias
from zeroshard.tools.deepspeed_alias import DIST_INFO, VERSION, AliasError, install, uninstall

REPO = Path(__file__).resolve().parents[3]


def _python(code: str, *path: Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*(str(p) for p in path), str(REPO)]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=120)


def _fake_dist(target: Path, version: str) -> None:
    info = target / f"deepspeed-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n")


def test_install_writes_a_distribution_whose_record_matches_the_files(tmp_path: Path) -> None:
    assert main(["install-deepspeed-alias", "--target", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["bin", "deepspeed", DIST_INFO])
    assert DIST_INFO == "deepspeed-0.19.8+zeroshard.dist-info"
    info = tmp_path / DIST_INFO
    assert (info / "top_level.txt").read_text() == "deepspeed\n"
    assert "Version: 0.19.8+zeroshard\n" in (info / "METADATA").read_text()
    rows = (info / "RECORD").read_text().splitlines()
    assert f"{DIST_INFO}/RECORD,," in rows
    listed = set()
    for row in rows:  # every file but RECORD itself with its sha256 (urlsafe, unpadded) and size, as pip checks
        path, digest, size = row.split(",")
        listed.add(path)
        if path.endswith("RECORD"):
            continue
        data = (tmp_path / path).read_bytes()
        assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert int(size) == len(data)
    on_disk = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert listed == on_disk


def test_reinstall_is_idempotent_and_uninstall_leaves_nothing(tmp_path: Path) -> None:
    first = install(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    (first / "__pycache__").mkdir()  # what an import leaves behind
    (first / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"x")
    assert install(tmp_path) == first
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert uninstall(tmp_path) is True
    assert list(tmp_path.iterdir()) == []
    assert uninstall(tmp_path) is False
    assert main(["install-deepspeed-alias", "--target", str(tmp_path), "--uninstall"]) == 0


def test_refuses_a_real_deepspeed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fake_dist(tmp_path, "0.19.8")
    with pytest.raises(AliasError, match=r"real DeepSpeed is installed \(deepspeed 0\.19\.8 at .*pip uninstall"):
        install(tmp_path)
    assert main(["install-deepspeed-alias", "--target", str(tmp_path)]) == 1
    assert "real DeepSpeed" in capsys.readouterr().err
    with pytest.raises(AliasError, match="holds a real DeepSpeed"):
        uninstall(tmp_path)
    assert not (tmp_path / "deepspeed").exists()


def test_refuses_a_foreign_deepspeed_folder(tmp_path: Path) -> None:
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("__version__ = '0.19.8'\n")
    with pytest.raises(AliasError, match="is not the zeroshard alias"):
        install(tmp_path)


def test_default_target_is_this_environments_site_packages() -> None:
    import sysconfig

    assert deepspeed_alias.default_target() == Path(sysconfig.get_paths()["purelib"])


def test_pip_uninstall_deepspeed_removes_the_alias(tmp_path: Path) -> None:
    """pip removes only what lies inside its environment: a bare venv (no pip of its own, none
    downloaded) runs the pip of this one, with the alias in the venv's site-packages and the
    `deepspeed` command in its bin/ (RECORD names it `../../../bin/deepspeed`)."""
    import pip

    venv.create(tmp_path / "env", with_pip=False)
    env_python = tmp_path / "env" / "bin" / "python"
    purelib = subprocess.run([env_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    install(purelib, scripts=tmp_path / "env" / "bin")
    command = tmp_path / "env" / "bin" / "deepspeed"
    assert os.access(command, os.X_OK)
    rows = (Path(purelib) / DIST_INFO / "RECORD").read_text().splitlines()
    assert any(row.startswith("../../../bin/deepspeed,sha256=") for row in rows), rows
    pip_dir = Path(pip.__file__).parent
    result = subprocess.run([env_python, str(pip_dir), "uninstall", "-y", "deepspeed"], capture_output=True,
                            text=True, timeout=120, env=dict(os.environ, PIP_NO_INPUT="1", PYTHONPATH=""))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Successfully uninstalled deepspeed-0.19.8+zeroshard" in result.stdout, result.stdout
    assert not (Path(purelib) / "deepspeed").exists() and not (Path(purelib) / DIST_INFO).exists()
    assert not command.exists()
    assert VERSION.endswith("+zeroshard")


def test_the_migration_guides_commands_print_what_it_says(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The transcript under "The `deepspeed` alias" (docs/migrating-from-deepspeed.md), run with
    `--target` a temporary folder (never this environment's site-packages): the `zeroshard` lines
    in this process, the `python -c` lines one after another in one fresh interpreter with the
    folder on PYTHONPATH; `...` in an expected line stands for any text."""
    import re
    import shlex

    page = (REPO / "docs" / "migrating-from-deepspeed.md").read_text(encoding="utf-8")
    section = page.split("## The `deepspeed` alias", 1)[1]
    block = re.search(r"^```shell\n(.*?)^```", section, re.S | re.M).group(1)
    steps: list[tuple[list[str], list[str]]] = []  # (argv, expected lines)
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((shlex.split(line[2:]), []))
        else:
            steps[-1][1].append(line)
    assert [argv[0] for argv, _ in steps] == ["zeroshard", "python", "python", "zeroshard"]

    def check(printed: str, expected: list[str]) -> None:
        lines = printed.splitlines()
        assert len(lines) == len(expected), (lines, expected)
        for got, want in zip(lines, expected, strict=True):
            assert re.fullmatch(".*".join(map(re.escape, want.split("..."))), got), (got, want)

    (install_argv, install_out), *python_steps, (uninstall_argv, uninstall_out) = steps
    assert main([*install_argv[1:], "--target", str(tmp_path)]) == 0
    check(capsys.readouterr().out, install_out)
    codes = [argv[2] for argv, _ in python_steps]
    runner = "import sys\nfor code in sys.argv[1:]:\n    exec(code, {})\n    print('\\0', flush=True)\n"
    result = _python(runner.replace("sys.argv[1:]", repr(codes)), tmp_path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    outputs = result.stdout.split("\0\n")[:-1]
    for printed, (_, expected) in zip(outputs, python_steps, strict=True):
        check(printed, expected)
    assert main([*uninstall_argv[1:], "--target", str(tmp_path)]) == 0
    check(capsys.readouterr().out, uninstall_out)
    assert list(tmp_path.iterdir()) == []  # the last command removed what the first installed


def _checkout(root: Path) -> Path:
    """A DeepSpeed source checkout's package folder (no dist-info: nothing installed)."""
    (root / "deepspeed").mkdir(parents=True)
    (root / "deepspeed" / "__init__.py").write_text("__version__ = '0.19.8'\n")
    return root / "deepspeed"


def test_a_checkout_that_would_shadow_the_alias_is_refused_and_named(tmp_path: Path, monkeypatch) -> None:
    """A `deepspeed` folder earlier on sys.path than the target would be what `import deepspeed`
    gets: install refuses, naming it (before: installed, and the checkout was imported). Later on
    the path it is harmless."""
    from zeroshard.tools.deepspeed_shadow import shadowed_alias

    checkout, target = _checkout(tmp_path / "src"), tmp_path / "site"
    target.mkdir()
    monkeypatch.setattr(sys, "path", [str(checkout.parent), str(target), *sys.path])
    with pytest.raises(AliasError, match=rf"{checkout} would be imported as `deepspeed` instead of the alias"):
        install(target, scripts=tmp_path / "bin")
    assert not (target / "deepspeed").exists()
    monkeypatch.setattr(sys, "path", [str(target), str(checkout.parent), *sys.path[2:]])
    install(target, scripts=tmp_path / "bin")
    assert shadowed_alias([str(target), str(checkout.parent)]) is None
    assert shadowed_alias([str(checkout.parent), str(target)]) == (checkout, target / "deepspeed")


def test_import_zeroshard_warns_when_a_checkout_shadows_the_installed_alias(tmp_path: Path) -> None:
    """The alias installed, then a checkout put first on PYTHONPATH (after the install, which could
    not see it): `import zeroshard` warns, naming both paths."""
    target = tmp_path / "site"
    install(target, scripts=tmp_path / "bin")
    checkout = _checkout(tmp_path / "src")
    result = _python("import zeroshard", checkout.parent, target)
    assert result.returncode == 0, result.stderr
    assert f"`import deepspeed` finds {checkout} (earlier on sys.path" in result.stderr, result.stderr
    assert f"not the zeroshard alias at {target / 'deepspeed'}" in result.stderr, result.stderr
