#!/bin/sh
# The image's one build recipe: containers/align.def's %post runs it inside `apptainer build`,
# and CI runs it by chroot in a debootstrapped bookworm (containers/build_rootfs.sh), so the two
# root filesystems come from the same lines. It expects the def's %files under /opt/align.
#
# ALIGN_TORCH picks torch's build:
#   cuda (default): the default index's Linux wheel of the pinned torch, the CUDA build that
#     brings its own CUDA libraries and the Triton it declares (clusters).
#   cpu: the CPU build, installed first so the project's install keeps it; the pip
#     configuration in effect must offer it (CI: this host's local wheels and indexes).
set -eu
export DEBIAN_FRONTEND=noninteractive

torch_build=${ALIGN_TORCH:-cuda}
case $torch_build in
    cuda | cpu) ;;
    *) echo "post.sh: ALIGN_TORCH must be cuda or cpu, not '$torch_build'" >&2; exit 2 ;;
esac

# Python 3.11 and its headers: Triton compiles its launcher against them at run time.
# build_rootfs.sh reads this line for debootstrap --include, so its cached base already holds them.
packages="python3.11 python3.11-venv python3.11-dev build-essential ca-certificates"
apt-get update
# shellcheck disable=SC2086  # one word per package
apt-get install -y --no-install-recommends $packages
# The package lists and downloaded .debs are only needed to install; the image stays smaller.
apt-get clean
rm -rf /var/lib/apt/lists/*

python3.11 -m venv /opt/align/venv
python=/opt/align/venv/bin/python
pip=/opt/align/venv/bin/pip
$pip install --no-cache-dir --upgrade pip

if [ "$torch_build" = cpu ]; then
    # pyproject's own torch requirement, read rather than repeated here, so the image can never
    # pin a torch other than the one the project names.
    torch_requirement=$($python -c '
import tomllib
deps = tomllib.load(open("/opt/align/src/pyproject.toml", "rb"))["project"]["dependencies"]
print(next(d for d in deps if d.replace(" ", "").lower().startswith("torch=")))')
    # A local build (2.13.0+cpu) satisfies the pin and sorts above the plain release, so pip
    # takes it wherever the configured indexes offer it.
    $pip install --no-cache-dir "$torch_requirement"
fi

# The project with its cluster extra: exactly the set `pip install -e '.[cluster]'` gives
# outside the image. An installed torch that satisfies the pin is kept.
$pip install --no-cache-dir '/opt/align/src[cluster]'
$pip check

# Refuse an image whose torch is not the build asked for (a CPU torch in a cluster image would
# only show itself on a GPU node; a CUDA torch in CI would be gigabytes nobody uses).
$python -c "
import sys, torch
want = sys.argv[1]
got = 'cpu' if torch.version.cuda is None else 'cuda'
assert got == want, f'torch {torch.__version__} is a {got} build; ALIGN_TORCH asked for {want}'
print('torch', torch.__version__, 'build', got)
" "$torch_build"

rm -rf /opt/align/src
