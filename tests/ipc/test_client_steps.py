"""The waits both clients share (ipc/client/steps.py), driven step by step with no socket:
a scripted `wait` stands in for each client's I/O."""

import queue

import pytest

from ipc.auth import CredentialsError
from ipc.client import steps
from ipc.client.core import ClientCore
from ipc.client.errors import EngineDeadError
from ipc.client.steps import Answer, NextItem, Receive
from ipc.messages import AbortRequests, UtilityOutput, UtilityRequest
from ipc.outputs import RequestOutput
from ipc.sockets import WELCOME


def script(*replies):
    """A `wait` that records each step and answers it with the next reply (a callable
    reply is called with the step)."""
    pending = iter(replies)

    def wait(step):
        wait.steps.append(step)
        reply = next(pending)
        return reply(step) if callable(reply) else reply

    wait.steps = []
    return wait


def answer(result):
    def reply(step: Answer) -> bool:
        step.future.set_result(result)
        return True

    return reply


def test_a_silent_request_asks_for_health_then_takes_its_delta(core):
    state = core.submit(queue.SimpleQueue(), [1, 2], None, "r", 0, None)
    delta = RequestOutput("r", [1, 2])
    wait = script(None, answer(True), delta)
    assert steps.run(steps.next_delta(core, state, 2.5), wait) is delta
    assert [type(s) for s in wait.steps] == [NextItem, Answer, NextItem]
    assert wait.steps[0].queue is state.queue and wait.steps[0].timeout == 2.5
    assert core.sent[-1] == UtilityRequest(0, "health")


def test_an_unanswered_health_check_is_a_dead_engine(core):
    state = core.submit(queue.SimpleQueue(), [1], None, "r", 0, None)
    with pytest.raises(EngineDeadError, match="did not answer 'health' within 2.5 s"):
        steps.run(steps.next_delta(core, state, 2.5), script(None, False))
    assert not core._calls


def test_what_failed_a_request_is_raised(core):
    state = core.submit(queue.SimpleQueue(), [1], None, "r", 0, None)
    with pytest.raises(RuntimeError, match="closed"):
        steps.run(steps.next_delta(core, state, 1.0), script(RuntimeError("closed")))


def test_calls_return_their_answer_and_health_reports_a_dead_engine_as_false(core):
    assert steps.run(steps.call(core, "stats", 1.0), script(answer("stats"))) == "stats"
    assert steps.run(steps.health(core, 1.0), script(answer(True))) is True
    assert steps.run(steps.health(core, 1.0), script(False)) is False
    assert [m.method for m in core.sent] == ["stats", "health", "health"]
    assert not core._calls


def test_a_call_the_engine_failed_raises(core):
    def engine_fails(step: Answer) -> bool:
        core.resolve_call(UtilityOutput(core.sent[-1].call_id, error="boom"))
        return step.future.done()

    with pytest.raises(RuntimeError, match="boom"):
        steps.run(steps.call(core, "stats", 1.0), script(engine_fails))


def test_leaving_a_wait_early_cleans_up(core):
    """An exception in the client's own wait (a cancelled task) still drops the call."""

    def cancelled(step):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        steps.run(steps.call(core, "stats", 1.0), script(cancelled))
    assert not core._calls


def test_welcome_receives_until_welcomed():
    core = ClientCore(None, "ipc://nowhere", lambda message: True)
    wait = script(None, lambda step: core.handle_frame(WELCOME))
    steps.run(steps.welcome(core, 5.0), wait)
    assert [type(s) for s in wait.steps] == [Receive, Receive]
    assert 0 < wait.steps[0].timeout_ms <= 5001
    assert core.connected


def test_welcome_gives_up_or_reports_refused_credentials():
    core = ClientCore(None, "ipc://nowhere", lambda message: True)
    with pytest.raises(TimeoutError, match="waited 0 s for WELCOME"):
        steps.run(steps.welcome(core, 0.0), script())
    core._down = CredentialsError("refused")
    with pytest.raises(CredentialsError, match="refused"):
        steps.run(steps.welcome(core, 5.0), script())


def test_release_aborts_a_live_request_once(core):
    core.submit(queue.SimpleQueue(), [1], None, "r", 0, None)
    core.release("r")
    core.release("r")
    assert core.sent[1:] == [AbortRequests(["r"])]
