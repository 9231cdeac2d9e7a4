"""Runs that tests in several files read: each one runs once a session, when a test first asks for it
(tests that prove different things about the same run share it instead of training it again)."""

from pathlib import Path

import pytest

from helpers import CRASH_RUN, faulty, run_in_process


@pytest.fixture(scope="session")
def crash_run_two_ranks(tmp_path_factory) -> Path:
    """helpers.CRASH_RUN uninterrupted on 2 ranks in torchrun's environment (forked ranks of this process):
    what a killed and restarted run must equal, under torchrun (test_checkpoint.py) and self-launched
    (test_launch.py). Its model is Faulty with a kill marker that exists: it never kills."""
    tmp = tmp_path_factory.mktemp("crash_run_two_ranks")
    (tmp / "never").touch()
    run_in_process(tmp / "run", *CRASH_RUN, *faulty("kill", 31, 1, tmp / "never"), nproc=2)
    return tmp / "run"


def pytest_addoption(parser):
    parser.addoption(
        "--figures",
        action="store_true",
        help="run the shipped experiments' full recipes over seeds 0-2 (tests/test_figures.py, about 50 minutes)",
    )


def pytest_collection_modifyitems(config, items):
    """Tests marked figures (a full recipe, minutes a run) only with --figures: never in the suite."""
    if config.getoption("--figures"):
        return
    skip = pytest.mark.skip(reason="a shipped experiment's full recipe: pytest tests/test_figures.py --figures")
    for item in items:
        if "figures" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def s3_server():
    """An S3 server on localhost for a test module (tests/s3_server.py): its env set, `.bucket(name)` makes a bucket,
    `.stop()` / `.start()` take it down and back (objects kept)."""
    from s3_server import serving

    with serving() as server:
        yield server
