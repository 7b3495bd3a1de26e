"""common/cpus.py: the CPU count of the benchmarks and the thread policy of sequential single-token loops."""
from __future__ import annotations

import pytest
import torch

from common.cpus import (SEQUENTIAL_THREADS_DEFAULT, SEQUENTIAL_THREADS_ENV, available_cpus, sequential_thread_count,
                         sequential_threads)
from common.errors import UserError


@pytest.fixture
def threads(monkeypatch):
    """Start each test at 3 torch threads (more than the policy's 1, whatever the machine) and restore after."""
    monkeypatch.delenv(SEQUENTIAL_THREADS_ENV, raising=False)
    old = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(old)


def test_available_cpus_is_positive():
    assert available_cpus() >= 1


def test_default_is_one_thread_inside_and_restored_after(threads):
    assert SEQUENTIAL_THREADS_DEFAULT == 1
    with sequential_threads() as n:
        assert n == 1 and torch.get_num_threads() == 1
        torch.ones(64, 64) @ torch.ones(64, 64)  # torch runs with it
    assert torch.get_num_threads() == 3


def test_restored_after_an_exception(threads):
    with pytest.raises(RuntimeError, match="boom"):
        with sequential_threads():
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 3


def test_explicit_count_and_nesting(threads):
    with sequential_threads(2) as outer:
        assert outer == 2 and torch.get_num_threads() == 2
        with sequential_threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 3


def test_same_count_is_a_no_op(threads):
    with sequential_threads(3) as n:
        assert n == 3 and torch.get_num_threads() == 3
    assert torch.get_num_threads() == 3


@pytest.mark.parametrize("bad", [0, -1])
def test_explicit_count_below_one_refused(threads, bad):
    with pytest.raises(ValueError):
        with sequential_threads(bad):
            pass
    assert torch.get_num_threads() == 3


def test_env_override(threads, monkeypatch):
    monkeypatch.setenv(SEQUENTIAL_THREADS_ENV, " 2 ")
    assert sequential_thread_count() == 2
    with sequential_threads() as n:
        assert n == 2 and torch.get_num_threads() == 2
    monkeypatch.setenv(SEQUENTIAL_THREADS_ENV, "0")  # 0: leave torch's count alone
    assert sequential_thread_count() is None
    with sequential_threads() as n:
        assert n == 3 and torch.get_num_threads() == 3
    monkeypatch.setenv(SEQUENTIAL_THREADS_ENV, "")  # empty = unset
    assert sequential_thread_count() == SEQUENTIAL_THREADS_DEFAULT
    assert torch.get_num_threads() == 3


@pytest.mark.parametrize("bad", ["two", "-1", "1.5"])
def test_bad_env_is_one_user_error(threads, monkeypatch, bad):
    monkeypatch.setenv(SEQUENTIAL_THREADS_ENV, bad)
    with pytest.raises(UserError, match=SEQUENTIAL_THREADS_ENV):
        with sequential_threads():
            pass
    assert torch.get_num_threads() == 3
