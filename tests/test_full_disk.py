"""A filesystem that fills mid-stage: each kind of write a stage makes (a receipt, a shard, a
reference cache, an export, a training checkpoint) ends the stage with exit 7 and one line
in its log, on that same full filesystem, naming the path, the bytes it needed and the
free space; nothing partly written is left to be taken later; and once space is freed,
the same write gives the same bytes as on a roomy disk.

The filesystem is a real tmpfs of SIZE, mounted for this module (root, as CI runs).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SERVICES_REQUIRED

from align.exit_codes import NO_SPACE, NoSpaceLeft, filesystem_space, no_space_cause, writing

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "tests" / "drivers" / "full_disk.py"
SIZE = "64m"
SITES = ("receipt", "shard", "cache", "export", "checkpoint")
# What each site's write names as its path, under the site's directory.
WRITTEN = {
    "receipt": "receipt.json",
    "shard": "train.safetensors",
    "cache": "train.safetensors",
    "export": "policy",
    "checkpoint": "checkpoints/micro_00000001.partial",
}
DCP_METADATA = "/.metadata"
LINE = re.compile(
    r"^align full_disk: no space left on device writing (?P<path>\S+): it needed "
    r"(?P<needed>[\d,]+) bytes, the filesystem at (?P<mount>\S+) has (?P<free>[\d,]+) bytes "
    r"free of (?P<total>[\d,]+); free space \(or raise the quota\) and rerun, nothing partly "
    r"written is kept$"
)


@pytest.fixture(scope="module")
def small_fs(tmp_path_factory) -> Path:
    mount = tmp_path_factory.mktemp("small_fs")
    run = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if run.returncode:
        why = f"mounting a tmpfs needs root: {run.stderr.strip()}"
        if SERVICES_REQUIRED:
            pytest.fail(why)
        pytest.skip(why)
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=True)


def run_site(site: str, directory: Path, log: Path, *flags: str) -> int:
    """The driver writing `site` under `directory`, its stderr and stdout going to `log`."""
    command = [sys.executable, str(DRIVER), site, str(directory), *flags]
    if site == "checkpoint":
        command = [sys.executable, "-m", "align.launch", "--nproc", "1", *command[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as handle:
        return subprocess.run(
            command, stdout=handle, stderr=subprocess.STDOUT, timeout=300, cwd=REPO, env=env
        ).returncode


def dcp_metadata(path: Path):
    """What a torch.distributed.checkpoint's metadata says of its tensors (the file also
    holds a random id of its save, which two saves never share)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path.parent).read_metadata().state_dict_metadata


def tree_bytes(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@pytest.mark.parametrize("site", SITES)
def test_a_write_that_fills_the_filesystem_ends_exit_7_with_one_line_and_no_partial_file(
    small_fs, site, tmp_path
):
    directory, log = small_fs / site, small_fs / f"{site}.log"
    assert run_site(site, directory, log, "--fill") == NO_SPACE, log.read_text()[-3000:]

    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("align full_disk")]
    assert len(lines) == 1, text[-3000:]
    match = LINE.match(lines[0])
    assert match, lines[0]
    assert match["path"] == str(directory / WRITTEN[site])
    assert match["mount"] == str(small_fs)
    assert int(match["needed"].replace(",", "")) > int(match["free"].replace(",", ""))
    assert int(match["total"].replace(",", "")) == filesystem_space(small_fs)[1]

    # Nothing partly written: no file a later stage could take, and no temporary left over.
    assert [p.relative_to(directory) for p in directory.rglob("*") if p.is_file()] == []
    assert not [p for p in directory.rglob("*") if ".partial" in p.name or "staging" in p.name]

    (small_fs / "filler").unlink()
    assert run_site(site, directory, log) == 0, log.read_text()[-3000:]
    reference = tmp_path / "roomy"
    assert run_site(site, reference, tmp_path / "roomy.log") == 0
    written, roomy = tree_bytes(directory), tree_bytes(reference)
    assert written and written.keys() == roomy.keys()
    for name in written:
        if name.endswith(DCP_METADATA):
            assert dcp_metadata(directory / name) == dcp_metadata(reference / name)
        else:
            assert written[name] == roomy[name], name


def test_a_checkpoint_torn_by_a_full_disk_is_never_taken_as_valid(small_fs):
    from align.train.checkpointing import CheckpointManager
    from align.utils.dist import DistInfo

    directory, log = small_fs / "torn", small_fs / "torn.log"
    assert run_site("checkpoint", directory, log, "--fill") == NO_SPACE
    (small_fs / "filler").unlink()
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=None, backend="gloo")
    assert CheckpointManager(directory, info, keep=1).latest() is None


def test_enospc_edquot_and_their_words_in_rust_and_c_errors_are_told_apart_from_others():
    assert no_space_cause(OSError(28, "No space left on device")) == "no space left on device"
    assert no_space_cause(OSError(122, "Disk quota exceeded")) == "disk quota exceeded"
    rust = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert no_space_cause(rust) == "no space left on device"
    wrapped = RuntimeError("writer failed")
    wrapped.__cause__ = OSError(122, "quota")
    assert no_space_cause(wrapped) == "disk quota exceeded"
    assert no_space_cause(OSError(13, "Permission denied")) is None
    assert no_space_cause(ValueError("bad row")) is None


def test_a_short_torch_save_write_counts_as_full_only_when_the_space_is_short(tmp_path):
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    free = filesystem_space(tmp_path)[0]
    with pytest.raises(NoSpaceLeft), writing(tmp_path / "x", needed_bytes=free + 1):
        raise short
    with pytest.raises(RuntimeError, match="unexpected pos"), writing(tmp_path / "x", 1):
        raise short
    with pytest.raises(ValueError), writing(tmp_path / "x", needed_bytes=free + 1):
        raise ValueError("not a write")
