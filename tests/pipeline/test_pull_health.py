"""PullHealth: what StreamingPull attempts say, with a fake clock (sidecar/pipeline/pull_health.py)."""

from __future__ import annotations

from sidecar.pipeline.pull_health import FAILING_AFTER_SECONDS, SETTLED_AFTER_SECONDS, PullHealth


class _World:
    def __init__(self) -> None:
        self.now = 1000.0
        self.received = 0
        self.health = PullHealth(lambda: self.received, clock=lambda: self.now)

    def failed_attempt(self, code: str = "RESOURCE_EXHAUSTED", lasting: float = 0.01) -> None:
        attempt = self.health.attempt_started()
        self.now += lasting
        self.health.attempt_ended(attempt, code, f"{code.lower()} details")


def test_retryable_failures_are_reported_only_once_they_last_the_bound() -> None:
    w = _World()
    w.failed_attempt()
    assert w.health.problem() is None
    while w.now < 1000.0 + FAILING_AFTER_SECONDS - 0.5:
        w.now += 0.4
        w.failed_attempt()
        assert w.health.problem() is None
    w.now += 1.0
    w.failed_attempt()
    problem = w.health.problem()
    assert problem is not None and problem.startswith("every streaming pull failed for 1")
    assert "RESOURCE_EXHAUSTED: resource_exhausted details" in problem
    assert w.health.errors["RESOURCE_EXHAUSTED"] > 20


def test_a_stream_that_stays_open_or_a_message_ends_the_run() -> None:
    w = _World()
    w.failed_attempt()
    w.now += FAILING_AFTER_SECONDS + 1
    assert w.health.problem() is not None
    attempt = w.health.attempt_started()
    w.now += SETTLED_AFTER_SECONDS - 0.1
    assert w.health.problem() is not None, "an attempt open for less than the settle time proves nothing"
    w.now += 0.2
    assert w.health.problem() is None
    # That working stream ends after minutes (production closes streams now and then): a new run.
    w.now += 300
    w.health.attempt_ended(attempt, "UNAVAILABLE", "stream closed")
    w.now += 1
    assert w.health.problem() is None
    w.failed_attempt()
    w.now += FAILING_AFTER_SECONDS
    assert w.health.problem() is not None
    w.received += 1
    assert w.health.problem() is None


def test_the_clients_own_cancel_and_a_clean_end_are_no_failure() -> None:
    w = _World()
    w.failed_attempt("CANCELLED")
    w.failed_attempt("OK")
    w.now += FAILING_AFTER_SECONDS * 3
    assert w.health.problem() is None
    assert not w.health.errors


def test_a_pull_closed_for_good_is_reported_at_once_with_the_reopen_and_clears_once_a_stream_works() -> None:
    w = _World()
    w.failed_attempt("NOT_FOUND")
    w.health.closed("NOT_FOUND", "Subscription does not exist: projects/p/subscriptions/s", 1.0)
    assert w.health.problem() == (
        "the streaming pull was closed by NOT_FOUND: Subscription does not exist: projects/p/subscriptions/s; "
        "reopening in 1s"
    )
    assert w.health.consecutive_closes == 1
    w.now += 1.0
    w.failed_attempt("NOT_FOUND")
    w.health.closed("NOT_FOUND", "Subscription does not exist", 2.0)
    assert w.health.consecutive_closes == 2
    w.now += 2.0
    attempt = w.health.attempt_started()
    problem = w.health.problem()
    assert problem is not None and "reopened" in problem
    w.now += SETTLED_AFTER_SECONDS
    assert w.health.problem() is None
    assert w.health.consecutive_closes == 0
    w.health.attempt_ended(attempt, "CANCELLED", "")
    assert w.health.problem() is None
