"""`pubsub-sidecar skip-gap --target ADDR --subscription NAME --key K --through SEQ`: skip the missing
sequences a key waits on.

Calls the sidecar's ``SkipGap`` RPC, which records the skip durably before it answers
(``sidecar.pipeline.runtime.SubscriptionRuntime.skip_gap``): the key's missing sequences from the
first one through ``--through`` are passed over, as ``on_gap_timeout: skip`` would, and what the key
holds after them is delivered in order. A skipped sequence published later is dead-lettered as
``late`` (``on_late``). ``pubsub-sidecar status`` prints the command for each key that waits on a
gap, with ``--through`` the last missing sequence.

Exit codes: 0 skipped (the range printed); 2 when the command must be fixed (empty argument,
unknown subscription, a ``--through`` outside the missing range: NOT_FOUND, INVALID_ARGUMENT); 1 for
anything else (the key does not wait on a gap: FAILED_PRECONDITION; the sidecar unreachable or its
store unavailable). One line on stderr (``refusals``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc

from pubsub_sidecar.v1 import sidecar_pb2, sidecar_pb2_grpc
from sidecar.commands.exit_codes import EXIT_OK, EXIT_USAGE
from sidecar.commands.refusals import refusal


async def skip_gap(
    target: str, subscription: str, key: str, through: int, timeout_seconds: float
) -> sidecar_pb2.SkipGapResponse:
    """Raises grpc.aio.AioRpcError when the sidecar refuses or cannot be reached."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = sidecar_pb2_grpc.OrderedDeliveryStub(channel)
        response: sidecar_pb2.SkipGapResponse = await stub.SkipGap(
            sidecar_pb2.SkipGapRequest(subscription=subscription, key=key, through=through), timeout=timeout_seconds
        )
        return response


def describe(response: sidecar_pb2.SkipGapResponse, subscription: str, key: str) -> str:
    first, last = response.skipped_from, response.skipped_through
    what = f"sequence {first}" if first == last else f"sequences {first} to {last}"
    return f"skipped the gap of key {key!r} of subscription {subscription!r}: missing {what} passed over"


def run_command(args: argparse.Namespace) -> int:
    for option in ("target", "subscription", "key"):
        if not str(getattr(args, option)).strip():
            print(f"pubsub-sidecar skip-gap: --{option} must not be empty", file=sys.stderr)
            return EXIT_USAGE
    try:
        response = asyncio.run(skip_gap(args.target, args.subscription, args.key, args.through, args.timeout))
    except grpc.RpcError as exc:
        line, code = refusal("skip-gap", args.target, exc)
        print(line, file=sys.stderr)
        return code
    print(describe(response, args.subscription, args.key))
    return EXIT_OK
