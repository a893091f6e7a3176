"""Smoke test of the built image: its own filesystem and settings, run the way a container would.

No container can run on these machines, but chroot and mount namespaces can. This takes the
OCI layout `make image` wrote (the artifact whose digest is published), unpacks its layers, reads
its config (Entrypoint, Cmd, Env, User) and runs exactly that command against the project's
emulators, started here from the project's .venv:

- the root filesystem is a read-only bind mount (as `readOnlyRootFilesystem: true`); /tmp is a
  tmpfs (the manifests' emptyDir) and /etc/pubsub-sidecar a read-only bind of the config (the
  ConfigMap). A write probe, run in the same setup as root and as the image's user, must fail with
  EROFS everywhere but /tmp;
- the process runs as the image's User (10001:10001), checked in /proc, chrooted into the image;
- the sidecar must answer /readyz 200, and a real gRPC client (the project's OrderedSubscriber,
  on the host) must receive a message published to the emulator and have its ack confirmed durable;
- SIGTERM must stop it with exit status 0.

Every wait is a poll with a deadline (the machine may be loaded). Mounts live in the private mount
namespace of the process they serve, so none outlives it; the unpacked filesystem is removed at the
end. Run by scripts/image/build.sh as root:  python smoke_test.py --layout DIR --work DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from google.cloud import pubsub_v1

from pubsub_sidecar_client import OrderedSubscriber

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
PROJECT = "smoke-project"
READY_SECONDS = 120.0
"""Deadlines are generous: other builds and test runs may share the machine's two cores."""

# Mounts the image's root read-only, as Kubernetes' readOnlyRootFilesystem does, then the runtime's
# usual mounts and the pod's volumes, then runs the command chrooted as USER.
_IN_IMAGE = r"""
set -e
rootfs=$1; config=$2; user=$3; shift 3
mount --bind "$rootfs" "$rootfs"
mount -o remount,bind,ro "$rootfs"
mount --rbind /dev "$rootfs/dev"
mount -t proc proc "$rootfs/proc"
mount -t tmpfs -o size=64m,mode=1777 tmpfs "$rootfs/tmp"
mount --bind "$config" "$rootfs/etc/pubsub-sidecar"
mount -o remount,bind,ro "$rootfs/etc/pubsub-sidecar"
exec chroot --userspec="$user" "$rootfs" "$@"
"""

_UNSHARE = ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", _IN_IMAGE, "sh"]

_WRITE_PROBE = r"""
import errno, os, sys
failures = []
for path in ("/probe", "/etc/probe", "/opt/pubsub-sidecar/probe", "/usr/lib/python3.11/probe"):
    try:
        open(path, "w").close()
        failures.append(f"{path}: writable")
    except OSError as e:
        if e.errno != errno.EROFS:
            failures.append(f"{path}: {e!r}, not EROFS")
with open("/tmp/probe", "w") as f:
    f.write("ok")
os.remove("/tmp/probe")
print(f"uid={os.getuid()} gid={os.getgid()}: root filesystem read-only, /tmp writable")
if failures:
    sys.exit("\n".join(failures))
"""


def log(message: str) -> None:
    print(f"smoke: {message}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def blob(layout: Path, digest: str) -> Path:
    algorithm, _, hexdigest = digest.partition(":")
    return layout / "blobs" / algorithm / hexdigest


def unpack(layout: Path, rootfs: Path) -> dict[str, Any]:
    """Unpack the layout's image into rootfs (layers in order, owners kept); returns its config."""
    index = json.loads((layout / "index.json").read_text())
    (entry,) = index["manifests"]
    manifest = json.loads(blob(layout, entry["digest"]).read_text())
    config: dict[str, Any] = json.loads(blob(layout, manifest["config"]["digest"]).read_text())
    rootfs.mkdir(parents=True)
    for layer in manifest["layers"]:
        listing = subprocess.run(
            ["tar", "--list", "--file", str(blob(layout, layer["digest"]))], check=True, capture_output=True, text=True
        ).stdout
        whiteouts = [name for name in listing.splitlines() if Path(name).name.startswith(".wh.")]
        assert not whiteouts, f"whiteouts are not handled here: {whiteouts[:3]}"
        subprocess.run(
            ["tar", "--extract", "--numeric-owner", "--file", str(blob(layout, layer["digest"])), "-C", str(rootfs)],
            check=True,
        )
    log(f"unpacked {len(manifest['layers'])} layer(s) of {entry['digest']}")
    return config


def in_image(
    rootfs: Path, config_dir: Path, user: str, env: dict[str, str], argv: list[str], output: IO[str]
) -> subprocess.Popen[bytes]:
    """Start argv chrooted into rootfs as user, with the read-only root and the pod's mounts.

    unshare without --fork execs: the returned process IS the command once it runs, so a signal
    sent to it reaches the sidecar itself.
    """
    return subprocess.Popen(
        [*_UNSHARE, str(rootfs), str(config_dir), user, *argv],
        env=env,
        stdout=output,
        stderr=subprocess.STDOUT,
    )


def wait_until(what: str, deadline: float, check: Any, process: subprocess.Popen[bytes] | None = None) -> Any:
    while True:
        result = check()
        if result:
            return result
        if process is not None and process.poll() is not None:
            raise SystemExit(f"smoke: the sidecar exited with status {process.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"smoke: no {what} in time")
        time.sleep(0.2)


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


@contextmanager
def emulators(output: IO[str]) -> Iterator[dict[str, str]]:
    """The project's emulators on free ports; yields the exports they print once ready."""
    ports = {name: free_port() for name in ("pubsub", "firestore", "monitoring", "admin")}
    process = subprocess.Popen(
        [str(VENV_BIN / "pubsub-sidecar"), "emulators", "--host", "127.0.0.1"]
        + [arg for name, port in ports.items() for arg in (f"--{name}-port", str(port))],
        stdout=subprocess.PIPE,
        stderr=output,
        text=True,
    )
    exports: dict[str, str] = {}
    ready = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("export "):
                name, _, value = line.removeprefix("export ").strip().partition("=")
                exports[name] = value.split()[0]
                if name == "EMULATORS_ADMIN_URL":
                    ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(READY_SECONDS):
            raise SystemExit("smoke: the emulators did not get ready in time")
        log(f"emulators ready: {', '.join(f'{k}={v}' for k, v in sorted(exports.items()))}")
        yield exports
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def create_subscription(exports: dict[str, str]) -> None:
    os.environ.update(exports)
    publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    for topic in ("orders", "orders-dead-letter"):
        publisher.create_topic(name=f"projects/{PROJECT}/topics/{topic}")
        subscriber.create_subscription(
            name=f"projects/{PROJECT}/subscriptions/{topic}", topic=f"projects/{PROJECT}/topics/{topic}"
        )


def write_config(config_dir: Path, grpc_port: int, http_port: int) -> None:
    config_dir.mkdir(parents=True)
    (config_dir / "sidecar.yaml").write_text(
        f"""project: {PROJECT}
listen: 127.0.0.1:{grpc_port}
http: 127.0.0.1:{http_port}
firestore: {{root: smoke-{uuid.uuid4().hex[:8]}}}
subscriptions:
  - name: orders
    subscription: projects/{PROJECT}/subscriptions/orders
    ordering:
      mode: sequence
      key: {{attribute: order_id}}
      sequence: {{attribute: seq, start: 1}}
    delivery: {{max_delivery_attempts: 5, backoff: {{initial: 1s, maximum: 1m}}, on_dead_letter: block}}
    dead_letter_topic: projects/{PROJECT}/topics/orders-dead-letter
"""
    )
    config_dir.chmod(0o755)
    (config_dir / "sidecar.yaml").chmod(0o644)


async def receive_one(target: str, deadline: float) -> str:
    """Publish one message to the emulator; the app (a real gRPC client) gets it and its ack confirmed."""
    body = f"smoke {uuid.uuid4().hex[:8]}"
    async with OrderedSubscriber(target, "orders") as stream:
        publisher = pubsub_v1.PublisherClient()
        await asyncio.to_thread(
            lambda: publisher.publish(
                f"projects/{PROJECT}/topics/orders", body.encode(), order_id="o-1", seq="1"
            ).result(timeout=60)
        )
        async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
            async for message in stream:
                assert message.data.decode() == body, message.data
                assert (message.key, message.sequence) == ("o-1", 1), (message.key, message.sequence)
                await message.ack()
                await message.confirmed()
                return f"{message.key} {message.sequence} {message.data.decode()!r}, ack confirmed durable"
    raise AssertionError("the stream ended before the message came")


def proc_ids(pid: int) -> tuple[str, str, str]:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    uid, gid = status["Uid"].split()[0], status["Gid"].split()[0]
    return uid, gid, os.readlink(f"/proc/{pid}/root")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", type=Path, required=True, help="OCI image layout (one image)")
    parser.add_argument("--work", type=Path, required=True, help="scratch folder, removed at the end")
    parser.add_argument("--log", type=Path, required=True, help="the sidecar's and the emulators' output")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("smoke: needs root (chroot and mount namespaces)")
    shutil.rmtree(args.work, ignore_errors=True)
    rootfs, config_dir = args.work / "rootfs", args.work / "config"
    output = args.log.open("w")
    try:
        run(args.layout, rootfs, config_dir, output)
    except BaseException:
        output.flush()
        tail = args.log.read_text().splitlines()[-40:]
        print(f"smoke: FAILED; the last lines of {args.log}:", *tail, sep="\n", file=sys.stderr)
        raise
    finally:
        output.close()
        shutil.rmtree(args.work, ignore_errors=True)


def run(layout: Path, rootfs: Path, config_dir: Path, output: IO[str]) -> None:
    """The smoke test proper; raises on the first thing that is not as it must be."""
    image = unpack(layout, rootfs)["config"]
    user = image["User"]
    assert user.split(":")[0].isdigit() and user.split(":")[0] != "0", f"User must be numeric, non-root: {user}"
    command = image["Entrypoint"] + image.get("Cmd", [])
    env = dict(item.split("=", 1) for item in image["Env"])
    log(f"image: User {user}, command {command}, Env {sorted(env)}")
    grpc_port, http_port = free_port(), free_port()
    write_config(config_dir, grpc_port, http_port)
    with emulators(output) as exports:
        create_subscription(exports)
        for probe_user in ("0:0", user):
            probe = in_image(
                rootfs, config_dir, probe_user, env, ["/opt/pubsub-sidecar/bin/python", "-c", _WRITE_PROBE], output
            )
            if probe.wait(120) != 0:
                raise SystemExit(f"smoke: the write probe as {probe_user} failed (status {probe.returncode})")
            log(f"write probe as {probe_user}: EROFS on /, /etc, /opt, /usr; /tmp writable")
        sidecar = in_image(rootfs, config_dir, user, env | exports | {"POD_NAME": "smoke-0"}, command, output)
        try:
            started = time.monotonic()
            deadline = started + READY_SECONDS
            wait_until(
                "/readyz 200", deadline, lambda: http_status(f"http://127.0.0.1:{http_port}/readyz") == 200, sidecar
            )
            uid, gid, root = proc_ids(sidecar.pid)
            log(
                f"/readyz 200 after {time.monotonic() - started:.1f} s;"
                f" pid {sidecar.pid} uid {uid} gid {gid} root {root}"
            )
            assert f"{uid}:{gid}" == user, f"runs as {uid}:{gid}, not {user}"
            assert Path(root) == rootfs.resolve(), f"runs in {root}, not the image"
            received = asyncio.run(receive_one(f"127.0.0.1:{grpc_port}", time.monotonic() + READY_SECONDS))
            log(f"the app received {received}")
            assert http_status(f"http://127.0.0.1:{http_port}/metrics") == 200
            sidecar.send_signal(signal.SIGTERM)
            status = sidecar.wait(60)
            assert status == 0, f"SIGTERM: exit status {status}"
            log("SIGTERM: exit status 0")
        finally:
            if sidecar.poll() is None:
                sidecar.kill()
                sidecar.wait()
    log("passed")


if __name__ == "__main__":
    main()
