"""``Held``: messages kept back for their predecessor, checked against a plain list (hypothesis)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from sidecar.pipeline.ingest_held import Held


@dataclass(eq=False)
class _Item:
    key: str
    until: float


_KEYS = st.sampled_from(["a", "b", "c", "d"])
_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("hold"), _KEYS),
        st.tuples(st.just("release"), _KEYS),
        st.tuples(st.just("expire"), st.integers(min_value=0, max_value=3)),
    ),
    max_size=60,
)


@given(_STEPS)
def test_held_answers_as_a_plain_list_of_what_is_held(steps: list[tuple[str, object]]) -> None:
    held: Held[_Item] = Held(lambda item: item.key)
    model: list[_Item] = []
    """What is held, in the order held (deadlines never go back)."""
    now = 0.0
    for op, arg in steps:
        if op == "hold":
            now += 1.0
            item = _Item(str(arg), now)
            held.hold(item, item.until)
            model.append(item)
        elif op == "release":
            # A predecessor's pass: the fast path takes every held message of the key.
            taken = held.of_keys({str(arg)})
            assert taken == [item for item in model if item.key == arg]
            held.release(taken)
            model = [item for item in model if item.key != arg]
        else:
            cutoff = now - float(arg)  # type: ignore[arg-type]
            ended = held.expired(cutoff)
            assert ended == [item for item in model if item.until <= cutoff], "in the order held"
            model = [item for item in model if item.until > cutoff]
        assert len(held) == len(model)
        assert held.next_deadline() == (model[0].until if model else None)
        assert held.of_keys(["a", "b", "c", "d"]) == sorted(model, key=lambda item: "abcd".index(item.key))
    held.clear()
    assert len(held) == 0 and held.next_deadline() is None and held.of_keys(["a"]) == []
