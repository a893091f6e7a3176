"""Config file, hostile and oversized files: alias bombs, deep nesting and files past the size bound
are refused quickly with one line, while ordinary aliases still load.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from config_support import error_of, write

from sidecar.config import errors as config_errors
from sidecar.config.model import ConfigError, load_config


def _billion_laughs() -> str:
    """The classic alias bomb: 10 levels of 10 references, 10^10 values from half a kilobyte."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for level in range(1, 10):
        refs = ",".join([f"*a{level - 1}"] * 10)
        lines.append(f"a{level}: &a{level} [{refs}]")
    return "\n".join(lines) + "\n"


HOSTILE_FILES = [
    # (id, file bytes, expected fragment of the one line)
    ("nul byte", b"project: demo\x00\nsubscriptions: []\n", "line 1, column 14: invalid YAML: a NUL byte"),
    ("control character", b"project: demo\n\x1b[31msubscriptions: []\n", "character #x001b is not allowed"),
    ("alias bomb", _billion_laughs().encode(), "expand to more than 100,000 through YAML aliases (an alias bomb?)"),
    ("deep flow nesting", b"project: " + b"[" * 100_000 + b"]" * 100_000 + b"\n", "nested more than 64 levels"),
    ("deep block nesting", "".join(f"{'  ' * i}k{i}:\n" for i in range(5_000)).encode(), "nested more than 64 levels"),
    ("recursive alias", b"project: &p [*p]\n", "an alias refers to a node that contains it"),
    ("bad tagged value", b"project: 2001-02-30\nsubscriptions: []\n", "invalid YAML value: day is out of range"),
]


@pytest.mark.parametrize(("raw", "fragment"), [c[1:] for c in HOSTILE_FILES], ids=[c[0] for c in HOSTILE_FILES])
def test_hostile_files_are_refused_quickly_with_one_line(tmp_path: Path, raw: bytes, fragment: str) -> None:
    path = tmp_path / "hostile.yaml"
    path.write_bytes(raw)
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    elapsed = time.monotonic() - started
    # Generous for a loaded machine; the alias bomb alone took 30 s and then ran out of memory.
    assert elapsed < 2.0, f"took {elapsed:.1f}s"
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert fragment in message
    assert "\n" not in message and len(message) < 300


def test_billion_laughs_is_small_and_ordinary_aliases_still_load(tmp_path: Path) -> None:
    assert len(_billion_laughs()) < 2048
    text = """\
project: demo
subscriptions:
  - name: a
    subscription: a-sub
    ordering: {mode: none}
    delivery: &delivery {max_delivery_attempts: 3, backoff: {initial: 2s, maximum: 1m}}
  - name: b
    subscription: b-sub
    ordering: {mode: none}
    delivery: *delivery
"""
    config = load_config(write(tmp_path, text), env={})
    assert config.subscriptions[0].delivery == config.subscriptions[1].delivery
    assert config.subscriptions[1].delivery.max_delivery_attempts == 3


def _many_subscriptions(count: int, *, duplicate_of: int | None = None, shared_delivery: bool = False) -> str:
    """A config of ``count`` subscriptions written out in full (about 20 YAML values each), the last
    one named like subscription ``duplicate_of`` when given; with ``shared_delivery`` each entry
    also refers to one delivery block through an alias."""
    lines = ["project: demo-project", "subscriptions:"]
    for index in range(count):
        name = f"s{duplicate_of if duplicate_of is not None and index == count - 1 else index}"
        lines += [
            f"  - name: {name}",
            f"    subscription: sub-{index}",
            "    ordering: {mode: sequence, key: {attribute: order_id}, sequence: {attribute: seq}}",
            "    dead_letter_topic: dead-letters",
        ]
        if shared_delivery:
            anchor = "&delivery " if index == 0 else ""
            lines.append(
                "    delivery: " + (f"{anchor}{{ack_deadline: 60s, max_delivery_attempts: 5, max_in_flight_per_key: 1}}"
                                    if index == 0 else "*delivery")
            )  # fmt: skip
    return "\n".join(lines) + "\n"


def test_a_big_file_without_aliases_is_refused_for_its_size_not_as_an_alias_bomb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bound scaled down (the real one takes 5,000 subscriptions and seconds to read): the rule is
    # the same. Before, such a file was "an alias bomb" although it holds no alias.
    monkeypatch.setattr(config_errors, "MAX_YAML_VALUES", 2_000)
    err = error_of(tmp_path, _many_subscriptions(200, duplicate_of=0))
    assert "the file is too big: it holds more than 2,000 YAML values" in err.reason
    assert "alias" not in err.reason
    assert "split the subscriptions over several sidecars" in err.reason


def test_a_file_within_the_bound_reports_its_duplicate_subscription_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config_errors, "MAX_YAML_VALUES", 2_000)
    err = error_of(tmp_path, _many_subscriptions(80, duplicate_of=3))
    assert err.path == "subscriptions[79].name"
    assert "duplicate name 's3': subscriptions[3] has it already" in err.reason


def test_aliases_that_expand_a_file_past_the_bound_are_named_with_the_written_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config_errors, "MAX_YAML_VALUES", 2_000)
    # 90 entries of 18 written values plus an alias each: within the bound as written, past it expanded.
    text = _many_subscriptions(90, shared_delivery=True)
    err = error_of(tmp_path, text)
    assert "as written expand to more than 2,000 through YAML aliases (an alias bomb?)" in err.reason
    written = int(err.reason.split("its ", 1)[1].split(" values", 1)[0].replace(",", ""))
    assert written <= 2_000
    # Without the aliases' expansion pushing it over, the same file loads.
    monkeypatch.setattr(config_errors, "MAX_YAML_VALUES", 100_000)
    assert len(load_config(write(tmp_path, text), env={}).subscriptions) == 90
