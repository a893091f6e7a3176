"""The relay's waiting room with the command an operator runs (``pubsub-sidecar outbox``, a real
process) against the emulators while a relay runs: an unpublishable entry listed with what waits
behind it, its retry refused, its discard (with a note) freeing the key; an entry whose topic is
missing given up after its retries, recorded, listed, and published once retried after the topic
exists. Every other key flows all along."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from google.cloud import firestore, pubsub_v1
from test_relay_emulators import Pods, Received, make_topic, relay_config, running, until

from sidecar.emulators.stack import EmulatorStack


def outbox_command(config: Path, stack: EmulatorStack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", "outbox", *args, "--config", str(config)],
        env={**os.environ, **stack.env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def write_config(tmp_path: Path, project: str, topic: str) -> Path:
    relay = relay_config(topic, shards=2).model_dump(by_alias=True, mode="json")
    relay["lease_duration"] = "1s"
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump({"project": project, "firestore": {"root": "sidecar"}, "relays": [relay]}))
    return path


async def test_an_unpublishable_entry_is_listed_refused_a_retry_and_discarded(
    tmp_path: Path, stack: EmulatorStack, project: str
) -> None:
    topic, subscription = make_topic(project)
    config = write_config(tmp_path, project, topic)
    pods = Pods(project, relay_config(topic, shards=2))
    relay = pods.add("pod-a")
    db = firestore.AsyncClient(project=project)
    received = Received(subscription)
    try:
        async with running(pods.relays):
            bad = db.collection("outbox").document()
            await bad.set({"key": "456", "data": b"x", "attributes": {"goog-x": "1"}})
            await db.collection("outbox").document().set({"key": "456", "data": b"after"})
            await db.collection("outbox").document().set({"key": "789", "data": b"other"})

            async def other_key_published() -> bool:
                await asyncio.get_running_loop().run_in_executor(None, received.pull)
                return ("789", 1) in received.by_number()

            await until("the other key flows", other_key_published)
            listed = await asyncio.to_thread(outbox_command, config, stack, "list", "--json")
            assert listed.returncode == 0, listed.stderr
            [row] = [json.loads(line) for line in listed.stdout.splitlines()]
            assert (row["entry"], row["key"], row["behind"], row["retry_helps"]) == (bad.id, "456", 1, False)
            assert "reserved" in row["reason"]

            refused = await asyncio.to_thread(outbox_command, config, stack, "retry", bad.id, "--relay", "orders-out")
            assert refused.returncode == 1
            assert "discard it" in refused.stderr

            done = await asyncio.to_thread(
                outbox_command, config, stack, "discard", bad.id, "--relay", "orders-out", "--note", "bad attribute"
            )
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stderr.splitlines()[-1])["note"] == "bad attribute"

            async def key_flows() -> bool:
                await asyncio.get_running_loop().run_in_executor(None, received.pull)
                return ("456", 1) in received.by_number()

            await until("the key flows after the discard", key_flows)
            assert received.by_number()[("456", 1)] == b"after"  # the discarded entry used no number
            assert relay.waiting() == []
    finally:
        received.close()
        await pods.close()


async def test_an_entry_given_up_is_published_once_retried(tmp_path: Path, stack: EmulatorStack, project: str) -> None:
    topic, subscription = make_topic(project)
    config = write_config(tmp_path, project, topic)
    pods = Pods(project, relay_config(topic, shards=2))
    relay = pods.add("pod-a")
    db = firestore.AsyncClient(project=project)
    received = Received(subscription)
    try:
        async with running(pods.relays):
            late = db.collection("outbox").document()
            await late.set({"key": "456", "data": b"audit", "topic": "audit"})  # no such topic yet
            await db.collection("outbox").document().set({"key": "456", "data": b"next"})

            async def given_up() -> bool:
                return any(w.entry_id == late.id for w in relay.waiting())

            await until("the entry given up after its retries", given_up)
            listed = await asyncio.to_thread(outbox_command, config, stack, "list")
            assert listed.returncode == 0, listed.stderr
            assert late.id in listed.stdout
            assert "1 waiting; 1 keys blocked" in listed.stdout

            audit = f"projects/{project}/topics/audit"
            await asyncio.to_thread(pubsub_v1.PublisherClient().create_topic, name=audit)
            retried = await asyncio.to_thread(outbox_command, config, stack, "retry", late.id, "--relay", "orders-out")
            assert retried.returncode == 0, retried.stderr

            async def next_published() -> bool:
                await asyncio.get_running_loop().run_in_executor(None, received.pull)
                return ("456", 2) in received.by_number()

            await until("the key's next entry published after the retried one", next_published)
            assert received.by_number()[("456", 2)] == b"next"  # number 1 went to the audit topic
            assert relay.waiting() == []
    finally:
        received.close()
        await pods.close()
