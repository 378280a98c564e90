"""The in-process federation computes exactly the per-user quantities a client would, clipped."""

import pytest
import torch

from fedkl.data import load_dataset
from fedkl.federation.base import ClippedGradient, GradientDifference, LocalLoss, LocalRegularizedMinimizer
from fedkl.federation.inprocess import InProcessFederation, clip_rows
from fedkl.problems import make_problem


@pytest.fixture(scope="module")
def fed():
    ds = load_dataset("synthetic-logistic", n_users=40, m=15, d=6, seed=3)
    return InProcessFederation(make_problem("logistic", ds), ds)


def test_clip_rows_bounds_norm_keeps_zero_and_zeroes_nonfinite():
    rows = torch.tensor(
        [[3.0, 4.0], [0.0, 0.0], [0.3, 0.4], [float("nan"), 1.0], [float("inf"), 0.0]], dtype=torch.float64
    )
    clipped, bad = clip_rows(rows, 1.0)
    assert torch.allclose(clipped[0], torch.tensor([0.6, 0.8], dtype=torch.float64))
    assert torch.equal(clipped[1], torch.zeros(2, dtype=torch.float64))  # no 0/0
    assert torch.equal(clipped[2], rows[2])  # inside: unchanged
    assert torch.equal(clipped[3:], torch.zeros(2, 2, dtype=torch.float64))
    assert bad.tolist() == [False, False, False, True, True]
    assert (clipped.norm(dim=1) <= 1.0 + 1e-12).all()


def test_clipped_gradients_match_problem_and_are_clipped(fed):
    w = torch.randn(fed.num_params, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    raw = fed.problem.per_user_gradients(w, fed.dataset.train)
    clip = float(raw.norm(dim=1).median())
    ans = fed.compute(ClippedGradient(w, clip))
    assert ans.users == list(range(fed.num_users)) and ans.failed == []
    assert (ans.values.norm(dim=1) <= clip * (1 + 1e-12)).all()
    small = raw.norm(dim=1) <= clip
    assert torch.allclose(ans.values[small], raw[small])
    # clipped rows point the same way
    cos = torch.nn.functional.cosine_similarity(ans.values, raw, dim=1)
    assert torch.allclose(cos, torch.ones_like(cos))
    assert torch.allclose(fed.sum(ClippedGradient(w, clip)).total(), ans.values.sum(0))


def test_subset_request_equals_rows_of_full_request(fed):
    w = torch.full((fed.num_params,), 0.2, dtype=torch.float64)
    full = fed.compute(ClippedGradient(w, 0.5)).values
    users = [7, 2, 31]
    part = fed.compute(ClippedGradient(w, 0.5), users)
    assert part.users == users
    assert torch.allclose(part.values, full[users])


def test_gradient_difference_and_losses(fed):
    g = torch.Generator().manual_seed(1)
    w1, w2 = (torch.randn(fed.num_params, dtype=torch.float64, generator=g) for _ in range(2))
    diff = fed.compute(GradientDifference(w1, w2, clip=1e6)).values
    p, data = fed.problem, fed.dataset.train
    assert torch.allclose(diff, p.per_user_gradients(w1, data) - p.per_user_gradients(w2, data))
    losses = fed.compute(LocalLoss(w1)).values
    assert torch.allclose(losses, p.per_user_losses(w1, data))


def test_local_regularized_minimizer_is_stationary(fed):
    center = torch.full((fed.num_params,), 0.1, dtype=torch.float64)
    users = [0, 5]
    ans = fed.compute(LocalRegularizedMinimizer(center, strength=0.5, tol=1e-10), users)
    for row, u in enumerate(users):
        data = fed.dataset.train.subset([u])
        v = ans.values[row]
        grad = fed.problem.per_user_gradients(v, data)[0] + 0.5 * (v - center)
        assert float(grad.norm()) < 1e-6


def test_bad_requests_are_refused(fed):
    w = torch.zeros(fed.num_params, dtype=torch.float64)
    with pytest.raises(ValueError):
        fed.compute(ClippedGradient(torch.zeros(fed.num_params + 1), 1.0))
    with pytest.raises(ValueError):
        fed.compute(ClippedGradient(w, 1.0), [0, 0])
    with pytest.raises(ValueError):
        fed.compute(ClippedGradient(w, 1.0), [fed.num_users])
    with pytest.raises(ValueError):
        ClippedGradient(w, 0.0)
    with pytest.raises(ValueError):
        fed.compute(ClippedGradient(w * float("nan"), 1.0))
    with pytest.raises(TypeError):
        fed.compute("gradient please")


def test_answered_masks_the_failed_users_rows_in_the_order_asked():
    """Answers.answered(): False exactly at the rows of the users in ``failed`` (positions, not rows: the
    asked users need not be 0..k-1 nor sorted), what algorithms use to leave a failed user's zero row out."""
    from fedkl.federation.base import Answers

    ans = Answers(users=[7, 2, 9, 4], values=torch.zeros(4, 3), failed=[9, 7])
    assert ans.answered().tolist() == [False, True, False, True]
    assert Answers(users=[3, 1], values=torch.zeros(2, 3)).answered().tolist() == [True, True]
    assert Answers(users=[], values=torch.zeros(0, 3)).answered().tolist() == []


def test_every_query_with_a_clip_bound_checks_the_answers_a_client_reports():
    """A query whose answer a client clips (a ``clip`` or ``bound`` scalar) is checked on the server: the
    Flower backend rejects an over-bound row as out-of-bound instead of using it (a client may run other
    code). ClippedLocalUpdate (DP-FedAvg, DP-FTRL) had no check: its algorithms re-clip, but the lying
    client was not reported."""
    from fedkl.federation.base import QUERY_KINDS, ClippedLocalUpdate, Query

    bounded = [c for c in QUERY_KINDS.values() if {"clip", "bound"} & set(c.scalar_names)]
    assert ClippedLocalUpdate in bounded
    assert [c.__name__ for c in bounded if c.check_answer is Query.check_answer] == []
    q = ClippedLocalUpdate(torch.zeros(3), 0.5, 2, 0.1)
    rows = torch.tensor([[0.3, 0.0, 0.0], [0.0, 3.0, 0.0], [0.1, 0.1, 0.1]])
    assert list(q.check_answers(rows)) == [1]
    with pytest.raises(ValueError, match="exceeds the clip bound 0.5"):
        q.check_answer(rows[1])
