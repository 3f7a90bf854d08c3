#!/usr/bin/env bash
# Runs a command inside a root filesystem from containers/build_rootfs.sh the way
# `apptainer exec --bind ... IMAGE CMD` runs it in the image:
#
#   containers/run_in_rootfs.sh ROOTFS [OPTIONS] -- CMD [ARG]...
#     --bind SRC[:DST[:ro]]   bind a host path (repeatable; DST defaults to SRC)
#     --home DIR              bind DIR and make it $HOME (default: the host $HOME, as Apptainer)
#     --no-home               bind no home; HOME=/root
#     --cleanenv              start from an empty environment, as `apptainer exec --cleanenv`
#
# Like Apptainer: /proc, /sys, /dev, /tmp, /var/tmp, /etc/resolv.conf, /etc/hosts, $HOME and
# the working directory are bound at their host paths, the command starts in the working
# directory, the host environment passes through (PATH reset to the image's) and
# /.singularity.d/env/*.sh (the def's %environment) is sourced over it.
# It runs in a private user and mount namespace (`unshare --user --map-root-user --mount`):
# no root needed, and every bind vanishes with the command. Where unprivileged user
# namespaces are refused, root falls back to a private mount namespace and plain chroot.
set -euo pipefail

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[[ $# -ge 3 ]] || usage
ROOTFS=$(realpath "$1")
shift
[[ -x $ROOTFS/bin/sh ]] || { echo "$0: $ROOTFS is not a root filesystem" >&2; exit 2; }

BINDS=()
HOME_DIR=${HOME:-}
CLEANENV=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --bind) BINDS+=("$2"); shift 2 ;;
        --bind=*) BINDS+=("${1#--bind=}"); shift ;;
        --home) HOME_DIR=$(realpath "$2"); shift 2 ;;
        --no-home) HOME_DIR=; shift ;;
        --cleanenv) CLEANENV=1; shift ;;
        --) shift; break ;;
        *) usage ;;
    esac
done
[[ $# -ge 1 ]] || usage

# Outside the namespace: enter it, with this script again as its first process.
if [[ -z ${ALIGN_RIR_NS:-} ]]; then
    args=("$ROOTFS")
    for b in "${BINDS[@]}"; do args+=(--bind "$b"); done
    if [[ -n $HOME_DIR ]]; then args+=(--home "$HOME_DIR"); else args+=(--no-home); fi
    ((CLEANENV)) && args+=(--cleanenv)
    args+=(-- "$@")
    if unshare --user --map-root-user --mount true 2>/dev/null; then
        ALIGN_RIR_NS=user exec unshare --user --map-root-user --mount --propagation private \
            -- bash "$0" "${args[@]}"
    elif [[ $(id -u) -eq 0 ]]; then
        echo "$0: unprivileged user namespaces refused here; chroot as root instead" >&2
        ALIGN_RIR_NS=root exec unshare --mount --propagation private -- bash "$0" "${args[@]}"
    else
        echo "$0: needs unprivileged user namespaces (or root)" >&2
        exit 1
    fi
fi

# Inside: a private mount namespace, so nothing below needs undoing.
bind() { # SRC DST [ro]
    local src=$1 dst=$ROOTFS$2
    if [[ -d $src ]]; then
        mkdir -p "$dst"
    else
        mkdir -p "$(dirname "$dst")" && { [[ -e $dst ]] || : >"$dst"; }
    fi
    mount --rbind "$src" "$dst"
    if [[ ${3:-} == ro ]]; then mount -o remount,bind,ro "$dst"; fi
}
# /var/tmp and /tmp first: the root filesystem may lie under one, and a later bind into it
# would otherwise be copied along.
bind /var/tmp /var/tmp
bind /tmp /tmp
bind /proc /proc
bind /sys /sys
bind /dev /dev
for f in /etc/resolv.conf /etc/hosts; do [[ -e $f ]] && bind "$(realpath "$f")" "$f"; done
[[ -n $HOME_DIR && -d $HOME_DIR ]] && bind "$HOME_DIR" "$HOME_DIR"
WORKDIR=$(pwd -P)
[[ $WORKDIR == / ]] || bind "$WORKDIR" "$WORKDIR"
for b in "${BINDS[@]}"; do
    IFS=: read -r src dst mode <<<"$b"
    src=$(realpath "$src")
    bind "$src" "${dst:-$src}" "${mode:-}"
done

IMAGE_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
if ((CLEANENV)); then
    env_cmd=(env -i "PATH=$IMAGE_PATH" "LANG=${LANG:-C.UTF-8}" "TERM=${TERM:-dumb}")
else
    # The host's PATH and library path name host directories; the image has its own.
    env_cmd=(env -u LD_LIBRARY_PATH -u ALIGN_RIR_NS "PATH=$IMAGE_PATH")
fi
env_cmd+=("HOME=${HOME_DIR:-/root}")

# The working directory goes as an argument: a starting shell resets $PWD to its real cwd
# (chroot leaves it at /).
# shellcheck disable=SC2016  # expanded by the shell inside the root filesystem
exec "${env_cmd[@]}" chroot "$ROOTFS" /bin/sh -c '
    for f in /.singularity.d/env/*.sh; do [ -r "$f" ] && . "$f"; done
    cd "$1" && shift && exec "$@"' sh "$WORKDIR" "$@"
