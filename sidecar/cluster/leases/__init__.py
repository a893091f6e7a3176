"""Shard leases: which pod delivers which shard of a subscription (several pods on one subscription).

``layout`` reads and writes the lease documents, ``planner`` decides each round's writes (pure),
``manager.ShardLeases`` runs the rounds for one subscription over ``sidecar.store.documents``, and
``holdings`` keeps the shards this pod holds (their safety margins, the timer that drops them, the
``on_gained``/``on_lost`` callbacks). ``members`` lays out the member documents (one per pod name:
the process running under it, its address, its beat) and ``membership`` keeps this process's
(static membership: a restart under the same name takes its shards back at once).
"""

from sidecar.cluster.leases.layout import LEASE_LAYOUT_VERSION, LeaseLayoutError
from sidecar.cluster.leases.manager import ShardLeases
from sidecar.cluster.leases.members import MembershipRefused, Superseded
from sidecar.cluster.leases.membership import Route
from sidecar.cluster.leases.writes import LeaseStats

__all__ = [
    "LEASE_LAYOUT_VERSION",
    "LeaseLayoutError",
    "LeaseStats",
    "MembershipRefused",
    "Route",
    "ShardLeases",
    "Superseded",
]
