#!/usr/bin/env node
// A checkout app that publishes its events in order through the pubsub-sidecar's outbox relay.
//
// Each business change of an order and its event are written in ONE Firestore transaction
// (@google-cloud/firestore): the order document and an outbox entry (a document with a random id:
// key, data, attributes). The relay (`relays:` in the sidecar's config) publishes each entry with
// the order's next sequence number, in commit order, and deletes it. No counter in the app, no
// Pub/Sub client. The contract: docs/publishing.md.
//
//   node checkout.js --project demo-project --order 456
//
// creates order 456 (PENDING, OrderCreated) and cancels it (CANCELLED, OrderCancelled) in a second
// transaction, and prints one JSON line per event written. Against the emulators, export
// FIRESTORE_EMULATOR_HOST as `pubsub-sidecar emulators` prints it.
'use strict';

const { Firestore } = require('@google-cloud/firestore');

function parseArgs(argv) {
  const args = { project: process.env.GOOGLE_CLOUD_PROJECT || '', order: '456', outbox: 'outbox', orders: 'orders' };
  for (let i = 0; i < argv.length; i += 2) {
    const name = argv[i].replace(/^--/, '');
    if (!(name in args) || i + 1 >= argv.length) {
      throw new Error(`unknown or incomplete option ${argv[i]} (use --project, --order, --outbox, --orders)`);
    }
    args[name] = argv[i + 1];
  }
  if (!args.project) throw new Error('--project is required (or GOOGLE_CLOUD_PROJECT)');
  return args;
}

function entry(orderId, event, body) {
  return {
    key: orderId, // published as the relay's key_attribute (e.g. order_id)
    data: Buffer.from(JSON.stringify({ type: event, order_id: orderId, ...body })),
    attributes: { type: event },
  };
}

// Order `orderId` PENDING and its OrderCreated event, in one transaction.
async function createOrder(db, args, orderId, amount) {
  await db.runTransaction(async (tx) => {
    tx.create(db.collection(args.orders).doc(orderId), { status: 'PENDING', amount });
    tx.set(db.collection(args.outbox).doc(), entry(orderId, 'OrderCreated', { amount }));
  });
}

// Move the order to `status` and record `event`, in one transaction. It reads the order first: two
// changes of one order conflict, so Firestore commits them one after the other, and the relay numbers
// their events in that order.
async function changeStatus(db, args, orderId, event, status) {
  await db.runTransaction(async (tx) => {
    const order = db.collection(args.orders).doc(orderId);
    const snapshot = await tx.get(order);
    if (!snapshot.exists) throw new Error(`order ${orderId} does not exist`);
    tx.update(order, { status });
    tx.set(db.collection(args.outbox).doc(), entry(orderId, event, { was: snapshot.get('status') }));
  });
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const db = new Firestore({ projectId: args.project });
  try {
    await createOrder(db, args, args.order, 4200);
    console.log(JSON.stringify({ order: args.order, event: 'OrderCreated' }));
    await changeStatus(db, args, args.order, 'OrderCancelled', 'CANCELLED');
    console.log(JSON.stringify({ order: args.order, event: 'OrderCancelled' }));
  } finally {
    await db.terminate();
  }
}

main().catch((err) => {
  console.error(`error: ${err.message}`);
  process.exit(1);
});
