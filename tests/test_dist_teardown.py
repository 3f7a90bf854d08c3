"""How a stage's ranks leave the process group: together, so none tears its gloo pairs down
while a peer is still working on them."""

from __future__ import annotations

import time

import torch.distributed as dist
import torch.multiprocessing as mp

from align.utils.dist import destroy_distributed


def _leave(rank: int, init_file: str, times: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    if rank == 0:
        time.sleep(1.0)  # rank 0 still writes its receipt while rank 1 is done
    times[f"enter{rank}"] = time.monotonic()
    destroy_distributed()
    times[f"left{rank}"] = time.monotonic()


def test_a_rank_that_finished_first_tore_the_group_down_under_its_peer_and_aborted_at_exit(
    tmp_path,
):
    with mp.Manager() as manager:
        times = manager.dict()
        mp.spawn(_leave, args=(str(tmp_path / "init"), times), nprocs=2, join=True)
        times = dict(times)
    # Rank 1 reached the teardown first, and left only once rank 0 had reached it too.
    assert times["enter1"] < times["enter0"]
    assert times["left1"] >= times["enter0"]
