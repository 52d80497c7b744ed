"""Fresh draws per case: a task with many captured cases (a serving regime's corners) shares a fixed number of
fresh draws among them; a task with few keeps the configured count; a bare check stays bare."""
from llm4llm.verify.worker import FRESH_CALLS, fresh_draws


def test_few_cases_keep_the_configured_draws():
    assert [fresh_draws(5, c, randomise=False) for c in (1, 2, 4)] == [5, 5, 5]


def test_many_cases_share_the_fresh_calls():
    for cases in (6, 8, 12, 30):
        base = fresh_draws(5, cases, randomise=False)
        assert 2 <= base < 5
        assert base * cases >= min(FRESH_CALLS, 2 * cases)  # never fewer than FRESH_CALLS in all, nor 2 a case
    assert fresh_draws(5, 8, randomise=False) == 3


def test_bare_and_small_counts_are_not_raised():
    assert fresh_draws(0, 8, randomise=False) == 0
    assert fresh_draws(1, 8, randomise=False) == 1


def test_the_random_extra_stays_within_its_bounds():
    few = {fresh_draws(5, 2) for _ in range(400)}
    many = {fresh_draws(5, 8) for _ in range(400)}
    assert few == {5, 6, 7, 8}
    assert many == {3, 4}
