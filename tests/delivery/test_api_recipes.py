"""The grpcurl recipes of docs/api.md work against a running server, resolved the way grpcurl does.

grpcurl knows nothing of the proto: it asks server reflection for the descriptors, turns the `-d`
JSON into the request message with them, and calls the method by its full name. This test does the
same for every command of the doc's grpcurl section (and for the requests typed on stdin in the
acking recipe), against the real gRPC server with reflection, so a recipe that names a wrong
service, method or field, or sends JSON the proto does not accept, fails here. Where a `grpcurl`
binary is on PATH, the non-streaming commands also run through it for real.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from delivery_harness import Harness
from google.protobuf import descriptor_pool, json_format, message_factory
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
SECTION = "## grpcurl (no proto needed: server reflection)"
DOC_ADDRESS = "127.0.0.1:50051"
DOC_DELIVERY_ID = "679b16c3-1"
"""The delivery id the acking recipe shows; the test puts the real one in its place."""

SERVICES = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "pubsub_sidecar.v1.OrderedDelivery"}
WAIT_SECONDS = 15.0


@dataclass
class Recipe:
    args: list[str]
    stdin: list[str] = field(default_factory=list)
    """JSON requests the reader types after starting the command (`-d @`)."""

    @property
    def data(self) -> str | None:
        return self.args[self.args.index("-d") + 1] if "-d" in self.args else None

    @property
    def verb(self) -> list[str]:
        """What follows the address: ``["list"]``, ``["describe", X]`` or ``["Service/Method"]``."""
        return self.args[self.args.index(DOC_ADDRESS) + 1 :]


def recipes() -> list[Recipe]:
    text = DOC.read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", 1)]
    found: list[Recipe] = []
    for language, body in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S):
        lines = body.replace("\\\n", " ").splitlines()
        for line in lines:
            line = line.strip()
            if line.startswith("grpcurl "):
                found.append(Recipe(shlex.split(line)))
            elif line.startswith("{"):
                # Typed on stdin to the `-d @` command before it (in its block, or the next one).
                found[-1].stdin.append(line)
        assert language in ("sh", "json"), f"unexpected block in the grpcurl section: {language}"
    return found


def test_the_doc_has_the_recipes_the_issue_asks_for() -> None:
    verbs = [" ".join(r.verb) for r in recipes()]
    assert "list" in verbs
    assert "pubsub_sidecar.v1.OrderedDelivery/GetStatus" in verbs
    assert verbs.count("pubsub_sidecar.v1.OrderedDelivery/Subscribe") == 2  # watch, and ack by hand
    (by_hand,) = [r for r in recipes() if r.data == "@"]
    assert len(by_hand.stdin) == 2 and DOC_DELIVERY_ID in by_hand.stdin[1]


class Reflection:
    """Descriptors from the server's reflection service, as grpcurl gets them."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._database = ProtoReflectionDescriptorDatabase(self._channel)
        self.pool = descriptor_pool.DescriptorPool(self._database)

    def services(self) -> set[str]:
        return set(self._database.get_services())

    def method(self, full_name: str) -> MethodDescriptor:
        service, _, method = full_name.partition("/")
        return self.pool.FindServiceByName(service).methods_by_name[method]

    def request(self, method: MethodDescriptor, text: str) -> Message:
        message = message_factory.GetMessageClass(method.input_type)()
        return json_format.Parse(text, message)

    def resolves(self, symbol: str) -> bool:
        return self.pool.FindFileContainingSymbol(symbol) is not None

    def close(self) -> None:
        self._channel.close()


@pytest.fixture
async def reflection(harness: Harness) -> Reflection:
    # A blocking client: it runs in a thread so the server on this loop keeps answering.
    found = await asyncio.to_thread(Reflection, harness.address)
    try:
        yield found
    finally:
        found.close()


def _multicallable(harness: Harness, method: MethodDescriptor) -> object:
    assert harness.channel is not None
    path = f"/{method.containing_service.full_name}/{method.name}"
    response_class = message_factory.GetMessageClass(method.output_type)
    kind = "stream_stream" if method.client_streaming else "unary_unary"
    return getattr(harness.channel, kind)(
        path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=response_class.FromString
    )


async def test_list_and_describe_resolve_through_reflection(harness: Harness, reflection: Reflection) -> None:
    for recipe in recipes():
        match recipe.verb:
            case ["list"]:
                assert await asyncio.to_thread(reflection.services) == SERVICES
            case ["describe", symbol]:
                assert await asyncio.to_thread(reflection.resolves, symbol), symbol


async def test_unary_recipes_answer_as_documented(harness: Harness, reflection: Reflection) -> None:
    answers: dict[str, dict[str, object]] = {}
    for recipe in recipes():
        if recipe.data in (None, "@") or "Subscribe" in recipe.verb[0]:
            continue
        method = await asyncio.to_thread(reflection.method, recipe.verb[0])
        request = reflection.request(method, recipe.data)
        response = await asyncio.wait_for(_multicallable(harness, method)(request), WAIT_SECONDS)  # type: ignore[operator]
        answers[recipe.verb[0]] = json_format.MessageToDict(response)
    status = answers["pubsub_sidecar.v1.OrderedDelivery/GetStatus"]
    assert [s["name"] for s in status["subscriptions"]] == ["orders"]  # type: ignore[union-attr,index]
    assert answers["grpc.health.v1.Health/Check"] == {"status": "SERVING"}


async def test_subscribe_recipes_stream_messages_and_ack_by_hand(harness: Harness, reflection: Reflection) -> None:
    watch, by_hand = [r for r in recipes() if r.verb == ["pubsub_sidecar.v1.OrderedDelivery/Subscribe"]]
    method = await asyncio.to_thread(reflection.method, watch.verb[0])
    subscribe = _multicallable(harness, method)

    # Watching: the one request of `-d '{...}'`, then messages arrive.
    call = subscribe()  # type: ignore[operator]
    await call.write(reflection.request(method, watch.data))
    await harness.publish("orders", [("order-1", 1)])
    response = await asyncio.wait_for(call.read(), WAIT_SECONDS)
    assert [(m.key, m.sequence) for m in response.messages] == [("order-1", 1)]
    call.cancel()  # unacked: it goes back, as the doc says

    # By hand: open as typed, then the ack template with the id the stream printed.
    call = subscribe()  # type: ignore[operator]
    opened, ack_template = by_hand.stdin
    await call.write(reflection.request(method, opened))
    response = await asyncio.wait_for(call.read(), WAIT_SECONDS)
    (delivered,) = response.messages
    assert delivered.delivery_attempt == 2  # the same message, redelivered after the watcher left
    await call.write(reflection.request(method, ack_template.replace(DOC_DELIVERY_ID, delivered.delivery_id)))
    confirmations: list[str] = []
    while delivered.delivery_id not in confirmations:
        response = await asyncio.wait_for(call.read(), WAIT_SECONDS)
        confirmations.extend(response.ack_confirmations)
    await call.done_writing()


@pytest.mark.skipif(shutil.which("grpcurl") is None, reason="no grpcurl binary on PATH: checked through reflection")
async def test_non_streaming_recipes_run_with_the_real_grpcurl(harness: Harness) -> None:
    for recipe in recipes():
        if recipe.data == "@" or "Subscribe" in recipe.verb[0]:
            continue
        args = [harness.address if a == DOC_ADDRESS else a for a in recipe.args[1:]]
        process = await asyncio.create_subprocess_exec(
            shutil.which("grpcurl") or "grpcurl", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(process.communicate(), WAIT_SECONDS)
        assert process.returncode == 0, f"{recipe.args}: {err.decode()}"
        if recipe.verb == ["list"]:
            assert set(out.decode().split()) == SERVICES
        elif recipe.data is not None:
            assert json.loads(out)
