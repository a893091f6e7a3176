"""Acknowledge and ModifyAckDeadline traffic the clients sent: what a subscriber's lease management costs.

Counting at the server measures the official client as it is, with nothing added to it. A nack is a
modack to 0 and is counted apart. Read and reset through the admin API (``sidecar.emulators.pubsub_admin``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RpcCounters:
    acknowledge_calls: int = 0
    acknowledge_ack_ids: int = 0
    modify_ack_deadline_calls: int = 0
    """Calls that change deadlines (seconds > 0): receipt modacks and lease extensions."""
    modify_ack_deadline_ack_ids: int = 0
    nack_calls: int = 0
    """ModifyAckDeadline calls with 0 seconds."""
    nack_ack_ids: int = 0

    def count_ack(self, ack_ids: int) -> None:
        self.acknowledge_calls += 1
        self.acknowledge_ack_ids += ack_ids

    def count_modack(self, seconds: int, ack_ids: int) -> None:
        if seconds == 0:
            self.nack_calls += 1
            self.nack_ack_ids += ack_ids
        else:
            self.modify_ack_deadline_calls += 1
            self.modify_ack_deadline_ack_ids += ack_ids

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)
