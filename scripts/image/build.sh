#!/usr/bin/env bash
# `make image`: build the pubsub-sidecar container image with buildah, from Debian bookworm's
# packages and the locked wheels (no base image is pulled, no daemon runs), smoke-test what was
# built, and write the SBOM and the digest beside it. docs/image.md says what and why.
#
# Outputs (build/image/):
#   oci/             the image as an OCI layout (gzip layer): what `skopeo copy --preserve-digests`
#                    pushes unchanged, so the registry's digest is the one written here
#   digest           that manifest digest (sha256:...); k8s/overlays/example pins it
#   sbom.cdx.json    CycloneDX SBOM: the virtualenv's packages and the Debian packages
#   smoke.log        the sidecar's and the emulators' output in the last smoke test
#   cache/           Debian packages, wheels and the base root filesystem, keyed by what they are
#                    made of, so a second build redoes only the project's own layer of work
# and the image itself in the local container storage as localhost/pubsub-sidecar:VERSION.
#
# The project's files come from the working tree (as `docker build .` takes them), or from a commit
# with IMAGE_SOURCE=REV (`make image IMAGE_SOURCE=HEAD`): the digest to commit is then the image of
# that commit's files, which committing the digest does not change.
#
# Needs root (chroot, mounts in a private mount namespace), podman, buildah, apt-get, dpkg-deb and
# the project's .venv (the smoke test runs the emulators and the client from there).
set -euo pipefail
cd "$(dirname "$0")/../.."
here=scripts/image
# shellcheck source=scripts/image/lib.sh
. "$here/lib.sh"
py=${PYTHON:-.venv/bin/python}
out=build/image
cache=$out/cache
work=$out/work

[ "$(id -u)" = 0 ] || die "make image needs root: chroot and mount build and smoke-test the root filesystem"
for tool in podman buildah apt-get apt-cache dpkg-deb unshare chroot tar; do
  command -v "$tool" >/dev/null || die "'$tool' is missing (make image installs podman and buildah with apt-get)"
done
# The packages come from the host's apt sources: they must be Debian 12's (the SBOM says debian-12).
# shellcheck source=/dev/null
os_id=$(. /etc/os-release && echo "${ID:-}-${VERSION_ID:-}")
[ "$os_id" = debian-12 ] || die "make image takes the image's packages from the host's apt: run it on Debian 12 (bookworm), not $os_id"
version=$("$py" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
image=localhost/pubsub-sidecar:$version
mkdir -p "$cache" "$work"

# 1. Debian packages: the current version of each, downloaded once per set of versions.
mapfile -t packages < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$here/debian-packages.txt")
resolve() { apt-cache show --no-all-versions "${packages[@]}" 2>/dev/null | awk '/^Package:/ { p = $2 } /^Version:/ { print p "=" $2 }' | sort; }
resolved=$(resolve) || true
if [ "$(printf '%s\n' "$resolved" | grep -c =)" != "${#packages[@]}" ]; then
  log "apt-get update (the package lists lack some of: ${packages[*]})"
  apt-get update -qq
  resolved=$(resolve)
fi
[ "$(printf '%s\n' "$resolved" | grep -c =)" = "${#packages[@]}" ] || die "apt-cache does not know all of: ${packages[*]}"
debs=$cache/debs-$(printf '%s\n' "$resolved" | sha256sum | cut -c1-16)
if [ ! -d "$debs" ]; then
  log "downloading ${#packages[@]} Debian packages"
  rm -rf "$debs.tmp" && mkdir -p "$debs.tmp"
  # shellcheck disable=SC2046
  (cd "$debs.tmp" && apt-get download -qq -o APT::Sandbox::User=root $(printf '%s\n' "$resolved"))
  mv "$debs.tmp" "$debs"
fi

# 2. Wheels, by hash: the image's dependencies and the build's tools (pip, cyclonedx-bom).
fetch_wheels() { # REQUIREMENTS DIR
  local stamp
  stamp=$2/.$(sha256sum "$1" | cut -c1-16)
  [ -e "$stamp" ] && return
  log "downloading the wheels of $1"
  "$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary :all: --require-hashes \
    --requirement "$1" --dest "$2" 2> >(grep -v "^WARNING: Location" >&2)
  touch "$stamp"
}
fetch_wheels "$here/requirements.txt" "$cache/wheels"
fetch_wheels "$here/build-requirements.txt" "$cache/tools"
if [ ! -d "$cache/sbom-tool" ] || [ ! -e "$cache/sbom-tool/.$(sha256sum "$here/build-requirements.txt" | cut -c1-16)" ]; then
  rm -rf "$cache/sbom-tool"
  "$py" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$cache/tools" --no-deps \
    --only-binary :all: --require-hashes --requirement "$here/build-requirements.txt" --target "$cache/sbom-tool"
  touch "$cache/sbom-tool/.$(sha256sum "$here/build-requirements.txt" | cut -c1-16)"
fi

# 3. The base root filesystem (Debian + locked dependencies), cached by what it is made of.
base_key=$( (printf '%s\n' "$resolved"; cat "$here/requirements.txt" "$here/build-requirements.txt" \
  "$here/base.sh" "$here/lib.sh" "$here/elf_check.py") | sha256sum | cut -c1-16)
base=$cache/base-$base_key.tar
if [ ! -e "$base" ]; then
  log "building the base root filesystem ($base)"
  "$here/base.sh" "$debs" "$cache/wheels" "$cache/tools" "$base"
fi

# 4. The project: its two distributions, built from a copy of what the Dockerfile copies.
rm -rf "$work" && mkdir -p "$work/src" "$work/project-wheels" "$work/context" "$work/rootfs"
sources=(pyproject.toml README.md sidecar bench clients/python)
if [ -n "${IMAGE_SOURCE:-}" ]; then
  log "the project's files from $IMAGE_SOURCE ($(git rev-parse --short "$IMAGE_SOURCE^{commit}"))"
  git archive --format=tar "$IMAGE_SOURCE" -- "${sources[@]}" | tar --extract --directory "$work/src"
else
  tar --create --exclude=__pycache__ --exclude='*.egg-info' --exclude=build --exclude=node_modules \
    "${sources[@]}" | tar --extract --directory "$work/src"
  changed=$(git status --porcelain -- "${sources[@]}" 2>/dev/null | wc -l)
  if [ "$changed" != 0 ]; then
    log "the project's files from the working tree: $changed differ from HEAD (IMAGE_SOURCE=HEAD builds HEAD's)"
  fi
fi
# One set of modes whatever the umask of the checkout or of git archive (644, 755 where executable):
# the modes go into the wheels, whose hashes go into the image.
chmod -R u=rwX,go=rX "$work/src"
"$py" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
  --wheel-dir "$work/project-wheels" "$work/src/clients/python" "$work/src" 2> >(grep -v "^WARNING: Location" >&2)
tar --extract --file "$base" --directory "$work/rootfs" --numeric-owner
log "the project's wheels, installed into the base"
pip=(/build/tools/"$(cd "$cache/tools" && ls pip-*.whl)"/pip)
in_root "$work/rootfs" --bind "$work/project-wheels:/build/wheels" --bind "$cache/tools:/build/tools" -- \
  "$VENV_IN_IMAGE/bin/python" "${pip[@]}" install --quiet --no-cache-dir --disable-pip-version-check \
  --no-index --no-deps /build/wheels/pubsub_sidecar_client-"$version"-py3-none-any.whl \
  /build/wheels/pubsub_sidecar-"$version"-py3-none-any.whl
in_root "$work/rootfs" -- "$VENV_IN_IMAGE/bin/pubsub-sidecar" --help >/dev/null

log "the SBOM of the virtualenv"
# 5. The SBOM of the virtualenv, by cyclonedx-py run by the image's Python (from a folder mounted
#    only for it, so the environment it reads is exactly the image's).
in_root "$work/rootfs" --bind "$cache/sbom-tool:/build/sbom-tool" -- "$VENV_IN_IMAGE/bin/python" -c \
  'import sys; sys.path.insert(0, "/build/sbom-tool"); sys.argv[0] = "cyclonedx-py"
from cyclonedx_py._internal.cli import run; run(prog="cyclonedx-py")' \
  environment --output-format JSON --output-reproducible --output-file - "$VENV_IN_IMAGE/bin/python" \
  >"$work/sbom-python.json"
find "$work/rootfs/tmp" -mindepth 1 -delete

# 6. The image: one layer, the deterministic tar; every timestamp is EPOCH.
deterministic_tar "$work/rootfs" "$work/context/rootfs.tar"
cp "$here/Containerfile" "$work/context/Containerfile"
previous=$(podman image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)
log "buildah build $image"
buildah build --quiet --timestamp "$EPOCH" --layers=false --file "$work/context/Containerfile" \
  --tag "$image" "$work/context" >/dev/null
current=$(podman image inspect --format '{{.Id}}' "$image")
if [ -n "$previous" ] && [ "$previous" != "$current" ]; then podman rmi "$previous" >/dev/null 2>&1 || true; fi
rm -rf "$out/oci"
log "buildah push to the OCI layout $out/oci"
buildah push --quiet --format oci --compression-format gzip "$image" "oci:$out/oci:pubsub-sidecar:$version"
digest=$("$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["manifests"][0]["digest"])' "$out/oci/index.json")

# 7. Smoke test of the OCI layout just written (its layer, its config), then the outputs.
log "smoke test"
"$py" "$here/smoke_test.py" --layout "$out/oci" --work "$work/smoke" --log "$out/smoke.log"
"$py" "$here/sbom.py" --python-sbom "$work/sbom-python.json" --debs "$debs" --layout "$out/oci" \
  --digest "$digest" --output "$out/sbom.cdx.json"
echo "$digest" >"$out/digest"
"$py" "$here/pin_digest.py" "$digest"
size=$(podman images --format '{{.Size}}' "$image")
rm -rf "$work"
log "built $image"
log "digest $digest (build/image/digest; k8s/overlays/example pins it)"
log "size $size uncompressed, $(( $(du -sb "$out/oci/blobs" | cut -f1) / 1000000 )) MB compressed (OCI layout)"
log "done"
