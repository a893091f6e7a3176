"""docs/deploy.md: its commands name exactly what the example overlay and firestore.indexes.json need.

The page runs and is checked by ``deploy_page`` (its docstring says how); the drift tests run it on
mutated copies of the page, and of the overlay's config, to show that each kind of drift is caught.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from deploy_page import DEPLOY_DOC, Expected, expected, page_commands, problems
from kustomize_build import Resource
from rendered_manifests import OVERLAY, loaded_config, only, rendered_copy


@pytest.fixture
def want(tmp_path: Path) -> Expected:
    return expected(tmp_path)


def test_deploy_page_matches_the_overlay_and_the_index_file(tmp_path: Path, want: Expected) -> None:
    commands = page_commands(DEPLOY_DOC.read_text(), tmp_path / "run")
    assert len(commands) > len(want.indexes["fieldOverrides"]), "the page's commands did not all run"
    assert problems(commands, want) == []


def test_recorders_see_what_the_shell_expands(tmp_path: Path) -> None:
    """Guards the runner: variables, functions and quoting reach the recorded argv as bash gives them."""
    page = (
        '```sh\nX="a b"\nf() { for y in "$@"; do gcloud pubsub topics create "$y" --project="$X"; done; }\n'
        'f t1 t2\nkubectl -n "$X" rollout status deployment/d\n```\n'
    )
    commands = page_commands(page, tmp_path)
    assert [(c.verb, c.args, c.flags) for c in commands] == [
        (("pubsub", "topics", "create"), ["t1"], {"--project": "a b"}),
        (("pubsub", "topics", "create"), ["t2"], {"--project": "a b"}),
        (("rollout",), ["status", "deployment/d"], {"-n": "a b"}),
    ]


def _replace(old: str, new: str) -> Callable[[str], str]:
    def mutate(text: str) -> str:
        assert old in text, f"{old!r} is not on the page"
        return text.replace(old, new)

    return mutate


def _uncomment_monitoring_grant(text: str) -> str:
    """Grants monitoring.viewer although the example's subscription is not in watermark mode."""
    (block,) = re.findall(r"^# (gcloud projects add-iam-policy-binding.*\n)^#( .*monitoring\.viewer\n)", text, re.M)
    assert block, "the watermark-only grant is not on the page"
    return text.replace(f"# {block[0]}#{block[1]}", block[0] + block[1])


def _apply_the_overlay_first(text: str) -> str:
    """The overlay applied before the Secret its pods mount is created."""
    apply = "kubectl apply -k k8s/overlays/example\n"
    create = 'kubectl -n "$NAMESPACE" create secret'
    assert apply in text and create in text
    return text.replace(apply, "", 1).replace(create, apply + create, 1)


DRIFTS: dict[str, tuple[Callable[[str], str], str]] = {
    "project": (_replace("PROJECT=example-project", "PROJECT=example-projekt"), "example-project"),
    "subscription": (_replace("SUBSCRIPTION=orders-sidecar", "SUBSCRIPTION=orders"), "orders-sidecar"),
    "dead-letter-topic": (
        _replace("DEAD_LETTER_TOPIC=orders-dead-letter", "DEAD_LETTER_TOPIC=orders-dead-letters"),
        "dead-letter topic orders-dead-letter ",
    ),
    "dead-letter-policy": (
        _replace('--topic="$TOPIC" \\\n', '--topic="$TOPIC" --dead-letter-topic="$DEAD_LETTER_TOPIC" \\\n'),
        "dead-letters itself",
    ),
    "expiring-subscription": (_replace("--expiration-period=never", "--expiration-period=31d"), "may expire"),
    "retention": (_replace("--message-retention-duration=7d", "--message-retention-duration=10d"), "dedup.ttl"),
    "namespace": (_replace("NAMESPACE=orders ", "NAMESPACE=order "), "[orders/pubsub-sidecar]"),
    "kubernetes-service-account": (_replace("KSA=pubsub-sidecar ", "KSA=sidecar "), "[orders/pubsub-sidecar]"),
    "google-service-account": (_replace("GSA_NAME=orders-sidecar ", "GSA_NAME=pubsub-sidecar "), "orders-sidecar"),
    "database": (_replace("DATABASE='(default)'", "DATABASE=orders"), "(default)"),
    "native-mode": (_replace("--type=firestore-native", "--type=datastore-mode"), "native mode"),
    "ttl-field": (_replace("ttls update expire_at", "ttls update expires_at"), "TTL policies"),
    "missing-exemption": (_replace(" wanted_by shards v", " wanted_by v"), "missing [('leases', 'shards')]"),
    "extra-exemption": (_replace("exempt chunks d\n", "exempt chunks d shard\n"), "extra [('chunks', 'shard')]"),
    "wrong-role": (_replace("--role=roles/datastore.user", "--role=roles/datastore.owner"), "datastore.owner"),
    "monitoring-for-sequence-mode": (
        _uncomment_monitoring_grant,
        "extra [('projects', 'example-project', 'roles/monitoring.viewer')]",
    ),
    "registry": (_replace("create containers --repository-format", "create images --repository-format"), "containers"),
    "overlay-path": (
        _replace("kubectl apply -k k8s/overlays/example", "kubectl apply -k k8s/overlays/prod"),
        "example",
    ),
    "keda-replicas-reset": (
        _replace('kubectl -n "$NAMESPACE" apply edit-last-applied deployment/orders-app\n', ""),
        "last-applied",
    ),
    "peer-secret-name": (
        _replace("create secret generic pubsub-sidecar-peer", "create secret generic peer-secret"),
        "pubsub-sidecar-peer the pods mount",
    ),
    "peer-secret-namespace": (
        _replace('kubectl -n "$NAMESPACE" create secret', "kubectl create secret"),
        "in namespace orders",
    ),
    "peer-secret-key": (_replace("--from-literal=secret=", "--from-literal=token="), "no key 'secret'"),
    "peer-secret-not-random": (_replace('"$(openssl rand -hex 32)"', "changeme"), "32 random bytes"),
    "peer-secret-after-the-pods": (_apply_the_overlay_first, "after the overlay's pods"),
    "keda-operator-account": (
        _replace('"keda-operator@$PROJECT.iam.gserviceaccount.com" \\', '"keda@$PROJECT.iam.gserviceaccount.com" \\'),
        "KEDA's operator is not bound",
    ),
}


@pytest.mark.parametrize("drift", DRIFTS)
def test_drift_on_the_page_is_caught(tmp_path: Path, want: Expected, drift: str) -> None:
    mutate, mentioned = DRIFTS[drift]
    found = problems(page_commands(mutate(DEPLOY_DOC.read_text()), tmp_path / "run"), want)
    assert any(mentioned in problem for problem in found), found


CONFIG_DRIFTS = {
    "dead-letter-topic": ("topics/orders-dead-letter", "topics/payments-dead-letter", "payments-dead-letter"),
    "subscription": ("subscriptions/orders-sidecar", "subscriptions/orders-v2", "orders-v2"),
    "project": ("project: example-project", "project: other-project", "other-project"),
    "dedup-window": ("ttl: 7d", "ttl: 3d", "dedup.ttl (3d)"),
}


@pytest.mark.parametrize("drift", CONFIG_DRIFTS)
def test_drift_in_the_config_is_caught(tmp_path: Path, want: Expected, drift: str) -> None:
    """The other side: when the overlay's sidecar.yaml moves, the unchanged page no longer matches it."""
    old, new, mentioned = CONFIG_DRIFTS[drift]
    commands = page_commands(DEPLOY_DOC.read_text(), tmp_path / "run")
    overlay: list[Resource] = rendered_copy(OVERLAY)
    configmap = only(overlay, "ConfigMap")
    assert old in configmap["data"]["sidecar.yaml"]
    configmap["data"]["sidecar.yaml"] = configmap["data"]["sidecar.yaml"].replace(old, new)
    (tmp_path / "config").mkdir()
    want.config = loaded_config(overlay, tmp_path / "config")
    found = problems(commands, want)
    assert any(mentioned in problem for problem in found), found
