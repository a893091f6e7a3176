"""``bench.profile_report``: collapsed stacks read, shares counted, flame graph drawn."""

from __future__ import annotations

import pytest

from bench.profile_report import flame_svg, inclusive, package_of, read_collapsed, report, self_by_package

_STACKS = [
    "<module> (/work/x/sidecar/__main__.py:1);run (/work/x/sidecar/app.py:10);"
    "walk (/work/x/sidecar/engine/core.py:5) 6",
    # A recursive frame counts once per sample, not once per level.
    "<module> (/work/x/sidecar/__main__.py:1);walk (/work/x/sidecar/engine/core.py:5);"
    "walk (/work/x/sidecar/engine/core.py:5) 3",
    "<module> (/work/x/sidecar/__main__.py:1);_read (/v/site-packages/grpc/aio/_call.py:7) 1",
    " 2",  # a sample with no Python frame
]


def test_inclusive_shares_count_each_function_once_per_sample() -> None:
    profile = read_collapsed(_STACKS)
    assert profile.samples == 12
    counts = inclusive(profile, keep=None)
    assert counts["walk (sidecar/engine/core.py)"] == 9
    assert counts["<module> (sidecar/__main__.py)"] == 10
    assert counts["(no Python frame)"] == 2


def test_self_time_is_grouped_by_package() -> None:
    by_package = self_by_package(read_collapsed(_STACKS))
    assert by_package == {"sidecar.engine": 9, "grpcio": 1, "other": 2}
    assert package_of("x (/v/site-packages/google/protobuf/message.py:3)") == "protobuf"


def test_the_report_names_the_largest_shares_first() -> None:
    text = report(read_collapsed(_STACKS), top=2, everything=False)
    lines = text.splitlines()
    assert lines[0] == "12 samples"
    assert lines[2].startswith("inclusive (top 2")
    assert "83.3%  <module> (sidecar/__main__.py)" in lines[3]
    assert "75.0%  walk (sidecar/engine/core.py)" in lines[4]


def test_a_line_that_is_not_a_collapsed_stack_is_refused_with_its_number() -> None:
    with pytest.raises(ValueError, match="line 2"):
        read_collapsed(["a;b 1", "a;b many"])


def test_the_flame_graph_is_an_svg_with_a_tooltip_per_frame() -> None:
    svg = flame_svg(read_collapsed(_STACKS), "seq-100keys")
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert "<title>walk (sidecar/engine/core.py) (6 samples, 50.0%)</title>" in svg
    assert "seq-100keys (12 samples)" in svg
