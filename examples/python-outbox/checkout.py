"""A checkout app that publishes its events in order through the sidecar's outbox relay.

Each business change and its event are written in ONE Firestore transaction: the order document
and an outbox entry (a document with a random id: key, data, attributes). The relay (``relays:`` in
the sidecar's config) publishes each entry with the order's next sequence number, in commit order,
and deletes it. Nothing here talks to Pub/Sub, and no counter is kept by the app.

Run against the emulators (``pubsub-sidecar emulators`` prints the variables to export):

    python checkout.py --project demo-project --order 456

The contract: docs/publishing.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from google.cloud import firestore

OUTBOX = "outbox"
ORDERS = "orders"


def _entry(order_id: str, event: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "key": order_id,  # published as the relay's key_attribute (e.g. order_id)
        "data": json.dumps({"type": event, "order_id": order_id, **body}).encode(),
        "attributes": {"type": event},
    }


async def create_order(db: firestore.AsyncClient, order_id: str, amount: int, outbox: str = OUTBOX) -> None:
    """Order ``order_id`` PENDING, and its ``OrderCreated`` event, in one transaction."""

    @firestore.async_transactional
    async def create(transaction: Any) -> None:
        transaction.create(db.collection(ORDERS).document(order_id), {"status": "PENDING", "amount": amount})
        transaction.set(db.collection(outbox).document(), _entry(order_id, "OrderCreated", {"amount": amount}))

    await create(db.transaction())


async def change_status(
    db: firestore.AsyncClient, order_id: str, event: str, status: str, outbox: str = OUTBOX
) -> None:
    """Move the order to ``status`` and record ``event``, in one transaction. It reads the order
    first: two changes of one order conflict, so Firestore commits them one after the other and the
    relay numbers their events in that order."""

    @firestore.async_transactional
    async def change(transaction: Any) -> None:
        order = db.collection(ORDERS).document(order_id)
        snapshot = await order.get(transaction=transaction)
        if not snapshot.exists:
            raise ValueError(f"order {order_id} does not exist")
        transaction.update(order, {"status": status})
        transaction.set(db.collection(outbox).document(), _entry(order_id, event, {"was": snapshot.get("status")}))

    await change(db.transaction())


async def cancel_order(db: firestore.AsyncClient, order_id: str, outbox: str = OUTBOX) -> None:
    await change_status(db, order_id, "OrderCancelled", "CANCELLED", outbox)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", required=True)
    parser.add_argument("--order", default="456")
    args = parser.parse_args()
    db = firestore.AsyncClient(project=args.project)
    await create_order(db, args.order, amount=4200)
    await cancel_order(db, args.order)
    print(f"order {args.order}: OrderCreated and OrderCancelled written; the relay publishes them as 1 and 2")


if __name__ == "__main__":
    asyncio.run(main())
