"""The image's SBOM: cyclonedx-py's CycloneDX JSON of the virtualenv, plus the Debian packages.

Rules:
- The Python part is cyclonedx-py's output unchanged (run by build.sh on the image's own
  interpreter over /opt/pubsub-sidecar, so it lists what the image holds, the project included).
- Each Debian package unpacked into the image is a component with its purl
  (pkg:deb/debian/NAME@VERSION?arch=ARCH&distro=debian-12), read from the .deb files themselves.
- metadata.component is the image: type container, its version, and its manifest digest as the
  purl (pkg:oci/pubsub-sidecar@sha256:...) and as a hash; the digest is the one build/image/digest
  holds, and the OCI layout's config and layer digests are properties.
- No timestamp and no random serial number: the same image gives the same SBOM.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import quote

DEBIAN_RELEASE = "debian-12"


def deb_components(debs: Path) -> list[dict[str, Any]]:
    components = []
    for deb in sorted(debs.glob("*.deb")):
        fields = subprocess.run(
            ["dpkg-deb", "--field", str(deb), "Package", "Version", "Architecture", "Homepage"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        info = dict(line.split(": ", 1) for line in fields.splitlines() if ": " in line)
        purl = (
            f"pkg:deb/debian/{info['Package']}@{quote(info['Version'], safe='')}"
            f"?arch={info['Architecture']}&distro={DEBIAN_RELEASE}"
        )
        component: dict[str, Any] = {
            "type": "library",
            "bom-ref": purl,
            "name": info["Package"],
            "version": info["Version"],
            "purl": purl,
            "properties": [{"name": "debian:architecture", "value": info["Architecture"]}],
        }
        if "Homepage" in info:
            component["externalReferences"] = [{"type": "website", "url": info["Homepage"]}]
        components.append(component)
    return components


def image_component(layout: Path, digest: str) -> dict[str, Any]:
    index = json.loads((layout / "index.json").read_text())
    (entry,) = index["manifests"]
    assert entry["digest"] == digest, f"{entry['digest']} is not {digest}"
    algorithm, _, hexdigest = digest.partition(":")
    manifest = json.loads((layout / "blobs" / algorithm / hexdigest).read_text())
    version = entry.get("annotations", {}).get("org.opencontainers.image.ref.name", "")
    purl = f"pkg:oci/pubsub-sidecar@{quote(digest, safe='')}"
    properties = [{"name": "oci:manifest-digest", "value": digest}]
    properties.append({"name": "oci:config-digest", "value": manifest["config"]["digest"]})
    properties += [{"name": "oci:layer-digest", "value": layer["digest"]} for layer in manifest["layers"]]
    return {
        "type": "container",
        "bom-ref": purl,
        "name": "pubsub-sidecar",
        "version": version,
        "purl": purl,
        "hashes": [{"alg": "SHA-256", "content": hexdigest}],
        "properties": properties,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python-sbom", type=Path, required=True)
    parser.add_argument("--debs", type=Path, required=True)
    parser.add_argument("--layout", type=Path, required=True)
    parser.add_argument("--digest", required=True)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()

    bom: dict[str, Any] = json.loads(args.python_sbom.read_text())
    debian = deb_components(args.debs)
    image = image_component(args.layout, args.digest)
    metadata = bom.setdefault("metadata", {})
    metadata.pop("timestamp", None)
    bom.pop("serialNumber", None)
    metadata["component"] = image
    bom["components"] = bom.get("components", []) + debian
    python_refs = [c["bom-ref"] for c in bom["components"] if c not in debian]
    bom.setdefault("dependencies", []).append(
        {"ref": image["bom-ref"], "dependsOn": sorted(python_refs + [c["bom-ref"] for c in debian])}
    )
    bom["dependencies"] += [{"ref": c["bom-ref"]} for c in debian]
    args.output.write_text(json.dumps(bom, indent=2, sort_keys=True) + "\n")
    print(f"sbom: {args.output}: {len(python_refs)} Python and {len(debian)} Debian packages")


if __name__ == "__main__":
    main()
