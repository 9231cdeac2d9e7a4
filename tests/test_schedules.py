import itertools
import math

import pytest

from trainkit.schedules import constant, warmup_cosine


def test_constant_with_and_without_warmup():
    assert [constant(s, total_steps=10) for s in range(3)] == [1.0, 1.0, 1.0]
    assert [constant(s, total_steps=10, warmup_steps=3) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_warmup_cosine_shape():
    f = lambda s: warmup_cosine(s, total_steps=110, warmup_steps=10, min_ratio=0.1)  # noqa: E731
    assert f(0) == pytest.approx(1 / 11)
    assert f(9) == pytest.approx(10 / 11)
    assert f(10) == pytest.approx(1.0)  # peak right after warmup
    assert f(60) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert f(110) == pytest.approx(0.1)  # the end: min_ratio
    assert f(500) == pytest.approx(0.1)  # past the end it stays there
    values = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))  # monotone decay


def test_warmup_cosine_without_warmup_matches_closed_form():
    for s in range(0, 51, 5):
        expected = 0.5 * (1 + math.cos(math.pi * s / 50))
        assert warmup_cosine(s, total_steps=50) == pytest.approx(expected)
