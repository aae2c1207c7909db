"""Library code prints nothing: its messages are log records under the ``hgraph`` logger, and only
the command line (``hgraph/cli``) writes to the console. Progress bars show on a terminal only."""

from __future__ import annotations

import ast
import fcntl
import logging
import os
import pathlib
import pty
import re
import struct
import sys
import termios

import pytest
import torch

from hgraph.cli.command import console_logging, main
from hgraph.core import progress as progress_module
from hgraph.core.progress import PROGRESS_ENV, progress, progress_enabled
from hgraph.core.sharded_writer import ShardedWriter, TensorSpec
from hgraph.errors import InputError

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = [ROOT / "hgraph", ROOT / "passes", ROOT / "runtime"]
CLI = ROOT / "hgraph" / "cli"


def library_files() -> list[pathlib.Path]:
    return [p for d in LIBRARY for p in sorted(d.rglob("*.py")) if CLI not in p.parents]


def calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)]


def test_library_code_prints_nothing():
    """No ``print(...)`` outside ``hgraph/cli`` (docstrings and comments may show one)."""
    found = [f"{p.relative_to(ROOT)}:{c.lineno}" for p in library_files()
             for c in calls(ast.parse(p.read_text(), str(p)), "print")]
    assert not found, f"print in library code (log through logging.getLogger(__name__) instead): {found}"


def test_library_loggers_are_children_of_hgraph():
    """Every ``logging.getLogger`` of the library names its module (``__name__``: ``hgraph.…``), or
    a torch logger it listens to or quiets (a string, or a module constant holding one)."""
    odd = []
    for p in library_files():
        tree = ast.parse(p.read_text(), str(p))
        constants = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                     and isinstance(n.value, ast.Constant) for t in n.targets if isinstance(t, ast.Name)}
        for c in calls(tree, "getLogger"):
            arg = c.args[0] if c.args else None
            name = arg.value if isinstance(arg, ast.Constant) else constants.get(getattr(arg, "id", ""))
            if not (getattr(arg, "id", None) == "__name__" or str(name).startswith("torch.")):
                odd.append(f"{p.relative_to(ROOT)}:{c.lineno}")
    assert not odd, f"loggers not named by their module: {odd}"


def test_the_checker_sees_a_planted_print(tmp_path):
    source = (ROOT / "hgraph" / "core" / "progress.py").read_text() + "\nprint('hello')\n"
    assert len(calls(ast.parse(source), "print")) == 1


def test_cli_shows_warnings_on_stderr_and_info_with_verbose(capsys):
    logger = logging.getLogger("hgraph.frontend.capture")
    with console_logging():
        logger.info("not shown")
        logger.warning("shown")
    with console_logging(verbose=True):
        logger.info("now shown")
    with console_logging(quiet=True):
        logger.warning("hidden by --quiet")
        assert os.environ[PROGRESS_ENV] == "0"
    assert capsys.readouterr().err == (
        "WARNING hgraph.frontend.capture: shown\nINFO hgraph.frontend.capture: now shown\n")
    assert not logging.getLogger("hgraph").handlers  # afterwards as before


def test_progress_setting(monkeypatch):
    monkeypatch.setenv(PROGRESS_ENV, "0")
    assert not progress_enabled() and progress(range(3), desc="x").disable
    monkeypatch.setenv(PROGRESS_ENV, "1")
    assert progress_enabled() and not progress(range(3), desc="x").disable
    assert progress(range(3), desc="x", show=False).disable
    monkeypatch.setenv(PROGRESS_ENV, "maybe")
    with pytest.raises(InputError, match="HGRAPH_PROGRESS='maybe'; expected 1"):
        progress_enabled()


def test_writes_show_a_bar_of_bytes(tmp_path, monkeypatch, capsys):
    """The export writer counts bytes (checkpoint writes: ``tests/runtime/test_checkpoint_dcp.py``)."""
    monkeypatch.setenv(PROGRESS_ENV, "1")
    monkeypatch.setattr(progress_module, "DELAY_S", 0)
    writer = ShardedWriter(tmp_path / "export", [TensorSpec("w", torch.float32, (256, 256))])
    writer.write("w", torch.ones(256, 256))
    writer.close()
    assert writer.bar.n == writer.bar.total == 256 * 256 * 4
    err = capsys.readouterr().err
    assert "writing export:" in err and "/256k [" in err


PROFILE = ["profile", "--lengths", "32,64,128,256", "--repeats", "2", "--device", "cpu", "--no-cache"]


def terminal() -> tuple[int, int]:
    """A pseudo-terminal 100 columns wide: (master, slave) file descriptors."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))  # tqdm draws nothing in 0
    return master, slave


def drained(master: int) -> str:
    os.set_blocking(master, False)
    chunks = []
    while True:
        try:
            data = os.read(master, 1 << 16)
        except (BlockingIOError, OSError):
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


def test_profile_shows_a_progress_bar_on_a_terminal_only(tmp_path, monkeypatch, capsys):
    """``hgraph profile`` with stderr a (pseudo-)terminal draws a tqdm bar over the lengths; with
    stderr captured (no terminal) or with ``--quiet`` there is none, and stdout has the same report."""
    monkeypatch.setenv("HGRAPH_CACHE", str(tmp_path))
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    master, slave = terminal()
    with os.fdopen(slave, "w", buffering=1) as stderr:
        monkeypatch.setattr(sys, "stderr", stderr)
        monkeypatch.setattr(progress_module, "DELAY_S", 0)  # drawn at once: the profile may end within 0.5 s
        assert main(PROFILE) == 0
        monkeypatch.undo()
    shown = drained(master)
    os.close(master)
    # drawn, then redrawn in place as lengths are measured (tqdm redraws at most every 0.1 s: maybe not 4/4)
    assert "profiling 4 lengths:" in shown and re.search(r"\r[^\r]*[1-4]/4 \[", shown), shown
    assert "measured 4 lengths on cpu" in capsys.readouterr().out
    monkeypatch.setenv("HGRAPH_CACHE", str(tmp_path))
    monkeypatch.setattr(progress_module, "DELAY_S", 0)
    assert main(PROFILE) == 0
    captured = capsys.readouterr()
    assert "measured 4 lengths on cpu" in captured.out and "profiling" not in captured.err
    monkeypatch.setenv(PROGRESS_ENV, "1")  # bars on any stderr, unless --quiet
    assert main([*PROFILE, "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "measured 4 lengths on cpu" in captured.out and "profiling" not in captured.err


@pytest.mark.slow
def test_python_m_hgraph_profile_on_a_terminal(tmp_path):
    """The same through ``python -m hgraph profile`` in a process whose stdio is a pseudo-terminal."""
    env = {**os.environ, "HGRAPH_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop(PROGRESS_ENV, None)
    pid, fd = pty.fork()
    if pid == 0:  # the child: its stdio is the terminal
        try:
            fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
            slower = [*PROFILE[:PROFILE.index("--repeats")], "--repeats", "12", *PROFILE[PROFILE.index("--repeats") + 2:]]
            os.execvpe(sys.executable, [sys.executable, "-m", "hgraph", *slower], env)  # over the bar's 0.5 s
        finally:
            os._exit(127)
    chunks = []
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    shown = b"".join(chunks).decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, shown
    assert "profiling 4 lengths:" in shown and "4/4" in shown and "measured 4 lengths on cpu" in shown
