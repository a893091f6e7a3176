#!/usr/bin/env node
// A Node.js app that reads one subscription's ordered stream from the pubsub-sidecar.
//
//   node subscriber.js --target 127.0.0.1:50051 --subscription orders [--json]
//
// It loads the repository's proto at run time (@grpc/proto-loader), opens a Subscribe stream,
// prints each message (stdout, one line each, with its W3C `traceparent` when it carries one: hand
// it to your tracer's propagator to continue the trace), acks it, and:
// - reconnects with exponential backoff and jitter when the stream breaks for a reason a new stream
//   can cure (the sidecar restarting or still recovering: UNAVAILABLE and the like). One stderr line
//   says the sidecar is not serving, repeats of the same reason are not printed, and one line says
//   when it serves again;
// - stops with one stderr line and exit code 2 when the sidecar refuses for good (an unknown
//   subscription: NOT_FOUND; a bad request: INVALID_ARGUMENT, ...): retrying cannot fix those;
// - on SIGTERM or SIGINT waits briefly for the acks it sent to be confirmed, closes the stream
//   (the sidecar redelivers whatever was not acked) and exits 0.
//
// A delivery id is valid only on the stream that delivered it: a new stream gets the unacked
// messages again with new delivery ids, so nothing of an old stream is ever acked on a new one.

'use strict';

const path = require('node:path');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_FILE = 'pubsub_sidecar/v1/sidecar.proto';

// Codes a new stream can cure; everything else is a mistake in the app or the config
// (the same split as the Python client, clients/python/src/pubsub_sidecar_client/errors.py).
const TRANSIENT = new Set([
  grpc.status.UNAVAILABLE,
  grpc.status.CANCELLED,
  grpc.status.DEADLINE_EXCEEDED,
  grpc.status.RESOURCE_EXHAUSTED,
  grpc.status.ABORTED,
  grpc.status.INTERNAL,
  grpc.status.UNKNOWN,
]);

// Pub/Sub messages reach 10 MB; gRPC's default receive limit (4 MiB) would refuse a large one.
const CHANNEL_OPTIONS = { 'grpc.max_receive_message_length': 16 * 1024 * 1024 };

function parseOptions(argv) {
  const { values } = parseArgs({
    args: argv,
    options: {
      target: { type: 'string', default: process.env.SIDECAR_TARGET || '127.0.0.1:50051' },
      subscription: { type: 'string', default: process.env.SIDECAR_SUBSCRIPTION || '' },
      proto: { type: 'string', default: process.env.SIDECAR_PROTO_DIR || path.join(__dirname, '..', '..', 'proto') },
      json: { type: 'boolean', default: false },
      'backoff-initial-ms': { type: 'string', default: '200' },
      'backoff-max-ms': { type: 'string', default: '10000' },
      'close-timeout-ms': { type: 'string', default: '2000' },
    },
  });
  const number = (name) => {
    const value = Number(values[name]);
    if (!Number.isFinite(value) || value <= 0) usage(`--${name} must be a positive number, got ${values[name]}`);
    return value;
  };
  if (!values.subscription) usage('--subscription (or SIDECAR_SUBSCRIPTION) is required: the name in the sidecar config');
  const options = {
    target: values.target,
    subscription: values.subscription,
    protoDir: values.proto,
    json: values.json,
    backoffInitialMs: number('backoff-initial-ms'),
    backoffMaxMs: number('backoff-max-ms'),
    closeTimeoutMs: number('close-timeout-ms'),
  };
  if (options.backoffInitialMs > options.backoffMaxMs) usage('--backoff-initial-ms must not exceed --backoff-max-ms');
  return options;
}

function usage(reason) {
  process.stderr.write(`subscriber: ${reason}\n`);
  process.exit(2);
}

function oneLine(text) {
  return String(text || '').split(/\s+/).filter(Boolean).join(' ');
}

function loadService(protoDir) {
  const definition = protoLoader.loadSync(PROTO_FILE, {
    includeDirs: [protoDir],
    keepCase: true, // field names as in the proto: delivery_id, ack_confirmations
    longs: String, // int64 as a decimal string, as in proto3's JSON mapping
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).pubsub_sidecar.v1.OrderedDelivery;
}

function formatMessage(message, json) {
  const data = Buffer.from(message.data);
  if (json) {
    return JSON.stringify({
      delivery_id: message.delivery_id,
      key: message.key,
      sequence: message.sequence,
      message_id: message.message_id,
      dedup_id: message.dedup_id,
      data: data.toString('utf8'),
      attributes: message.attributes,
      delivery_attempt: message.delivery_attempt,
      redelivered: message.delivery_attempt > 1,
      late: message.late,
      skipped: message.skipped.map((range) => [range.first, range.last]),
      traceparent: message.traceparent,
    });
  }
  const extra = message.delivery_attempt > 1 ? ` (redelivery, attempt ${message.delivery_attempt})` : '';
  const trace = message.traceparent ? ` [traceparent ${message.traceparent}]` : '';
  return `${message.key} #${message.sequence}: ${data.toString('utf8')}${extra}${trace}`;
}

class Subscriber {
  constructor(OrderedDelivery, options) {
    this.OrderedDelivery = OrderedDelivery;
    this.options = options;
    this.stopping = false;
    this.failures = 0;
    this.outage = null; // the reason attempts keep failing for, until a stream delivers again
    this.current = null; // { client, call, pending: Set of acked, unconfirmed delivery ids }
    this.retryTimer = null;
    this.done = new Promise((resolve) => {
      this.finish = resolve;
    });
  }

  log(line) {
    process.stderr.write(`subscriber: ${line}\n`);
  }

  connect() {
    const { target, subscription } = this.options;
    const client = new this.OrderedDelivery(target, grpc.credentials.createInsecure(), CHANNEL_OPTIONS);
    const call = client.Subscribe();
    // A channel per stream: grpc-js's own reconnect backoff (up to 120 s) would otherwise stack on ours.
    const stream = { client, call, pending: new Set(), gotResponse: false, startedAt: Date.now() };
    this.current = stream;
    call.on('data', (response) => this.onResponse(stream, response));
    call.on('error', () => {}); // every outcome, errors included, arrives as 'status' below
    call.on('status', (status) => this.onStatus(stream, status));
    call.write({ open: { subscription, max_outstanding_messages: 0 } });
  }

  onResponse(stream, response) {
    if (this.stopping) return; // not printed, not acked: the sidecar gives them back on close
    if (!stream.gotResponse && this.outage !== null) {
      this.log(`sidecar at ${this.options.target} serves subscription '${this.options.subscription}' again`);
      this.outage = null;
    }
    stream.gotResponse = true;
    const ids = [];
    for (const message of response.messages) {
      process.stdout.write(`${formatMessage(message, this.options.json)}\n`);
      ids.push(message.delivery_id);
    }
    if (ids.length > 0) {
      // Printed is handled: ack the whole batch in one request.
      for (const id of ids) stream.pending.add(id);
      stream.call.write({ ack: { delivery_ids: ids } });
    }
    for (const id of response.ack_confirmations) stream.pending.delete(id);
    if (stream.pending.size === 0 && stream.onConfirmed) stream.onConfirmed();
  }

  onStatus(stream, status) {
    stream.client.close();
    if (this.current === stream) this.current = null;
    if (this.stopping) {
      this.finish();
      return;
    }
    const { target, subscription } = this.options;
    const reason =
      status.code === grpc.status.OK
        ? 'the sidecar ended the stream'
        : `${grpc.status[status.code]}: ${oneLine(status.details)}`;
    if (status.code !== grpc.status.OK && !TRANSIENT.has(status.code)) {
      this.log(`error: sidecar at ${target} refused subscription '${subscription}': ${reason}`);
      process.exitCode = 2;
      this.stopping = true;
      this.finish();
      return;
    }
    if (reason !== this.outage) {
      this.log(`sidecar at ${target} is not serving subscription '${subscription}' (${reason}); retrying with backoff`);
    }
    this.outage = reason;
    // A stream that worked starts the backoff over; one that fails at once keeps growing it.
    const lived = Date.now() - stream.startedAt;
    this.failures = stream.gotResponse || lived >= this.options.backoffMaxMs ? 0 : this.failures + 1;
    this.retryTimer = setTimeout(() => {
      this.retryTimer = null;
      if (!this.stopping) this.connect();
    }, this.backoffMs());
  }

  backoffMs() {
    const ceiling = Math.min(this.options.backoffMaxMs, this.options.backoffInitialMs * 2 ** Math.min(this.failures, 30));
    // "Equal jitter": at least half the ceiling, so reconnects never spin.
    return ceiling / 2 + Math.random() * (ceiling / 2);
  }

  async stop(signal) {
    if (this.stopping) return;
    this.stopping = true;
    this.log(`${signal}: stopping`);
    if (this.retryTimer !== null) {
      clearTimeout(this.retryTimer);
      this.retryTimer = null;
    }
    const stream = this.current;
    if (stream === null) {
      this.finish();
      return;
    }
    if (stream.pending.size > 0) {
      // Acks sent but not yet durable would lead to a redelivery: give them a moment.
      await new Promise((resolve) => {
        stream.onConfirmed = resolve;
        setTimeout(resolve, this.options.closeTimeoutMs).unref();
      });
      if (stream.pending.size > 0) this.log(`closing with ${stream.pending.size} unconfirmed acks; the sidecar may redeliver them`);
    }
    stream.call.cancel(); // ends with CANCELLED -> onStatus -> finish
  }
}

async function main() {
  const options = parseOptions(process.argv.slice(2));
  const subscriber = new Subscriber(loadService(options.protoDir), options);
  for (const signal of ['SIGTERM', 'SIGINT']) process.on(signal, () => subscriber.stop(signal));
  subscriber.connect();
  await subscriber.done;
  if (process.exitCode === undefined) subscriber.log('stopped');
}

main().catch((error) => {
  process.stderr.write(`subscriber: error: ${oneLine(error && error.stack ? error.message : error)}\n`);
  process.exit(1);
});
