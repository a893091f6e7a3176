# shellcheck shell=bash disable=SC2016,SC2034
# Shared by scripts/image/base.sh and build.sh (sourced, not run).

# Every timestamp in the image, and SOURCE_DATE_EPOCH for the tools that read it (pip's .pyc files
# are then hash-based, with no time in them): 1980-01-01, the earliest a zip file holds.
EPOCH=315532800
export SOURCE_DATE_EPOCH=$EPOCH
VENV_IN_IMAGE=/opt/pubsub-sidecar

log() { printf "image: [%3ds] %s\n" "$SECONDS" "$*" >&2; }
die() { log "$*"; exit 1; }

# in_root ROOTFS [--bind HOST_DIR:PATH_IN_ROOTFS]... -- COMMAND...
# Runs COMMAND (a path inside ROOTFS) chrooted into ROOTFS with /dev and /proc mounted and the given
# host folders bound read-only, in a mount namespace of its own: every mount ends with the command,
# none is left behind whatever happens. The environment is emptied but for PATH, HOME and
# SOURCE_DATE_EPOCH. The mount points the binds need are made and removed here.
in_root() {
  local rootfs=$1 binds=() made=() spec dst status=0
  shift
  while [ "$1" = --bind ]; do binds+=("$2"); shift 2; done
  [ "$1" = -- ] && shift
  for spec in "${binds[@]}"; do
    dst=$rootfs${spec#*:}
    if [ ! -e "$dst" ]; then mkdir -p "$dst"; made+=("$dst"); fi
  done
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp SOURCE_DATE_EPOCH="$EPOCH" \
    unshare --mount --propagation private -- /bin/sh -ec '
      rootfs=$1; nbinds=$2; shift 2
      while [ "$nbinds" -gt 0 ]; do
        src=${1%%:*}; dst=$rootfs${1#*:}; shift; nbinds=$((nbinds - 1))
        mount --bind "$src" "$dst"; mount -o remount,bind,ro "$dst"
      done
      mount --rbind /dev "$rootfs/dev"
      mount -t proc proc "$rootfs/proc"
      exec chroot "$rootfs" "$@"' sh "$rootfs" "${#binds[@]}" "${binds[@]}" "$@" || status=$?
  for dst in "${made[@]}"; do rmdir "$dst"; done
  return "$status"
}

# Deterministic tar of a folder's content: sorted, one time, numeric root ownership kept as is.
deterministic_tar() {
  tar --create --file "$2" --directory "$1" --sort=name --format=pax --numeric-owner \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime --mtime="@$EPOCH" .
}
