#!/usr/bin/env bash
# Builds the image's root filesystem without Apptainer, from the def's own recipe: debootstrap
# the def's OSVersion from its MirrorURL, copy its %files, write its %environment, %test and
# %runscript where Apptainer puts them (/.singularity.d), and run containers/post.sh by chroot.
# CI runs what it builds with containers/run_in_rootfs.sh.
#
#   containers/build_rootfs.sh DEST
#
# Root only (debootstrap, chroot, mounts). Environment:
#   ALIGN_TORCH=cpu|cuda   torch's build (default cpu: CI has no GPU, and cpu comes from local disk)
#   ALIGN_ROOTFS_CACHE     where the debootstrapped bases are kept (default DEST.cache)
#   ALIGN_BUILD_BINDS      host directories the chroot's pip reads, bound read-only at the
#                          same path (default: this host's /opt/wheels /opt/pypi /opt/pypi-more)
# DEST is rebuilt only when its stamp's key changes: post.sh, pyproject.toml, align.def, the
# content of every %files source (the image installs a copy of align/), ALIGN_TORCH and the
# base. The base is a tarball keyed by suite, mirror and packages, so a new pin does not
# debootstrap again. When only the package's sources changed, post.sh runs again over the
# built tree, whose requirements are then all met: the project alone is reinstalled.
set -euo pipefail

usage() { echo "usage: $0 DEST" >&2; exit 2; }
[[ $# -eq 1 ]] || usage

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEF=$REPO/containers/align.def
POST=$REPO/containers/post.sh
DEST=$(realpath -m "$1")
TMP=$DEST.tmp
CACHE=${ALIGN_ROOTFS_CACHE:-$DEST.cache}
export ALIGN_TORCH=${ALIGN_TORCH:-cpu}
[[ $ALIGN_TORCH == cpu || $ALIGN_TORCH == cuda ]] ||
    { echo "$0: ALIGN_TORCH must be cpu or cuda, not '$ALIGN_TORCH'" >&2; exit 2; }
BUILD_BINDS=${ALIGN_BUILD_BINDS-/opt/wheels /opt/pypi /opt/pypi-more}
STAMP=.align-rootfs-stamp

log() { printf '[build_rootfs %(%T)T] %s\n' -1 "$*" >&2; }

# A definition file's header keyword, and a %section's body (indentation as written).
header() { sed -n "s/^$1:[[:space:]]*//p" "$DEF" | head -n1; }
section() { awk -v s="%$1" '/^%[A-Za-z]+[ \t]*$/ { on = ($1 == s); next } on' "$DEF"; }
# %files entries: "SRC DST" relative to the repository root (Apptainer builds from there).
files_entries() { section files | sed -e 's/#.*//' -e 's/^[[:space:]]*//' -e '/^$/d'; }

SUITE=$(header OSVersion)
MIRROR=$(header MirrorURL)
[[ $(header Bootstrap) == debootstrap && -n $SUITE && -n $MIRROR ]] ||
    { echo "$0: $DEF is not a debootstrap definition with OSVersion and MirrorURL" >&2; exit 1; }
# The packages post.sh installs, taken from its own line, so the cached base already has them
# and a rebuild's apt-get install finds nothing to do.
PACKAGES=$(sed -n 's/^packages="\(.*\)"$/\1/p' "$POST")
[[ -n $PACKAGES ]] || { echo "$0: no packages=\"...\" line in $POST" >&2; exit 1; }
ARCH=$(dpkg --print-architecture)

sha() { sha256sum | cut -c1-64; }
BASE_KEY=$(printf '%s\n' "$SUITE" "$MIRROR" minbase "$ARCH" "$PACKAGES" | sha)
BASE_TAR=$CACHE/base-$SUITE-$ARCH-${BASE_KEY:0:16}.tar
files_digest() {
    local src dst
    (cd "$REPO" && files_entries | while read -r src dst; do
        find "$src" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z |
            xargs -0 sha256sum
    done) | sha
}
# Everything that decides the installed requirements, then that and the sources.
DEPS_KEY=$({ cat "$POST" "$REPO/pyproject.toml" "$DEF"; echo "$ALIGN_TORCH $BASE_KEY"; } | sha)
KEY=$({ echo "$DEPS_KEY"; files_digest; } | sha)
DEPS_STAMP=.align-rootfs-requirements

if [[ -f $DEST/$STAMP && $(<"$DEST/$STAMP") == "$KEY" ]]; then
    log "$DEST is up to date (key ${KEY:0:16})"
    exit 0
fi

[[ $(id -u) -eq 0 ]] || { echo "$0: needs root (debootstrap, chroot, mounts)" >&2; exit 1; }
# Everything below mounts: do it in a mount namespace of its own, so that however this script
# ends (even by SIGKILL) no bind outlives it; the trap unmounts on an ordinary exit as well.
if [[ -z ${ALIGN_BUILD_ROOTFS_NS:-} ]]; then
    ALIGN_BUILD_ROOTFS_NS=1 exec unshare --mount --propagation private -- bash "$0" "$@"
fi

mkdir -p "$CACHE" "$(dirname "$DEST")"
# One build per DEST at a time.
exec 9>"$DEST.lock"
flock 9

MOUNTS=()
unmount_all() {
    local i
    for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
        umount -R "${MOUNTS[i]}" 2>/dev/null || umount -lR "${MOUNTS[i]}" || true
    done
    MOUNTS=()
}
trap unmount_all EXIT
# Refuse to delete a tree that still has something mounted inside it (a bound /dev or wheel
# directory would be deleted with it).
mounted_under() { awk -v d="$1" '$5 == d || index($5, d "/") == 1 { print $5 }' /proc/self/mountinfo; }
remove_tree() {
    [[ -e $1 ]] || return 0
    if [[ -n $(mounted_under "$1") ]]; then
        echo "$0: refusing to delete $1: mounts remain under it:" >&2
        mounted_under "$1" >&2
        exit 1
    fi
    rm -rf --one-file-system "$1"
}

bind() { # SRC DST [ro]: SRC at DST, an absolute path on the host
    mkdir -p "$2"
    mount --rbind "$1" "$2"
    MOUNTS+=("$2")
    if [[ ${3:-} == ro ]]; then mount -o remount,bind,ro "$2"; fi
}
# What a chroot of the tree ROOT sees of the host: processes, devices, name resolution.
enter_host() {
    mount -t proc proc "$1/proc"
    MOUNTS+=("$1/proc")
    bind /dev "$1/dev"
    cp -L /etc/resolv.conf "$1/etc/resolv.conf"
}
in_chroot() { # ROOT CMD...: a clean environment plus the ENV_ARGS given
    local root=$1
    shift
    env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
        LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "${ENV_ARGS[@]}" chroot "$root" "$@"
}
ENV_ARGS=()

if [[ ! -f $BASE_TAR ]]; then
    # The base: minbase, then post.sh's packages by apt (debootstrap's --include resolves no
    # virtual packages: python3.11-venv's python3.11-distutils), so a rebuild's apt-get install
    # in post.sh finds them installed.
    log "debootstrap $SUITE ($ARCH, minbase) from $MIRROR, then apt-get install $PACKAGES"
    remove_tree "$BASE_TAR.d"
    debootstrap --variant=minbase --arch="$ARCH" --include=apt \
        "$SUITE" "$BASE_TAR.d" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 ||
        { tail -n 30 "$CACHE/debootstrap.log" >&2; exit 1; }
    enter_host "$BASE_TAR.d"
    # shellcheck disable=SC2086  # one word per package
    { in_chroot "$BASE_TAR.d" apt-get update &&
        in_chroot "$BASE_TAR.d" apt-get install -y --no-install-recommends $PACKAGES &&
        in_chroot "$BASE_TAR.d" apt-get clean; } >>"$CACHE/debootstrap.log" 2>&1 ||
        { tail -n 30 "$CACHE/debootstrap.log" >&2; exit 1; }
    unmount_all
    rm -rf "$BASE_TAR.d"/var/lib/apt/lists/*
    tar -C "$BASE_TAR.d" --numeric-owner --xattrs -cf "$BASE_TAR.part" .
    mv "$BASE_TAR.part" "$BASE_TAR"
    remove_tree "$BASE_TAR.d"
fi

remove_tree "$TMP"
if [[ -f $DEST/$DEPS_STAMP && $(<"$DEST/$DEPS_STAMP") == "$DEPS_KEY" ]]; then
    log "reusing $DEST's requirements (key ${DEPS_KEY:0:16}); reinstalling the project"
    mv "$DEST" "$TMP"
    rm -rf "$TMP/opt/align/src" "$TMP/$STAMP"
else
    log "unpacking $(basename "$BASE_TAR") into $TMP"
    mkdir -p "$TMP"
    tar -C "$TMP" --numeric-owner --xattrs -xpf "$BASE_TAR"
fi

# %files, as `apptainer build` copies them from the repository root.
(cd "$REPO" && files_entries | while read -r src dst; do
    mkdir -p "$TMP$(dirname "$dst")"
    cp -a "$src" "$TMP$dst"
done)
find "$TMP/opt/align" -name __pycache__ -prune -exec rm -rf {} +

# Where Apptainer keeps a built image's environment, test and runscript.
mkdir -p "$TMP/.singularity.d/env"
{ echo '#!/bin/sh'; section environment; } >"$TMP/.singularity.d/env/90-environment.sh"
{ echo '#!/bin/sh'; section test; } >"$TMP/.singularity.d/test"
{ echo '#!/bin/sh'; section runscript; } >"$TMP/.singularity.d/runscript"
chmod 755 "$TMP/.singularity.d/env/90-environment.sh" "$TMP/.singularity.d/test" "$TMP/.singularity.d/runscript"
section labels | python3 -c '
import json, sys
print(json.dumps(dict(l.split(None, 1) for l in sys.stdin.read().split("\n") if l.strip()), indent=2))
' >"$TMP/.singularity.d/labels.json"

# Build-time only: the host's CA bundle (an egress proxy's CA included) and, for the CPU
# build, its pip configuration, so the chroot's pip reads the same indexes the host's does.
# A cuda build reads the default index only, as `apptainer build` does.
STAGED=()
[[ $ALIGN_TORCH == cpu ]] || BUILD_BINDS=
for f in /etc/pip.conf /etc/xdg/pip; do
    [[ -e $f && $ALIGN_TORCH == cpu ]] || continue
    mkdir -p "$TMP$(dirname "$f")"
    cp -a "$f" "$TMP$f"
    STAGED+=("$f")
done
mkdir -p "$TMP/etc/align-build"
cp -L /etc/ssl/certs/ca-certificates.crt "$TMP/etc/align-build/ca-certificates.crt"
STAGED+=(/etc/align-build)

enter_host "$TMP"
for d in $BUILD_BINDS; do
    if [[ -d $d ]]; then bind "$d" "$TMP$d" ro; fi
done

# The recipe's inputs, and the host's PIP_* settings with its CA bundle.
ENV_ARGS=(ALIGN_TORCH="$ALIGN_TORCH")
while IFS='=' read -r name _; do
    if [[ $name == PIP_* && $ALIGN_TORCH == cpu ]]; then ENV_ARGS+=("$name=${!name}"); fi
done < <(env)
ENV_ARGS+=(PIP_CERT=/etc/align-build/ca-certificates.crt)

log "running post.sh in the chroot (ALIGN_TORCH=$ALIGN_TORCH)"
if ! in_chroot "$TMP" /bin/sh -eu /opt/align/post.sh >"$CACHE/post.log" 2>&1; then
    tail -n 40 "$CACHE/post.log" >&2
    echo "$0: post.sh failed (whole log: $CACHE/post.log)" >&2
    exit 1
fi
tail -n 2 "$CACHE/post.log" | sed 's/^/  | /' >&2

unmount_all
for f in "${STAGED[@]}"; do rm -rf "${TMP:?}$f"; done
echo "$DEPS_KEY" >"$TMP/$DEPS_STAMP"
echo "$KEY" >"$TMP/$STAMP"

# Swap the finished tree in; an older one is deleted only once nothing is mounted in it.
if [[ -e $DEST ]]; then
    remove_tree "$DEST.old"
    mv "$DEST" "$DEST.old"
fi
mv "$TMP" "$DEST"
remove_tree "$DEST.old"
log "built $DEST (key ${KEY:0:16})"
