"""``FirestoreDocuments.listen`` resuming after a stream fails between a target's CURRENT and the
snapshot it announces: nothing received but not yet handed over may be skipped by the resume.

A scripted Listen server (no emulator: the failure must fall exactly between two responses) answers
as production does: a request with a resume token gets only what changed since that token, one
without gets the whole result set. The first stream sends the result set and CURRENT with a token,
then fails before the global NO_CHANGE that makes it a consistent snapshot.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from google.api_core import exceptions as core_exceptions
from google.cloud.firestore_v1.types import ListenResponse, Target
from google.protobuf import timestamp_pb2

from sidecar.store import documents as docs
from sidecar.store.api import StoreError
from sidecar.store.firestore import _Listening

_DATABASE = "projects/p/databases/(default)"
_PREFIX = f"{_DATABASE}/documents/root/orders/messages/"
_WAIT_SECONDS = 15.0


def _response(**fields: Any) -> Any:
    return ListenResponse.wrap(ListenResponse.pb()(**fields))


def _document(doc_id: str) -> Any:
    return _response(
        document_change={
            "document": {
                "name": _PREFIX + doc_id,
                "fields": {"state": {"string_value": "pending"}},
                "update_time": timestamp_pb2.Timestamp(seconds=1),
            },
            "target_ids": [1],
        }
    )


def _target_change(kind: str, token: bytes = b"", *, global_snapshot: bool = False) -> Any:
    change: dict[str, Any] = {"target_change_type": kind, "resume_token": token}
    if global_snapshot:
        change["read_time"] = timestamp_pb2.Timestamp(seconds=2)
    else:
        change["target_ids"] = [1]
    return _response(target_change=change)


class ScriptedServer:
    """The Listen server: ``_listen_stream`` as ``FirestoreDocuments`` has it, one script per stream."""

    _database = _DATABASE

    def __init__(self) -> None:
        self.tokens: list[bytes] = []
        """The resume token of each stream's request, in order (b"" for none)."""
        self.quiet = asyncio.Event()

    async def _listen_stream(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        request = await anext(requests)
        self.tokens.append(bytes(request._pb.add_target.resume_token))
        return self._stream(len(self.tokens), self.tokens[-1])

    async def _stream(self, number: int, token: bytes) -> AsyncIterator[Any]:
        yield _target_change("ADD")
        if not token:
            yield _document("a")  # the whole result set
        yield _target_change("CURRENT", b"t%d" % number)
        if number == 1:
            raise core_exceptions.ServiceUnavailable("stream broken before the snapshot")
        yield _target_change("NO_CHANGE", b"t%d" % number, global_snapshot=True)
        yield _document("z")  # a later change, so that the test knows the resumed stream went on
        yield _target_change("NO_CHANGE", b"u%d" % number, global_snapshot=True)
        await asyncio.Event().wait()  # open until closed


async def test_a_stream_broken_before_its_first_snapshot_is_not_resumed_past_it() -> None:
    server = ScriptedServer()
    target = Target.pb()(target_id=1)
    changes: list[docs.Change] = []
    errors: list[StoreError] = []
    arrived = asyncio.Event()

    def on_change(change: docs.Change) -> None:
        changes.append(change)
        arrived.set()

    listening = _Listening(server, target, on_change, errors.append, set())  # type: ignore[arg-type]
    listening.start()
    try:

        async def until_z() -> None:
            while not any(doc_id == "z" for change in changes for doc_id, _, _ in change.upserts):
                arrived.clear()
                await arrived.wait()

        await asyncio.wait_for(until_z(), _WAIT_SECONDS)
    finally:
        await listening.close()
    assert not errors
    # The first stream's token passed "a" before any snapshot held it: the second must start afresh.
    assert server.tokens == [b"", b""]
    assert changes[0].initial and [doc_id for doc_id, _, _ in changes[0].upserts] == ["a"]
