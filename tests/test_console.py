"""What a user sees: a progress bar on a terminal, the periodic lines in a log file, one copy of
each line and each Python warning (rank 0's), whatever the number of ranks (two ranks' lines: test_train.py,
beside the torchrun sweep whose run they read)."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from helpers import ROOT, _env, run_train, together


def run_on_a_terminal(*overrides: str) -> str:
    """train.py with its stdout on a pseudo-terminal of 120 columns, as in an interactive shell."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    cmd = [sys.executable, str(ROOT / "src/train.py"), *overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=follower, stderr=subprocess.PIPE)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    return out.decode()


@pytest.mark.slow
def test_a_terminal_gets_a_progress_bar_and_a_log_file_the_lines_only(tmp_path):
    steps = ["trainer.max_steps=6", "trainer.log_every=3"]
    shown, piped = together(
        lambda: run_on_a_terminal(f"hydra.run.dir={tmp_path / 'tty'}", *steps),
        lambda: run_train(tmp_path / "pipe", *steps),  # stdout a pipe: a batch job's log
    )
    assert "6/6 [" in shown and "loss=" in shown and "lr=" in shown and "samples_s=" in shown  # tqdm's bar
    assert "step     3/6 | epoch 0 | loss" in shown and "done: 6 steps" in shown  # the lines, above it
    logged = piped.stdout
    assert "\r" not in logged and "6/6 [" not in logged
    assert logged.count("step     3/6 | epoch 0 | loss") == 1 and "done: 6 steps" in logged
