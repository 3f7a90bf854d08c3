#!/usr/bin/env bash
# Stands in for `apptainer` where Apptainer cannot be installed (CI): put it on PATH as
# `apptainer`, and `apptainer exec [OPTIONS] ROOTFS CMD...` runs CMD in a root filesystem
# from containers/build_rootfs.sh (a directory, as Apptainer's sandbox images are) through
# containers/run_in_rootfs.sh. It takes what Snakemake's --software-deployment-method
# apptainer passes: --home, --bind/-B, --pwd, --nv (no GPU here: ignored), --cleanenv/-e,
# --quiet/--silent, and APPTAINERENV_*/SINGULARITYENV_* variables.
set -euo pipefail
HERE=$(cd "$(dirname "$(realpath "${BASH_SOURCE[0]}")")" && pwd)

# Snakemake reads the version (it wants >= 1.0.0); it parses the leading version.
if [[ ${1:-} == --version || ${1:-} == version ]]; then
    echo "apptainer version 1.3.6-align-rootfs-shim"
    exit 0
fi
while [[ ${1:-} == --quiet || ${1:-} == --silent || ${1:-} == -q || ${1:-} == -s ]]; do shift; done
[[ ${1:-} == exec ]] || { echo "apptainer shim: only 'exec' is stood in for, not: $*" >&2; exit 2; }
shift

opts=()
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in
        --home) opts+=(--home "$2"); shift 2 ;;
        --bind | -B)
            IFS=, read -ra specs <<<"$2"
            for s in "${specs[@]}"; do opts+=(--bind "$s"); done
            shift 2 ;;
        --pwd) cd "$2"; shift 2 ;;
        --cleanenv | -e) opts+=(--cleanenv); shift ;;
        --nv | --nvccli | --rocm | --writable-tmpfs | --no-eval) shift ;;
        *) echo "apptainer shim: option not stood in for: $1" >&2; exit 2 ;;
    esac
done
[[ $# -ge 2 ]] || { echo "apptainer shim: exec needs an image and a command" >&2; exit 2; }
image=$1
shift
[[ -d $image ]] || { echo "apptainer shim: $image is not a root filesystem directory" >&2; exit 2; }

# APPTAINERENV_FOO=x sets FOO=x inside.
while IFS='=' read -r name _; do
    case $name in
        APPTAINERENV_* | SINGULARITYENV_*) export "${name#*ENV_}=${!name}"; unset "$name" ;;
    esac
done < <(env)

exec "$HERE/run_in_rootfs.sh" "$image" "${opts[@]}" -- "$@"
