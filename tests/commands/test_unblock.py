"""`pubsub-sidecar unblock` and the UnblockKey RPC against a real delivery layer (grpc.aio server on port 0)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
from incoming_messages import sequence_message

from pubsub_sidecar.v1 import sidecar_pb2, sidecar_pb2_grpc
from sidecar.commands import main as cli
from sidecar.delivery.server import GrpcServer
from sidecar.engine.types import EngineConfig, Message
from sidecar.pipeline.runtime import SubscriptionRuntime, wall_clock_ms
from sidecar.store.api import PersistOutcome
from sidecar.store.memory import MemoryStore

pytestmark = pytest.mark.timeout(60)


@dataclass
class _Sink:
    published: list[tuple[str, str]] = field(default_factory=list)

    async def publish(self, subscription: str, message: Message, reason: str, attempts: int) -> None:
        self.published.append((message.message_id, reason))


@dataclass
class Sidecar:
    address: str
    runtime: SubscriptionRuntime


async def _until(predicate: object, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + 20
    while not predicate():  # type: ignore[operator]
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
async def blocked_sidecar() -> AsyncIterator[Sidecar]:
    """`orders` (sequence, on_dead_letter: block): key `a` holds 1, 2, 3 and 1 was dead-lettered."""
    store = MemoryStore()
    config = EngineConfig(mode="sequence", on_dead_letter="block")
    runtime = SubscriptionRuntime("orders", config, store, _Sink())
    server = GrpcServer({"orders": runtime}, "127.0.0.1:0")
    try:
        await runtime.recover()
        await runtime.loaded()
        await runtime.start()
        address = await server.start()
        await server.set_serving()
        results = await store.persist("orders", [sequence_message("a", s) for s in (1, 2, 3)], wall_clock_ms())
        assert {r.outcome for r in results} == {PersistOutcome.STORED}
        runtime.on_stored([r.message for r in results])
        (first,) = runtime.take("app", 10)
        assert first.message.sequence == 1
        runtime.nack("app", [first.delivery_id], dead_letter=True)
        await _until(lambda: store.state_of("orders", first.message) == "dead_lettered", "the dead letter")
        await _until(lambda: runtime.status(0)[0].keys_blocked == 1, "the key to block")
        yield Sidecar(address, runtime)
    finally:
        await server.stop(0)
        await runtime.stop(0)


async def run(*argv: str) -> int:
    return await asyncio.to_thread(cli.main, list(argv))


async def test_status_names_the_dead_letter_a_key_is_blocked_at(blocked_sidecar: Sidecar) -> None:
    async with grpc.aio.insecure_channel(blocked_sidecar.address) as channel:
        response = await sidecar_pb2_grpc.OrderedDeliveryStub(channel).GetStatus(
            sidecar_pb2.GetStatusRequest(max_keys=10)
        )
    (key,) = response.subscriptions[0].keys_detail
    assert (key.state, key.blocked_message_id, key.blocked_sequence) == ("blocked_dead_letter", "m-a-1", 1)
    assert "sequence 1" in key.waiting_for


async def test_unblock_skips_the_dead_letter_and_the_key_goes_on_in_order(
    blocked_sidecar: Sidecar, capsys: pytest.CaptureFixture[str]
) -> None:
    runtime = blocked_sidecar.runtime
    assert runtime.take("app", 10) == []
    args = ("unblock", "--target", blocked_sidecar.address, "--subscription", "orders", "--key", "a")
    assert await run(*args) == 0
    assert capsys.readouterr().out == (
        "unblocked key 'a' of subscription 'orders': skipped the dead letter at sequence 1 (message m-a-1)\n"
    )
    (second,) = runtime.take("app", 10)
    assert second.message.sequence == 2
    assert (await runtime.ack("app", [second.delivery_id])).confirmed == [second.delivery_id]
    (third,) = runtime.take("app", 10)
    assert third.message.sequence == 3
    # A second unblock finds the key running: FAILED_PRECONDITION, exit 1, one line.
    assert await run(*args) == 1
    err = capsys.readouterr().err
    assert err.startswith("pubsub-sidecar unblock: ") and "FAILED_PRECONDITION" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("subscription", "key", "code", "text"),
    [
        ("nope", "a", 2, "NOT_FOUND: unknown subscription 'nope'"),
        ("orders", "", 2, "--key must not be empty"),
        ("orders", "never-seen", 1, "FAILED_PRECONDITION: key 'never-seen'"),
    ],
)
async def test_unblock_refusals_are_one_line_with_their_exit_code(
    blocked_sidecar: Sidecar, capsys: pytest.CaptureFixture[str], subscription: str, key: str, code: int, text: str
) -> None:
    argv = ("unblock", "--target", blocked_sidecar.address, "--subscription", subscription, "--key", key)
    assert await run(*argv) == code
    err = capsys.readouterr().err
    assert text in err and err.count("\n") == 1
    assert blocked_sidecar.runtime.status(0)[0].keys_blocked == 1  # nothing changed


async def test_an_unreachable_sidecar_is_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("unblock", "--target", "127.0.0.1:1", "--subscription", "orders", "--key", "a", "--timeout", "2")
    assert await run(*argv) == 1
    assert "cannot reach the sidecar at 127.0.0.1:1" in capsys.readouterr().err
