"""Pin the example overlay's pubsub-sidecar image to a digest: `pin_digest.py sha256:...`.

Rewrites only the `images:` entry named pubsub-sidecar in k8s/overlays/example/kustomization.yaml:
its newTag or digest line becomes `digest: <the digest>` (kustomize then renders
`newName@sha256:...`). Line-based, so the file's comments and the other entries stay as they are.
build.sh calls it with the digest it just wrote to build/image/digest.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "k8s" / "overlays" / "example" / "kustomization.yaml"
IMAGE = "pubsub-sidecar"
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def pin(text: str, digest: str) -> str:
    lines = text.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.strip() == f"- name: {IMAGE}")
    indent = " " * (len(lines[start]) - len(lines[start].lstrip()) + 2)
    end = start + 1
    while end < len(lines) and lines[end].startswith(indent):
        end += 1
    entry = [line for line in lines[start + 1 : end] if not line.strip().startswith(("newTag:", "digest:"))]
    entry.append(f"{indent}digest: {digest}\n")
    return "".join(lines[: start + 1] + entry + lines[end:])


def main() -> None:
    (digest,) = sys.argv[1:]
    if not DIGEST.fullmatch(digest):
        raise SystemExit(f"pin_digest: not a sha256 digest: {digest!r}")
    text = OVERLAY.read_text()
    pinned = pin(text, digest)
    if pinned != text:
        OVERLAY.write_text(pinned)
    print(f"pin_digest: {OVERLAY.relative_to(ROOT)}: {IMAGE} @ {digest}")


if __name__ == "__main__":
    main()
