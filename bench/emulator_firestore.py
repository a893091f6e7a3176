"""Benchmark of the Firestore emulator through the official client: BatchWrite and transactions.

Prints documents/s for BatchWrite of 500-document batches (``BulkWriteBatch``, what BulkWriter
sends) and for single-document read-modify-write transactions. The emulator runs in a child
process (so the client and the server do not share one GIL), unless FIRESTORE_EMULATOR_HOST is
already set, in which case that endpoint is measured.

    .venv/bin/python bench/emulator_firestore.py [--docs 100000] [--concurrency 4] [--transactions 500]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from google.cloud.firestore_v1.bulk_batch import BulkWriteBatch

_BATCH = 500
"""Documents per BatchWrite: production's (and BulkWriter's) maximum per request."""


async def _serve() -> None:
    import grpc

    from sidecar.emulators.faults import FaultInjector, FaultInterceptor
    from sidecar.emulators.firestore import FirestoreEmulator

    injector = FaultInjector()
    emulator = FirestoreEmulator(injector)
    server = grpc.aio.server(
        interceptors=[FaultInterceptor(injector, "firestore")],
        options=[("grpc.max_receive_message_length", 16 * 1024 * 1024)],
    )
    emulator.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    # Serve until the parent closes our stdin.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(grace=None)


def _document(i: int) -> dict[str, object]:
    return {
        "key": f"key-{i % 1000}",
        "seq": i,
        "data": b"x" * 200,
        "attributes": {"source": "bench", "kind": "order"},
        "state": "pending",
    }


async def _batch_write(project: str, total: int, concurrency: int) -> float:
    from google.cloud import firestore

    client = firestore.AsyncClient(project=project)
    collection = client.collection("bench").document("sub").collection("messages")
    batches = [range(start, min(start + _BATCH, total)) for start in range(0, total, _BATCH)]
    queue: asyncio.Queue[range] = asyncio.Queue()
    for batch in batches:
        queue.put_nowait(batch)
    failed = 0

    async def worker() -> None:
        nonlocal failed
        while not queue.empty():
            ids = queue.get_nowait()
            batch = BulkWriteBatch(client)
            for i in ids:
                batch.create(collection.document(f"m{i:09d}"), _document(i))
            response = await _commit(batch)
            failed += sum(1 for status in response.status if status.code)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    client.close()
    if failed:
        raise SystemExit(f"{failed} writes failed")
    return total / elapsed


async def _commit(batch: BulkWriteBatch) -> object:
    # BulkWriteBatch.commit() is synchronous; an AsyncClient sends the very same BatchWrite request
    # (built by the batch itself) through its async transport.
    client = batch._client
    request, kwargs = batch._prep_commit(None, None)
    return await client._firestore_api.batch_write(request=request, metadata=client._rpc_metadata, **kwargs)


def _transactions(project: str, count: int) -> float:
    from google.cloud import firestore

    client = firestore.Client(project=project)
    refs = [client.collection("tx").document(f"d{i}") for i in range(count)]

    @firestore.transactional
    def bump(transaction: firestore.Transaction, ref: firestore.DocumentReference) -> None:
        snapshot = ref.get(transaction=transaction)
        value = snapshot.get("n") if snapshot.exists else 0
        transaction.set(ref, {"n": value + 1})

    start = time.perf_counter()
    for ref in refs:
        bump(client.transaction(), ref)
    elapsed = time.perf_counter() - start
    client.close()
    return count / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--transactions", type=int, default=500)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve())
        return
    child = None
    if not os.environ.get("FIRESTORE_EMULATOR_HOST"):
        root = Path(__file__).resolve().parent.parent
        child = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
        )
        assert child.stdout is not None
        port = child.stdout.readline().strip()
        if not port:
            raise SystemExit("emulator child process did not start")
        os.environ["FIRESTORE_EMULATOR_HOST"] = f"127.0.0.1:{port}"
    try:
        project = f"bench-{uuid.uuid4().hex[:8]}"
        rate = asyncio.run(_batch_write(project, args.docs, args.concurrency))
        print(f"BatchWrite ({_BATCH}-doc batches, concurrency {args.concurrency}): {rate:,.0f} docs/s")
        tx_rate = _transactions(project, args.transactions)
        print(f"single-document transactions (get + set, sequential): {tx_rate:,.0f} docs/s")
    finally:
        if child is not None:
            assert child.stdin is not None
            child.stdin.close()
            child.wait(timeout=30)


if __name__ == "__main__":
    main()
