"""run_side_by_side: jobs in worker threads that split torch's CPU threads."""

import threading

import pytest
import torch

from magrpo.speedups.threads import run_side_by_side


def _where():
    return threading.get_ident(), torch.get_num_threads()


def test_jobs_split_the_threads_and_keep_their_order(torch_threads):
    torch_threads(3)
    results = run_side_by_side([lambda k=k: (k, *_where()) for k in range(2)])
    assert [k for k, _, _ in results] == [0, 1]
    assert {ident for _, ident, _ in results}.isdisjoint({threading.get_ident()})
    assert sorted(share for _, _, share in results) == [1, 2]  # 3 threads over 2 workers
    assert torch.get_num_threads() == 3  # the caller's count is its own


def test_more_jobs_than_threads_run_one_thread_each(torch_threads):
    torch_threads(2)
    results = run_side_by_side([_where] * 5)
    assert len(results) == 5 and {share for _, share in results} == {1}
    assert len({ident for ident, _ in results}) <= 2


def test_one_thread_or_one_job_runs_in_the_caller(torch_threads):
    torch_threads(1)
    assert run_side_by_side([_where, _where]) == [(threading.get_ident(), 1)] * 2
    torch_threads(2)
    assert run_side_by_side([_where]) == [(threading.get_ident(), 2)]


def test_a_failing_job_raises_in_the_caller(torch_threads):
    torch_threads(2)

    def fail():
        raise ValueError("job failed")

    with pytest.raises(ValueError, match="job failed"):
        run_side_by_side([_where, fail])
