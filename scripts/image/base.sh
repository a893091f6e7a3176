#!/usr/bin/env bash
# The image's base root filesystem, as a tar: Debian bookworm's Python 3.11 and libraries, plus the
# locked dependencies in /opt/pubsub-sidecar. Called by build.sh, which caches the result under
# build/image/cache keyed by everything it is made of (this script too).
#
#   base.sh DEBS_DIR WHEELS_DIR TOOLS_DIR OUT_TAR
#
# - The packages are unpacked with dpkg-deb (no maintainer scripts run: none of them matters to a
#   Python process) and recorded in /var/lib/dpkg/status, so scanners see Debian 12's packages.
# - /usr/share/doc keeps only the copyright files; manuals, locales, lintian files, glibc's iconv
#   modules and CPython's test modules go.
# - The virtualenv is made by the image's own python3.11 (chrooted), and the wheels are installed by
#   pip run from its wheel (TOOLS_DIR), so pip never lands in the image; only binary wheels, only
#   the locked hashes. .pyc files (the standard library's too) are hash-based, with no timestamp.
# - uid/gid 10001 `sidecar` exists in /etc/passwd and /etc/group, the user the manifests run as.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/image/lib.sh
. "$here/lib.sh"
debs=$1 wheels=$2 tools=$3 out=$4
rootfs="$out.rootfs"
rm -rf "$rootfs"
mkdir -p "$rootfs"

log "base: unpacking $(find "$debs" -name "*.deb" | wc -l) Debian packages"
mkdir -p "$rootfs/var/lib/dpkg"
for deb in "$debs"/*.deb; do
  dpkg-deb --extract "$deb" "$rootfs"
  dpkg-deb --field "$deb" | awk '{ print } /^Package:/ { print "Status: install ok installed" }'
  echo
done >"$rootfs/var/lib/dpkg/status"

find "$rootfs/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
rm -rf "$rootfs"/usr/share/{man,info,locale,lintian,gdb,gcc} "$rootfs"/usr/lib/python3.11/pydoc_data
# glibc's iconv converters (Python has its own codecs) and CPython's own test modules.
rm -rf "$rootfs/usr/lib/x86_64-linux-gnu/gconv" "$rootfs/usr/lib/python3.11/test" \
  "$rootfs"/usr/lib/python3.11/lib-dynload/{_ctypes_test,_test,_xxtestfuzz,xxlimited}*.so
mkdir -p "$rootfs"/{proc,dev,sys,tmp,etc/pubsub-sidecar}
chmod 1777 "$rootfs/tmp"
printf '%s\n' 'root:x:0:0:root:/root:/usr/sbin/nologin' \
  'sidecar:x:10001:10001:pubsub-sidecar:/nonexistent:/usr/sbin/nologin' >"$rootfs/etc/passwd"
printf '%s\n' 'root:x:0:' 'sidecar:x:10001:' >"$rootfs/etc/group"
printf '%s\n' 'passwd: files' 'group: files' 'hosts: files dns' >"$rootfs/etc/nsswitch.conf"

pip=(/build/tools/"$(cd "$tools" && ls pip-*.whl)"/pip)
log "base: the virtualenv and $(grep -c '^[^#]' "$here/requirements.txt") locked packages"
in_root "$rootfs" -- /usr/bin/python3.11 -m venv --without-pip "$VENV_IN_IMAGE"
in_root "$rootfs" --bind "$wheels:/build/wheels" --bind "$tools:/build/tools" --bind "$here:/build/image" -- \
  "$VENV_IN_IMAGE/bin/python" "${pip[@]}" install --quiet --no-cache-dir --disable-pip-version-check \
  --no-index --find-links /build/wheels --only-binary :all: --require-hashes --no-deps \
  --requirement /build/image/requirements.txt
in_root "$rootfs" -- /usr/bin/python3.11 -m compileall -q -j 0 --invalidation-mode checked-hash /usr/lib/python3.11
in_root "$rootfs" --bind "$here:/build/image" -- /usr/bin/python3.11 -I /build/image/elf_check.py /
find "$rootfs/tmp" -mindepth 1 -delete

deterministic_tar "$rootfs" "$out.tmp"
mv "$out.tmp" "$out"
rm -rf "$rootfs"
log "base: $(du -h "$out" | cut -f1) ($out)"
