"""A RuleBasedStateMachine: the engine against a naive reference model of sequence mode.

The model is the spec written as plainly as possible: per key a set of stored sequences, the next
sequence owed to the app, and the one message in flight. After every ``take`` the engine must
hand out exactly what the model says is deliverable.
"""

from __future__ import annotations

from harness import seq_message
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sidecar.engine import Engine, EngineConfig

_KEYS = ("a", "b", "c")


class EngineVersusModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.config = EngineConfig(
            mode="sequence", max_delivery_attempts=1000, backoff_initial_ms=0, backoff_maximum_ms=0
        )
        self.engine = Engine(self.config)
        self.now_ms = 0
        self.stored: dict[str, set[int]] = {key: set() for key in _KEYS}
        self.next: dict[str, int] = dict.fromkeys(_KEYS, 1)
        self.flying: dict[str, tuple[int, str]] = {}  # key -> (sequence, delivery id)
        self.acked: set[tuple[str, int]] = set()
        self.consumers: dict[str, str] = {}
        self.lives = 0

    @rule(key=st.sampled_from(_KEYS), seq=st.integers(1, 6))
    def store(self, key: str, seq: int) -> None:
        if self.lives and seq < self.next[key]:
            return  # the store keeps a tombstone of what was acked: the copy never reaches the engine
        actions = self.engine.on_stored(seq_message(key, seq), self.now_ms)
        kinds = [type(a).__name__ for a in actions]
        if seq in self.stored[key] or seq < self.next[key]:
            assert kinds == ["DropDuplicate"]
            return
        self.stored[key].add(seq)
        assert kinds == ([] if seq < self._run_end(key) else ["Hold"])

    def _run_end(self, key: str) -> int:
        end = self.next[key]
        while end in self.stored[key]:
            end += 1
        return end

    @rule(consumer=st.sampled_from(["x", "y"]))
    def take(self, consumer: str) -> None:
        expected = {
            (key, self.next[key]) for key in _KEYS if key not in self.flying and self.next[key] in self.stored[key]
        }
        deliveries = self.engine.take(consumer, 100, self.now_ms)
        assert {(d.message.key, d.message.sequence) for d in deliveries} == expected
        for delivery in deliveries:
            self.flying[delivery.message.key] = (delivery.message.sequence, delivery.delivery_id)  # type: ignore[assignment]
            self.consumers[delivery.delivery_id] = consumer

    @precondition(lambda self: bool(self.flying))
    @rule(data=st.data())
    def ack_and_commit(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.flying)))
        seq, delivery_id = self.flying.pop(key)
        intent = self.engine.ack(self.consumers[delivery_id], delivery_id, self.now_ms)
        assert intent.cursor == seq + 1
        self.engine.ack_durable([delivery_id], self.now_ms)
        self.stored[key].discard(seq)
        self.acked.add((key, seq))
        self.next[key] = seq + 1

    @precondition(lambda self: bool(self.flying))
    @rule(data=st.data())
    def nack_retry_now(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.flying)))
        _, delivery_id = self.flying.pop(key)
        assert self.engine.nack(self.consumers[delivery_id], delivery_id, self.now_ms, retry_after_ms=0) == []

    @rule(consumer=st.sampled_from(["x", "y"]))
    def close(self, consumer: str) -> None:
        self.engine.consumer_closed(consumer, self.now_ms)
        for key, (_, delivery_id) in list(self.flying.items()):
            if self.consumers.get(delivery_id) == consumer:
                del self.flying[key]

    @rule()
    def crash_and_recover(self) -> None:
        self.engine = Engine.restore(self.config, self.engine.export(), self.now_ms, id_prefix=f"r{self.now_ms}-")
        self.now_ms += 1
        self.lives += 1
        self.flying.clear()
        assert self.engine.tick(self.now_ms) == []

    @invariant()
    def status_counts_match_the_model(self) -> None:
        status, _ = self.engine.status(self.now_ms, max_keys=0)
        assert status.buffered == sum(len(s) for s in self.stored.values())
        assert status.in_flight == len(self.flying)
        # A key waits when it holds messages and none of them can go next (a gap at its head).
        blocked = 0
        for key in _KEYS:
            flying = self.flying.get(key)
            held = self.stored[key] - ({flying[0]} if flying else set())
            next_out = self.next[key] + (1 if flying else 0)
            blocked += bool(held) and next_out not in held
        flying_seqs = {key: flying[0] for key, flying in self.flying.items()}
        assert status.ready == sum(
            1 for key in _KEYS for seq in self.stored[key] if seq < self._run_end(key) and seq != flying_seqs.get(key)
        )
        assert status.keys_blocked == blocked


EngineVersusModel.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, derandomize=True, deadline=None, database=None
)
TestEngineVersusModel = EngineVersusModel.TestCase
