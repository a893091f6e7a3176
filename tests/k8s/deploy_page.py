"""docs/deploy.md run and checked: its ``sh`` blocks recorded, and every mismatch with what the example
overlay and firestore.indexes.json need (``problems``). The tests are in ``test_deploy_docs.py``.

The page's ``sh`` blocks run, in order, in one ``bash -eu`` with ``gcloud``, ``kubectl`` and
``helm`` replaced by recorders (nothing reaches Google or a cluster): the shell itself expands the
variables, functions and loops, so what is checked is the argv each command would really get.
Each recorded command is then checked against:

- the example overlay's ``sidecar.yaml`` as the sidecar loads it: project, Firestore database,
  subscription, dead-letter topic, dedup window, ordering modes (monitoring.viewer only for
  ``watermark``);
- the rendered overlay: namespace (its Namespace object), the Kubernetes ServiceAccount, the Google
  service account of its Workload Identity annotation, the images' Artifact Registry repository,
  the Secret the sidecar mounts for the peer channel (its name and key; created random, in the
  namespace, before the overlay's pods);
- ``firestore.indexes.json``: the TTL field and every single-field exemption;
- the KEDA overlay: the project whose Prometheus API it reads.

``problems`` returns every mismatch rather than stopping at the first, and the drift tests run it
on mutated copies of the page to show that each kind of drift is caught.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kustomize_build import load_yaml_documents
from rendered_manifests import K8S, OVERLAY, loaded_config, only, pod_spec, rendered_copy

from sidecar.config.model import SidecarConfig

ROOT = K8S.parent
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
INDEXES = ROOT / "firestore.indexes.json"
KEDA = K8S / "overlays" / "keda"
RECORDED = ("gcloud", "kubectl", "helm")
RUN_TIMEOUT_SECONDS = 60

# gcloud's command groups the page uses, longest first; the words after them are arguments.
GCLOUD_COMMANDS = sorted(
    [
        ("services", "enable"),
        ("firestore", "databases", "create"),
        ("firestore", "fields", "ttls", "update"),
        ("firestore", "indexes", "fields", "update"),
        ("pubsub", "topics", "create"),
        ("pubsub", "subscriptions", "create"),
        ("pubsub", "topics", "add-iam-policy-binding"),
        ("pubsub", "subscriptions", "add-iam-policy-binding"),
        ("projects", "add-iam-policy-binding"),
        ("iam", "service-accounts", "create"),
        ("iam", "service-accounts", "add-iam-policy-binding"),
        ("artifacts", "repositories", "create"),
    ],
    key=len,
    reverse=True,
)
BOOLEAN_FLAGS = {"--enable-ttl", "--disable-ttl", "--disable-indexes", "--quiet", "--create-namespace"}
DURATION_DAYS = re.compile(r"(\d+)d")


@dataclass
class Command:
    tool: str
    verb: tuple[str, ...]
    args: list[str]
    flags: dict[str, str | bool] = field(default_factory=dict)

    def __str__(self) -> str:
        return " ".join([self.tool, *self.verb, *self.args, *(f"{k}={v}" for k, v in self.flags.items())])


@dataclass
class Expected:
    """What the commands must name, from the config and manifests they must match."""

    config: SidecarConfig
    namespace: str
    ksa: str
    gsa: str
    registry: set[tuple[str, str, str]]  # (location, project, repository) of the overlay's images
    indexes: dict[str, Any]
    keda_project: str
    peer_secret: tuple[str, str]  # (name, key) of the Secret the sidecar mounts for the peer channel


# ---- running the page ------------------------------------------------------------------------


def shell_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```$", markdown, flags=re.MULTILINE | re.DOTALL)


def recorded_commands(markdown: str, workdir: Path) -> list[list[str]]:
    """Runs the page's sh blocks with recorders for gcloud, kubectl and helm; their argv, in order."""
    bin_dir = workdir / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = workdir / "commands.log"
    log.write_text("")
    for tool in RECORDED:
        recorder = bin_dir / tool
        recorder.write_text('#!/bin/sh\n{ printf "%s\\037" "${0##*/}" "$@"; printf "\\036"; } >> "$DEPLOY_LOG"\n')
        recorder.chmod(0o755)
    script = "\n".join(shell_blocks(markdown))
    environment = {"PATH": f"{bin_dir}:/usr/bin:/bin", "DEPLOY_LOG": str(log), "HOME": str(workdir)}
    subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=workdir,
        env=environment,
        check=True,
        timeout=RUN_TIMEOUT_SECONDS,
    )
    return [record.split("\x1f")[:-1] for record in log.read_text().split("\x1e")[:-1]]


def parse(argv: list[str]) -> Command:
    """gcloud: its command group, then arguments and flags; kubectl, helm: the first positional word."""
    tool, words = argv[0], argv[1:]
    verb: tuple[str, ...] = ()
    if tool == "gcloud":
        verb = next((v for v in GCLOUD_COMMANDS if tuple(words[: len(v)]) == v), tuple(words[:2]))
        words = words[len(verb) :]
    command = Command(tool, verb, [])
    index = 0
    while index < len(words):
        word = words[index]
        if word.startswith("--") and "=" in word:
            name, _, value = word.partition("=")
            command.flags[name] = value
        elif word in BOOLEAN_FLAGS:
            command.flags[word] = True
        elif word.startswith("-") and index + 1 < len(words):
            command.flags[word] = words[index + 1]
            index += 1
        elif not command.verb:
            command.verb = (word,)
        else:
            command.args.append(word)
        index += 1
    return command


def page_commands(markdown: str, workdir: Path) -> list[Command]:
    return [parse(argv) for argv in recorded_commands(markdown, workdir)]


# ---- what they must match --------------------------------------------------------------------


def expected(workdir: Path) -> Expected:
    overlay = rendered_copy(OVERLAY)
    account = only(overlay, "ServiceAccount")
    assert pod_spec(overlay)["serviceAccountName"] == account["metadata"]["name"]
    registry = set()
    for container in [*pod_spec(overlay)["initContainers"], *pod_spec(overlay)["containers"]]:
        match = re.fullmatch(r"([a-z0-9-]+)-docker\.pkg\.dev/([^/]+)/([^/]+)/.+", container["image"])
        assert match, container["image"]
        registry.add((match[1], match[2], match[3]))
    (server,) = {t["metadata"]["serverAddress"] for t in only(rendered_copy(KEDA), "ScaledObject")["spec"]["triggers"]}
    keda_project = re.fullmatch(
        r"https://monitoring\.googleapis\.com/v1/projects/([^/]+)/location/global/prometheus", server
    )
    assert keda_project, server
    (peer_secret,) = [
        (volume["secret"]["secretName"], item["key"])
        for volume in pod_spec(overlay)["volumes"]
        if "secret" in volume
        for item in volume["secret"]["items"]
    ]
    return Expected(
        config=loaded_config(overlay, workdir),
        namespace=only(overlay, "Namespace")["metadata"]["name"],
        ksa=account["metadata"]["name"],
        gsa=account["metadata"]["annotations"]["iam.gke.io/gcp-service-account"],
        registry=registry,
        indexes=json.loads(INDEXES.read_text()),
        keda_project=keda_project[1],
        peer_secret=peer_secret,
    )


def resource_id(path: str, kind: str) -> tuple[str, str]:
    """(project, id) of ``projects/P/{kind}/ID``."""
    match = re.fullmatch(rf"projects/([^/]+)/{kind}/([^/]+)", path)
    assert match, path
    return match[1], match[2]


def days(duration: str | bool) -> int:
    match = DURATION_DAYS.fullmatch(str(duration))
    assert match, f"retention {duration!r} is not in days"
    return int(match[1])


def creates_namespace(command: Command, namespace: str) -> bool:
    """Whether a ``kubectl apply -f FILE`` applies a Namespace of that name (FILE relative to the repository)."""
    path = command.flags.get("-f")
    if not isinstance(path, str) or not (ROOT / path).is_file():
        return False
    return any(
        d["kind"] == "Namespace" and d["metadata"]["name"] == namespace for d in load_yaml_documents(ROOT / path)
    )


# ---- the checks ------------------------------------------------------------------------------


def problems(commands: list[Command], want: Expected) -> list[str]:
    """Every way ``commands`` fail to set up what ``want`` describes (empty: they match)."""
    found: list[str] = []
    config = want.config
    project = config.project
    gcloud = [c for c in commands if c.tool == "gcloud"]

    def of(*verb: str) -> list[Command]:
        return [c for c in gcloud if c.verb == verb]

    def check(condition: bool, message: str) -> None:
        if not condition:
            found.append(message)

    for command in gcloud:
        if command.verb != ("projects", "add-iam-policy-binding"):
            check(command.flags.get("--project") == project, f"not in project {project}: {command}")
        else:
            check(command.args == [project], f"grants on another project than {project}: {command}")

    enabled = {api for c in of("services", "enable") for api in c.args}
    needed = {"pubsub.googleapis.com", "firestore.googleapis.com"}
    if any(s.ordering.mode == "watermark" for s in config.subscriptions):
        needed.add("monitoring.googleapis.com")
    check(needed <= enabled, f"APIs not enabled: {sorted(needed - enabled)}")

    # Firestore: the database, then the TTL field and every exemption of firestore.indexes.json.
    database = config.firestore.database
    databases = of("firestore", "databases", "create")
    check(
        [(c.flags.get("--database"), c.flags.get("--type")) for c in databases] == [(database, "firestore-native")],
        f"the Firestore database {database} (native mode) is not created once: {[str(c) for c in databases]}",
    )
    overrides = want.indexes["fieldOverrides"]
    ttl_wanted = {(o["collectionGroup"], o["fieldPath"]) for o in overrides if o.get("ttl")}
    ttl_set = {
        (c.flags.get("--collection-group"), c.args[0])
        for c in of("firestore", "fields", "ttls", "update")
        if c.flags.get("--enable-ttl") is True and c.flags.get("--database") == database
    }
    check(ttl_set == ttl_wanted, f"TTL policies {sorted(ttl_set)} != firestore.indexes.json {sorted(ttl_wanted)}")
    exempt_wanted = {(o["collectionGroup"], o["fieldPath"]) for o in overrides if o.get("indexes") == []}
    exempted = [
        (c.flags.get("--collection-group"), c.args[0])
        for c in of("firestore", "indexes", "fields", "update")
        if c.flags.get("--disable-indexes") is True and c.flags.get("--database") == database
    ]
    check(
        set(exempted) == exempt_wanted and len(exempted) == len(exempt_wanted),
        f"index exemptions differ from firestore.indexes.json: missing {sorted(exempt_wanted - set(exempted))}, "
        f"extra {sorted(set(exempted) - exempt_wanted)}",
    )
    check(
        not want.indexes["indexes"],
        "firestore.indexes.json has composite indexes the page does not create",
    )

    # Pub/Sub: each configured subscription on a created topic, each dead-letter topic with its own
    # subscription; no Pub/Sub dead-letter policy (the sidecar dead-letters itself).
    topics = {name for c in of("pubsub", "topics", "create") for name in c.args}
    subscriptions = {c.args[0]: c for c in of("pubsub", "subscriptions", "create") if c.args}
    dedup_days = min(s.dedup.ttl_ms for s in config.subscriptions) / 86_400_000
    for sub in config.subscriptions:
        sub_project, sub_id = resource_id(sub.subscription, "subscriptions")
        check(sub_project == project, f"{sub.subscription} is not in {project}")
        created = subscriptions.get(sub_id)
        if created is None:
            found.append(f"subscription {sub_id} (sidecar.yaml) is not created")
            continue
        check(created.flags.get("--topic") in topics, f"{sub_id} reads a topic not created: {created}")
        check("--dead-letter-topic" not in created.flags, f"{sub_id}: the sidecar dead-letters itself: {created}")
        check(created.flags.get("--expiration-period") == "never", f"{sub_id} may expire: {created}")
        retention = created.flags.get("--message-retention-duration", "7d")
        check(days(retention) <= dedup_days, f"{sub_id} retains {retention}, beyond dedup.ttl ({dedup_days:g}d)")
        if sub.dead_letter_topic is None:
            continue
        dl_project, dl_topic = resource_id(sub.dead_letter_topic, "topics")
        check(dl_project == project, f"{sub.dead_letter_topic} is not in {project}")
        check(dl_topic in topics, f"dead-letter topic {dl_topic} (sidecar.yaml) is not created")
        check(created.flags.get("--topic") != dl_topic, f"{sub_id} reads its own dead-letter topic")
        readers = [c for c in subscriptions.values() if c.flags.get("--topic") == dl_topic]
        check(len(readers) == 1, f"dead-letter topic {dl_topic} has {len(readers)} subscriptions, not one")
        for reader in readers:
            check(
                reader.flags.get("--expiration-period") == "never", f"the dead-letter subscription may expire: {reader}"
            )

    # The Google service account and its roles: exactly what the sidecar's RPCs need.
    gsa_name, _, gsa_domain = want.gsa.partition("@")
    created_accounts = {c.args[0] for c in of("iam", "service-accounts", "create")}
    check(gsa_domain == f"{project}.iam.gserviceaccount.com", f"{want.gsa} is not an account of {project}")
    check(gsa_name in created_accounts, f"service account {gsa_name} (the overlay's annotation) is not created")
    member = f"serviceAccount:{want.gsa}"
    granted = {
        (c.verb[0], c.args[0], c.flags.get("--role"))
        for c in gcloud
        if c.verb[-1] == "add-iam-policy-binding" and c.flags.get("--member") == member and c.args
    }
    roles: set[tuple[str, str, str | bool | None]] = {("projects", project, "roles/datastore.user")}
    for sub in config.subscriptions:
        sub_id = resource_id(sub.subscription, "subscriptions")[1]
        roles |= {("pubsub", sub_id, "roles/pubsub.subscriber"), ("pubsub", sub_id, "roles/pubsub.viewer")}
        if sub.dead_letter_topic is not None:
            roles.add(("pubsub", resource_id(sub.dead_letter_topic, "topics")[1], "roles/pubsub.publisher"))
        if sub.ordering.mode == "watermark":
            roles.add(("projects", project, "roles/monitoring.viewer"))
    check(
        granted == roles,
        f"roles of {want.gsa}: missing {sorted(roles - granted, key=str)}, extra {sorted(granted - roles, key=str)}",
    )

    # Workload Identity: the overlay's namespace and ServiceAccount act as that account.
    bindings = [
        c
        for c in of("iam", "service-accounts", "add-iam-policy-binding")
        if c.args == [want.gsa] and c.flags.get("--role") == "roles/iam.workloadIdentityUser"
    ]
    wanted_member = f"serviceAccount:{project}.svc.id.goog[{want.namespace}/{want.ksa}]"
    check(
        [c.flags.get("--member") for c in bindings] == [wanted_member],
        f"Workload Identity binding of {want.gsa} is not exactly {wanted_member}: {[str(c) for c in bindings]}",
    )

    # The images' repository, then the overlay applied after everything it depends on.
    repositories = {
        (c.flags.get("--location"), c.flags.get("--project"), c.args[0])
        for c in of("artifacts", "repositories", "create")
        if c.flags.get("--repository-format") == "docker"
    }
    check(want.registry <= repositories, f"image repositories {sorted(want.registry - repositories)} not created")
    applies = [i for i, c in enumerate(commands) if c.tool == "kubectl" and c.verb == ("apply",)]
    example_apply = [i for i in applies if commands[i].flags.get("-k") == "k8s/overlays/example"]
    check(len(example_apply) == 1, "`kubectl apply -k k8s/overlays/example` is not run once")
    setup = [i for i, c in enumerate(commands) if c.tool == "gcloud" and want.gsa in str(c)]
    if example_apply and setup:
        check(example_apply[0] > max(setup), "the overlay is applied before its account is set up")
    rollout = [c for c in commands if c.tool == "kubectl" and c.verb == ("rollout",)]
    check(any(c.flags.get("-n") == want.namespace for c in rollout), f"no rollout status in namespace {want.namespace}")

    # The peer channel's Secret: the one the pods mount, random, in their namespace once it exists,
    # and before the overlay's pods start.
    secret_name, secret_key = want.peer_secret
    secrets = [
        i
        for i, c in enumerate(commands)
        if c.tool == "kubectl" and c.verb == ("create",) and c.args[:2] == ["secret", "generic"]
    ]
    made = [
        i for i in secrets if commands[i].args[2:] == [secret_name] and commands[i].flags.get("-n") == want.namespace
    ]
    check(
        len(made) == 1,
        f"the Secret {secret_name} the pods mount is not created once in namespace {want.namespace}: "
        f"{[str(commands[i]) for i in secrets]}",
    )
    for i in made:
        key, _, value = str(commands[i].flags.get("--from-literal")).partition("=")
        check(key == secret_key, f"the Secret {secret_name} has no key {secret_key!r} (the pods mount that key)")
        check(bool(re.fullmatch(r"[0-9a-f]{64}", value)), f"the peer secret is not 32 random bytes in hex: {value!r}")
    namespaces = [i for i in applies if creates_namespace(commands[i], want.namespace)]
    if made:
        check(bool(namespaces) and namespaces[0] < made[0], f"the Secret is created before namespace {want.namespace}")
        check(bool(example_apply) and made[0] < example_apply[0], "the Secret is created after the overlay's pods")

    # KEDA: its operator reads the metrics of the project the ScaledObject queries, and nothing else.
    keda_gsa = f"keda-operator@{want.keda_project}.iam.gserviceaccount.com"
    keda_roles = {
        (c.args[0], c.flags.get("--role"))
        for c in gcloud
        if c.verb[-1] == "add-iam-policy-binding" and c.flags.get("--member") == f"serviceAccount:{keda_gsa}"
    }
    check(keda_roles == {(want.keda_project, "roles/monitoring.viewer")}, f"roles of {keda_gsa}: {keda_roles}")
    keda_member = f"serviceAccount:{project}.svc.id.goog[keda/keda-operator]"
    check(
        any(
            c.args == [keda_gsa] and c.flags.get("--member") == keda_member
            for c in of("iam", "service-accounts", "add-iam-policy-binding")
        ),
        f"KEDA's operator is not bound to {keda_gsa}",
    )
    annotations = [c for c in commands if c.tool == "kubectl" and c.verb == ("annotate",)]
    check(
        any(f"iam.gke.io/gcp-service-account={keda_gsa}" in c.args for c in annotations),
        f"keda-operator's ServiceAccount is not annotated with {keda_gsa}",
    )
    keda_apply = [i for i in applies if commands[i].flags.get("-k") == "k8s/overlays/keda"]
    check(len(keda_apply) == 1, "`kubectl apply -k k8s/overlays/keda` is not run once")
    # The keda overlay drops `replicas`: without this, client-side apply resets the Deployment to 1.
    unset = [i for i in applies if commands[i].args == ["edit-last-applied", "deployment/orders-app"]]
    check(
        bool(unset) and bool(keda_apply) and unset[0] < keda_apply[0],
        "`replicas` is not taken out of the last-applied configuration before the KEDA overlay",
    )
    return found
