"""`pubsub-sidecar unblock --target ADDR --subscription NAME --key K`: skip the dead letter that blocks a key.

Calls the sidecar's ``UnblockKey`` RPC, which records the decision durably before it answers
(``sidecar.pipeline.runtime.SubscriptionRuntime.unblock``). The skipped dead letter itself stays on the
dead-letter topic: ``pubsub-sidecar dead-letters replay`` or ``discard`` deal with it.

Exit codes: 0 unblocked (the skipped position printed); 2 when the command must be fixed (empty
argument, unknown subscription: INVALID_ARGUMENT, NOT_FOUND); 1 for anything else (the key is not
blocked: FAILED_PRECONDITION; the sidecar unreachable or its store unavailable). One line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import UTC

import grpc

from pubsub_sidecar.v1 import sidecar_pb2, sidecar_pb2_grpc
from sidecar.commands.exit_codes import EXIT_OK, EXIT_USAGE
from sidecar.commands.refusals import refusal


async def unblock(target: str, subscription: str, key: str, timeout_seconds: float) -> sidecar_pb2.UnblockKeyResponse:
    """Raises grpc.aio.AioRpcError when the sidecar refuses or cannot be reached."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = sidecar_pb2_grpc.OrderedDeliveryStub(channel)
        response: sidecar_pb2.UnblockKeyResponse = await stub.UnblockKey(
            sidecar_pb2.UnblockKeyRequest(subscription=subscription, key=key), timeout=timeout_seconds
        )
        return response


def describe(response: sidecar_pb2.UnblockKeyResponse, subscription: str, key: str) -> str:
    if response.HasField("skipped_sequence"):
        what = f"the dead letter at sequence {response.skipped_sequence}"
    elif response.HasField("skipped_timestamp"):
        when = response.skipped_timestamp.ToDatetime(tzinfo=UTC).isoformat(timespec="milliseconds")
        what = f"the dead letter with event time {when.replace('+00:00', 'Z')}"
    else:
        what = "the dead letter it was blocked at"
    if response.skipped_message_id:
        what += f" (message {response.skipped_message_id})"
    return f"unblocked key {key!r} of subscription {subscription!r}: skipped {what}"


def run_command(args: argparse.Namespace) -> int:
    for option in ("target", "subscription", "key"):
        if not str(getattr(args, option)).strip():
            print(f"pubsub-sidecar unblock: --{option} must not be empty", file=sys.stderr)
            return EXIT_USAGE
    try:
        response = asyncio.run(unblock(args.target, args.subscription, args.key, args.timeout))
    except grpc.RpcError as exc:
        line, code = refusal("unblock", args.target, exc)
        print(line, file=sys.stderr)
        return code
    print(describe(response, args.subscription, args.key))
    return EXIT_OK
