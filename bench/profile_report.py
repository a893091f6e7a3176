"""Summarise and draw a py-spy profile (collapsed stacks, ``py-spy record --format raw``).

    python -m bench --scenario seq-100keys --py-spy /tmp/prof      # record (see bench.sidecar_process.Profiler)
    python -m bench.profile_report /tmp/prof/seq-100keys.txt --svg bench/results/seq-100keys.svg

Prints the total samples, then the functions with the largest inclusive share (a function counted
once per sample however deep it recurs), restricted by default to the sidecar's own frames and the
libraries it calls directly, then the self share per package. With ``--gil`` recordings every
sample is a moment some thread held the GIL, so a share is of the interpreter's busy time.

``--svg`` draws the stacks as a flame graph (root at the bottom, width = samples), a plain SVG
any browser shows, with each frame's name, samples and share in its tooltip.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]*)(?::\d+)?\)$")

_PACKAGES = (
    ("sidecar/engine/", "sidecar.engine"),
    ("sidecar/store/", "sidecar.store"),
    ("sidecar/emulators/", "sidecar.emulators"),
    ("sidecar/", "sidecar"),
    ("pubsub_sidecar_client/", "client"),
    ("google/protobuf/", "protobuf"),
    ("proto/", "proto-plus"),
    ("google/cloud/firestore", "google-cloud-firestore"),
    ("google/cloud/pubsub", "google-cloud-pubsub"),
    ("google/api_core/", "google-api-core"),
    ("grpc/", "grpcio"),
    ("asyncio/", "asyncio"),
    ("concurrent/futures/", "concurrent.futures"),
    ("threading.py", "threading"),
    ("queue.py", "queue"),
)


@dataclass
class Profile:
    samples: int = 0
    stacks: list[tuple[tuple[str, ...], int]] = field(default_factory=list)


def read_collapsed(lines: Iterable[str]) -> Profile:
    """``frame;frame;...;leaf COUNT`` per line, root first (py-spy's raw format)."""
    profile = Profile()
    for number, line in enumerate(lines, 1):
        line = line.rstrip("\n")
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            raise ValueError(f"line {number}: not 'frame;frame;... COUNT': {line[:80]!r}")
        # An empty stack: a sample in which py-spy saw no Python frame (native code only).
        frames = tuple(stack.split(";")) if stack else ("(no Python frame)",)
        profile.samples += int(count)
        profile.stacks.append((frames, int(count)))
    return profile


def package_of(frame: str) -> str:
    match = _FRAME.match(frame)
    path = match["file"] if match else frame
    for marker, name in _PACKAGES:
        if marker in path:
            return name
    return "other"


def short(frame: str) -> str:
    """``func (…/sidecar/store/persist.py:12)`` -> ``func (sidecar/store/persist.py)``."""
    match = _FRAME.match(frame)
    if not match:
        return frame
    path = match["file"]
    for anchor in ("site-packages/", "/work/", "lib/python3"):
        if anchor in path:
            path = path.split(anchor, 1)[1]
    path = re.sub(r"^[^/]*/(?=sidecar/|bench/)", "", path)
    return f"{match['func']} ({path})"


def inclusive(profile: Profile, keep: set[str] | None) -> Counter[str]:
    """Samples per function, each function once per stack; ``keep``: only frames of these packages."""
    counts: Counter[str] = Counter()
    for frames, count in profile.stacks:
        seen = {short(f) for f in frames if keep is None or package_of(f) in keep}
        for name in seen:
            counts[name] += count
    return counts


def self_by_package(profile: Profile) -> Counter[str]:
    counts: Counter[str] = Counter()
    for frames, count in profile.stacks:
        counts[package_of(frames[-1]) if frames else "other"] += count
    return counts


def report(profile: Profile, top: int, everything: bool) -> str:
    if profile.samples == 0:
        return "no samples"
    total = profile.samples
    keep = (
        None
        if everything
        else {
            "sidecar",
            "sidecar.store",
            "sidecar.engine",
            "google-cloud-firestore",
            "google-cloud-pubsub",
            "protobuf",
            "proto-plus",
            "grpcio",
        }
    )
    lines = [f"{total} samples"]
    lines.append(f"\ninclusive (top {top}{'' if everything else ', own and client frames'}):")
    for name, count in inclusive(profile, keep).most_common(top):
        lines.append(f"  {100 * count / total:5.1f}%  {name}")
    lines.append("\nself, by package:")
    for name, count in self_by_package(profile).most_common():
        lines.append(f"  {100 * count / total:5.1f}%  {name}")
    return "\n".join(lines)


# ---- flame graph ------------------------------------------------------------------------------------

_ROW = 16
_WIDTH = 1600


@dataclass
class _Node:
    count: int = 0
    children: dict[str, _Node] = field(default_factory=dict)


def _tree(profile: Profile) -> _Node:
    root = _Node()
    for frames, count in profile.stacks:
        node = root
        node.count += count
        for frame in frames:
            node = node.children.setdefault(short(frame), _Node())
            node.count += count
    return root


def _depth(node: _Node) -> int:
    return 1 + max((_depth(child) for child in node.children.values()), default=0)


def _colour(name: str) -> str:
    package = package_of(name)
    hue = {
        "sidecar": 30,
        "sidecar.store": 45,
        "sidecar.engine": 60,
        "protobuf": 200,
        "proto-plus": 210,
        "grpcio": 280,
        "asyncio": 120,
        "google-cloud-firestore": 0,
        "google-cloud-pubsub": 340,
    }.get(package, 90)
    shade = sum(map(ord, name)) % 20
    return f"hsl({hue},{55 + shade}%,{62 + shade // 2}%)"


def flame_svg(profile: Profile, title: str) -> str:
    root = _tree(profile)
    height = (_depth(root) + 2) * _ROW
    scale = _WIDTH / max(root.count, 1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" font-family="monospace" '
        f'font-size="11">',
        f'<text x="4" y="12">{html.escape(title)} ({root.count} samples)</text>',
    ]

    def draw(name: str, node: _Node, x: float, depth: int) -> None:
        width = node.count * scale
        if width < 0.5:
            return
        y = height - (depth + 1) * _ROW
        share = 100 * node.count / max(root.count, 1)
        label = html.escape(name)
        parts.append(
            f"<g><title>{label} ({node.count} samples, {share:.1f}%)</title>"
            f'<rect x="{x:.1f}" y="{y}" width="{width:.1f}" height="{_ROW - 1}" fill="{_colour(name)}"/>'
        )
        if width > 40:
            text = label[: int(width / 6.6)]
            parts.append(f'<text x="{x + 2:.1f}" y="{y + 11}">{text}</text>')
        parts.append("</g>")
        offset = x
        for child_name, child in sorted(node.children.items()):
            draw(child_name, child, offset, depth + 1)
            offset += child.count * scale

    offset = 0.0
    for name, child in sorted(root.children.items()):
        draw(name, child, offset, 0)
        offset += child.count * scale
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_report", description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="collapsed stacks written by py-spy record --format raw")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--all", action="store_true", help="every frame, not only the sidecar's and its clients'")
    parser.add_argument("--svg", metavar="PATH", help="also draw the flame graph to PATH")
    args = parser.parse_args(argv)
    path = Path(args.profile)
    try:
        profile = read_collapsed(path.read_text().splitlines())
    except (OSError, ValueError) as exc:
        print(f"profile_report: {path}: {exc}", file=sys.stderr)
        return 2
    print(report(profile, args.top, args.all))
    if args.svg:
        Path(args.svg).write_text(flame_svg(profile, path.stem))
        print(f"\nflame graph: {args.svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
