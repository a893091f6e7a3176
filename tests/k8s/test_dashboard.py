"""k8s/dashboards: the Grafana dashboard, provisioned by a ConfigMap, queries what the sidecar exports.

The metric names and labels are read from the sidecar's own registry, built as the running
sidecar builds it (``sidecar.ops.observability.Metrics`` plus its collector), with a snapshot
whose every field is filled in from the snapshot class's own type hints, and every metric object
of ``Metrics`` observed once: so every family the code can export has a sample, and a metric added,
renamed or relabelled in the code is seen here without a list to keep. A family that still has no
sample fails the test (the filler must learn its type), rather than pass unchecked.

Each panel's PromQL (and each template variable's query) is checked: brackets balanced; every ``pubsub_sidecar_*``
name is a series the sidecar exports; every label matcher, every ``by (...)`` of an aggregation and
every ``{{label}}`` of a legend names a label that series has, or ``namespace``/``pod`` (the
target labels Prometheus adds at scrape time), or ``le`` on a histogram's buckets.
``dashboard_problems`` returns every mismatch; the drift tests show each kind is caught.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import kubernetes_validate
import pytest
from prometheus_client.metrics import MetricWrapperBase
from rendered_manifests import K8S, only, rendered_copy

from sidecar.ops.observability import Metrics, PeerCollector, PeerMetrics, SubscriptionMetrics

_Snapshot = typing.TypeVar("_Snapshot")

DASHBOARDS = K8S / "dashboards"
DASHBOARD_FILE = DASHBOARDS / "pubsub-sidecar.json"
GRAFANA_OVERLAY = K8S / "overlays" / "grafana"
SCRAPE_LABELS = frozenset({"namespace", "pod"})
"""Target labels Prometheus (and Managed Prometheus) put on every series it scrapes from a pod."""
CONFIGMAP_LIMIT_BYTES = 1024 * 1024

# What the operator must find on the dashboard (issue 31, item 7): each topic with the series a
# panel must query for it.
TOPICS: dict[str, set[str]] = {
    "lag": {"pubsub_sidecar_oldest_undelivered_age_seconds"},
    "deficit": {"pubsub_sidecar_backlog_deficit", "pubsub_sidecar_backlog_deficit_seconds"},
    "intake against delivery": {"pubsub_sidecar_intake_rate", "pubsub_sidecar_delivery_rate"},
    "delivered/s": {"pubsub_sidecar_delivered_total"},
    "held": {"pubsub_sidecar_buffered_messages", "pubsub_sidecar_in_flight_messages"},
    "blocked keys and why": {"pubsub_sidecar_keys_blocked", "pubsub_sidecar_keys_blocked_dead_letter"},
    "dead letters by reason": {"pubsub_sidecar_dead_lettered_total"},
    "shards per pod": {"pubsub_sidecar_shards_owned"},
    "handovers per pod": {"pubsub_sidecar_shards_adopted_total", "pubsub_sidecar_shards_dropped_total"},
    "Firestore operations per message": {"pubsub_sidecar_stored_total"},
    "persist latency": {"pubsub_sidecar_persist_latency_seconds_bucket"},
    "publish-to-delivery latency": {"pubsub_sidecar_publish_to_delivery_seconds_bucket"},
    "forwarding to the owner": {"pubsub_sidecar_peer_forwarded_total"},
    "peer calls refused": {"pubsub_sidecar_peer_unauthenticated_total"},
}
PER_POD_TOPICS = ("shards per pod", "handovers per pod", "forwarding to the owner")

_METRIC = re.compile(r"\b(pubsub_sidecar_[a-z0-9_]+)\b(\{[^}]*\})?")
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*"')
_AGGREGATION = re.compile(
    r"\b(sum|min|max|avg|count|group|stddev|stdvar|topk|bottomk|quantile|count_values)\s+(by|without)\s*\(([^)]*)\)\s*\("
)
_TRAILING_GROUPING = re.compile(r"\)\s*(by|without)\s*\(")
_LABEL_VALUES = re.compile(r"label_values\(\s*(pubsub_sidecar_[a-z0-9_]+)(?:\{[^}]*\})?\s*,\s*([A-Za-z_]\w*)\s*\)")
_LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_]\w*)\s*\}\}")

# ---- what the sidecar exports ----------------------------------------------------------------


def _sample_value(hint: Any) -> Any:
    """A value of the annotated type that makes the collector emit a sample (never None, never empty)."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        (arm,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _sample_value(arm)
    if origin in (Mapping, dict):
        return {"sample": _sample_value(typing.get_args(hint)[1])}
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return filled(hint)
    if hint is bool:
        return True
    if hint is int:
        return 1
    if hint is float:
        return 60.0  # a minute: long enough for a rate over a window to count as known
    if hint is str:
        return "orders"
    raise AssertionError(f"no sample value for a SubscriptionMetrics field of type {hint!r}: extend _sample_value")


def filled(cls: type[_Snapshot]) -> _Snapshot:
    """An instance of the snapshot dataclass ``cls`` with every field filled in from its type hints."""
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _sample_value(hints[f.name]) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]


def populated_snapshot() -> SubscriptionMetrics:
    return filled(SubscriptionMetrics)


def _observe_once(metric: MetricWrapperBase) -> None:
    names = metric._labelnames
    child: Any = metric.labels(*(["sample"] * len(names))) if names else metric
    for method, argument in (("observe", 0.01), ("inc", 1), ("set", 1)):
        if hasattr(child, method):
            getattr(child, method)(argument)
            return
    raise AssertionError(f"cannot observe {metric!r}")


def exported_series() -> dict[str, set[str]]:
    """Series name (as PromQL names it: ``_total``, ``_bucket``...) -> its label names."""
    # As sidecar.wiring.app builds it: the registry of Metrics, the subscriptions' collector and the
    # peer channel's (the two whose families the dashboard reads).
    metrics = Metrics()
    metrics.add_collector(lambda: [populated_snapshot()])
    metrics.registry.register(PeerCollector(lambda: filled(PeerMetrics)))
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            _observe_once(value)
    series: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        assert family.samples, f"{family.name} has no sample with a filled snapshot: extend the filler"
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


# ---- reading the dashboard -------------------------------------------------------------------


def load_dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD_FILE.read_text()))


def graph_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(where, PromQL, legend) of every panel target and every query variable."""
    for panel in graph_panels(dashboard):
        for target in panel["targets"]:
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"], target.get("legendFormat", "")
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            yield f"variable ${variable['name']}", variable["query"]["query"], ""


def _argument(expr: str, open_paren: int) -> str:
    """The text inside the parenthesis that opens at ``open_paren``."""
    depth = 0
    for index in range(open_paren, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[index], 0)
        if depth == 0:
            return expr[open_paren + 1 : index]
    raise AssertionError(f"unbalanced parentheses in {expr!r}")


def query_problems(where: str, expr: str, legend: str, series: dict[str, set[str]]) -> list[str]:
    found: list[str] = []

    def labels_of(name: str) -> set[str]:
        return series.get(name, set()) | SCRAPE_LABELS

    depth: list[str] = []
    for char in expr:
        if char in "([{":
            depth.append({"(": ")", "[": "]", "{": "}"}[char])
        elif char in ")]}" and (not depth or depth.pop() != char):
            found.append(f"{where}: unbalanced {char!r} in {expr}")
            return found
    if depth:
        found.append(f"{where}: {depth[-1]!r} missing in {expr}")
        return found
    names = [match.group(1) for match in _METRIC.finditer(expr)]
    if not names:
        found.append(f"{where}: queries no metric of the sidecar: {expr}")
    for match in _METRIC.finditer(expr):
        name, matchers = match.group(1), match.group(2) or ""
        if name not in series:
            found.append(f"{where}: {name} is not a series the sidecar exports")
            continue
        for label in _MATCHER.findall(matchers):
            if label not in labels_of(name):
                found.append(f"{where}: {name} has no label {label!r}")
    if _TRAILING_GROUPING.search(expr):
        found.append(f"{where}: write `sum by (...) (...)`, grouping before the argument: {expr}")
    grouped: set[str] = set()
    for match in _AGGREGATION.finditer(expr):
        labels = {label.strip() for label in match.group(3).split(",") if label.strip()}
        grouped |= labels
        for name in _METRIC.findall(_argument(expr, match.end() - 1)):
            missing = labels - labels_of(name[0])
            if missing:
                found.append(f"{where}: groups {name[0]} by {sorted(missing)}, labels it does not have")
    for name, label in _LABEL_VALUES.findall(expr):
        if label not in labels_of(name):
            found.append(f"{where}: label_values of {label!r}, which {name} does not have")
        grouped.add(label)
    available = grouped or set().union(*(labels_of(n) for n in names))
    for label in _LEGEND_LABEL.findall(legend):
        if label not in available:
            found.append(f"{where}: the legend shows {label!r}, a label the query does not keep")
    return found


def dashboard_problems(dashboard: dict[str, Any], series: dict[str, set[str]]) -> list[str]:
    return [
        problem for where, expr, legend in queries(dashboard) for problem in query_problems(where, expr, legend, series)
    ]


# ---- the ConfigMap ---------------------------------------------------------------------------


def test_an_overlay_provisions_the_dashboard_as_a_configmap_grafana_loads() -> None:
    resources = rendered_copy(GRAFANA_OVERLAY)
    configmap = only(resources, "ConfigMap")
    assert len(resources) == 1
    kubernetes_validate.validate(configmap, kubernetes_validate.utils.latest_version(), strict=True)
    # The Grafana sidecar's convention: it loads ConfigMaps with this label, in its namespace.
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "monitoring"
    # No hash suffix: a new one at each change would leave the old copy, a second dashboard.
    assert configmap["metadata"]["name"] == "pubsub-sidecar-dashboard"
    assert configmap["data"] == {DASHBOARD_FILE.name: DASHBOARD_FILE.read_text()}
    assert len(DASHBOARD_FILE.read_bytes()) < CONFIGMAP_LIMIT_BYTES


def test_the_dashboard_is_a_grafana_dashboard_on_a_chosen_prometheus() -> None:
    dashboard = load_dashboard()
    series = exported_series()
    assert dashboard["uid"] == "pubsub-sidecar"
    assert "id" not in dashboard or dashboard["id"] is None  # provisioned: Grafana assigns it
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), ids
    occupied: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {(grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"]) for dy in range(grid["h"])}
        assert not cells & occupied, f"{panel['title']!r} overlaps another panel"
        occupied |= cells
    for panel in graph_panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["description"].strip(), panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            # Scoped to the chosen namespace, and subscriptions where the series has them.
            for match in _METRIC.finditer(target["expr"]):
                name, matchers = match.group(1), match.group(2) or ""
                assert 'namespace="$namespace"' in matchers, (panel["title"], match.group(0))
                if "subscription" in series[name]:
                    assert 'subscription=~"$subscription"' in matchers, (panel["title"], match.group(0))


# ---- the queries against the registry --------------------------------------------------------


def test_every_query_names_series_the_sidecar_exports_with_their_labels() -> None:
    series = exported_series()
    # The registry was read, not guessed: the families the sidecar is known for are there.
    assert series["pubsub_sidecar_dead_lettered_total"] == {"subscription", "reason"}
    assert "le" in series["pubsub_sidecar_persist_latency_seconds_bucket"]
    dashboard = load_dashboard()
    assert len(list(queries(dashboard))) >= len(TOPICS)
    assert dashboard_problems(dashboard, series) == []


def test_every_topic_of_the_operator_has_a_panel() -> None:
    panels = graph_panels(load_dashboard())

    def queried(panel: dict[str, Any]) -> set[str]:
        return {name for t in panel["targets"] for name, _ in _METRIC.findall(t["expr"])}

    for topic, needed in TOPICS.items():
        showing = [p for p in panels if needed <= queried(p)]
        assert showing, f"no panel shows {topic} ({sorted(needed)})"
        if topic in PER_POD_TOPICS:
            assert any("pod" in t["legendFormat"] for p in showing for t in p["targets"]), topic


def _edit_expr(old: str, new: str) -> Callable[[dict[str, Any]], None]:
    def mutate(dashboard: dict[str, Any]) -> None:
        for panel in graph_panels(dashboard):
            for target in panel["targets"]:
                if old in target["expr"]:
                    target["expr"] = target["expr"].replace(old, new, 1)
                    return
        raise AssertionError(f"{old!r} is in no query")

    return mutate


def _edit_legend(dashboard: dict[str, Any]) -> None:
    target = graph_panels(dashboard)[0]["targets"][0]
    target["legendFormat"] = "{{code}} " + target["legendFormat"]


def _group_after_the_argument(dashboard: dict[str, Any]) -> None:
    target = graph_panels(dashboard)[0]["targets"][0]
    match = re.fullmatch(r"max by \(subscription\) \((.*)\)", target["expr"])
    assert match, target["expr"]
    target["expr"] = f"max ({match.group(1)}) by (subscription)"


def _edit_variable(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    variables["namespace"]["query"]["query"] = "label_values(pubsub_sidecar_received_total, topic)"


DRIFTS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "renamed-metric": (
        _edit_expr("pubsub_sidecar_delivered_total", "pubsub_sidecar_deliveries_total"),
        "pubsub_sidecar_deliveries_total is not a series",
    ),
    "counter-without-total": (
        _edit_expr("pubsub_sidecar_delivered_total", "pubsub_sidecar_delivered"),
        "pubsub_sidecar_delivered is not a series",
    ),
    "matcher-on-a-missing-label": (
        _edit_expr(
            'pubsub_sidecar_buffered_messages{namespace="$namespace"',
            'pubsub_sidecar_buffered_messages{stage="held", namespace="$namespace"',
        ),
        "has no label 'stage'",
    ),
    "grouping-by-a-missing-label": (
        _edit_expr(
            "sum by (subscription) (rate(pubsub_sidecar_delivered_total",
            "sum by (subscription, reason) (rate(pubsub_sidecar_delivered_total",
        ),
        "by ['reason']",
    ),
    "trailing-grouping": (_group_after_the_argument, "grouping before the argument"),
    "legend-label-dropped-by-the-query": (_edit_legend, "a label the query does not keep"),
    "variable-on-a-missing-label": (_edit_variable, "label_values of 'topic'"),
    "unbalanced": (_edit_expr("[$__rate_interval]))", "[$__rate_interval])"), "missing in"),
}


@pytest.mark.parametrize("drift", DRIFTS)
def test_a_query_that_drifts_from_the_registry_is_caught(drift: str) -> None:
    """Guards the check above: each kind of mismatch is reported."""
    mutate, mentioned = DRIFTS[drift]
    series = exported_series()
    dashboard = copy.deepcopy(load_dashboard())
    mutate(dashboard)
    found = dashboard_problems(dashboard, series)
    assert any(mentioned in problem for problem in found), found


def test_the_filled_snapshot_makes_every_optional_family_emit() -> None:
    """Guards the reader: families emitted only for some snapshots (watermark mode, shard leases,
    per-reason and per-code counts) are filled in too, so their labels are checked like the rest."""
    snapshot = populated_snapshot()
    for field in dataclasses.fields(snapshot):
        assert getattr(snapshot, field.name) not in (None, {}), field.name
    series = exported_series()
    assert series["pubsub_sidecar_shards_owned"] == {"subscription"}
    assert series["pubsub_sidecar_watermark_lag_seconds"] == {"subscription"}
    assert series["pubsub_sidecar_streaming_pull_errors_total"] == {"subscription", "code"}
