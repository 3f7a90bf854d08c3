"""The scoring forwards each rank runs (align.data.deal) and the memory projection read off
the same deal: every projected (rows, width) is a batch the loops collate, and a shard too
small to fill every rank's blocks is projected the forwards its ranks run."""

from __future__ import annotations

import numpy as np
import pytest
from mistral_7b import write_config_only_checkpoint
from test_loader import PAD, make_pairs

from align.config import ArmConfig, apply_overrides
from align.constants import PAIR_LAYOUTS
from align.data import deal
from align.data.loader import PairShard
from align.data.shards import PAIR_FORMAT, pair_arrays, write_shard
from align.train.memory import projected_job_rss, scoring_forwards, shards_shape

WORLD = 2
# 13 pairs of widths 10 to 70 (the widest last), and a held split of 5.
TRAIN = [(4, 4 + i, 2 + i % 3) for i in range(0, 65, 5)]
HELD = [(3, 5, 2), (3, 9, 4), (2, 2, 2), (5, 5, 5), (1, 3, 8)]


def arm(*extra: str) -> ArmConfig:
    cfg = ArmConfig(arm="dealt")
    overrides = [f"--batch.world_size={WORLD}", "--micro_batch=1", "--grad_accum=2"]
    overrides += ["--global_batch=4", "--eval.batch_size=4", "--ref.batch_size=4"]
    overrides += ["--ref.slice_pairs=4", "--path_bias.sample_pairs=7", *extra]
    apply_overrides(cfg, overrides, where="test")
    return cfg


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, object]:
    directory = tmp_path_factory.mktemp("dealt")
    paths = {}
    for split, lengths in (("train", TRAIN), ("held", HELD)):
        ids = list(range(len(lengths)))
        paths[split] = directory / f"{split}.safetensors"
        write_shard(
            paths[split], pair_arrays(ids, make_pairs(lengths), PAD), PAIR_FORMAT, split=split
        )
    return paths


def collated(shard: PairShard, blocks: list[deal.Block], pad: np.ndarray) -> set:
    """(rows, width) of every batch the scoring loop collates for these blocks."""
    batches = [shard.collate(b if b is not None else pad) for b in blocks]
    return {tuple(batch.input_ids.shape) for batch in batches}


@pytest.mark.parametrize("layout", PAIR_LAYOUTS)
def test_the_projected_forwards_are_the_batches_the_scoring_loops_collate(shards, layout):
    cfg = arm(f"--batch.layout={layout}", f"--ref.layout={layout}")
    for rank in range(WORLD):
        held = PairShard(shards["held"], layout)
        blocks = deal.rank_blocks(len(held), cfg.eval.batch_size, rank, WORLD)
        pad = deal.padding_rows(len(held), cfg.eval.batch_size)
        assert scoring_forwards("dpo", cfg, shards)[rank] == collated(held, blocks, pad)
        expected = set()
        for split in ("train", "held"):
            shard = PairShard(shards[split], layout)
            size = deal.slice_size(cfg.ref.slice_pairs, cfg.ref.batch_size)
            bounds = deal.slice_rows(len(shard), size)
            rounds = deal.slice_rounds(
                bounds, list(range(len(bounds))), cfg.ref.batch_size, rank, WORLD
            )
            blocks = [b for _, dealt in rounds for b in dealt]
            expected |= collated(shard, blocks, deal.padding_rows(len(shard), cfg.ref.batch_size))
        assert scoring_forwards("ref_cache", cfg, shards)[rank] == expected


def test_the_path_bias_check_is_projected_its_sample_in_micro_batches(shards):
    cfg = arm()
    train = PairShard(shards["train"])
    rows = deal.sample_rows(len(train), cfg.path_bias.sample_pairs, cfg.path_bias.seed)
    pad = rows[deal.padding_rows(len(rows), cfg.batch.micro_batch)]
    for rank in range(WORLD):
        dealt = deal.rank_blocks(len(rows), cfg.batch.micro_batch, rank, WORLD)
        blocks = [rows[b] if b is not None else None for b in dealt]
        assert scoring_forwards("path_bias", cfg, shards)[rank] == collated(train, blocks, pad)


def test_a_small_shard_was_projected_full_blocks_of_its_widest_row_on_every_rank(shards, tmp_path):
    """Each rank's widest dealt forward, not `rows x longest` on every rank: of the 13-pair
    train split's slices of 4, the widest pair sits alone in the last."""
    cfg, checkpoint = arm(), write_config_only_checkpoint(tmp_path / "mistral-7b")
    dealt = shards_shape("ref_cache", cfg, 1, 0, shards)
    bound = shards_shape("ref_cache", cfg, 1, 0, {})
    assert dealt.scored and not bound.scored
    assert dealt.row_tokens == max(p + max(c, r) for p, c, r in TRAIN)
    widest = [max(forwards, key=lambda f: f[0] * f[1]) for forwards in dealt.scored]
    assert widest[0] != widest[1]
    terms = [
        projected_job_rss(shape, checkpoint, 0)["phases"]["evaluate"]["terms_mb"]["activations"]
        for shape in (dealt, bound)
    ]
    assert 0 < terms[0] < terms[1]


def test_a_stage_whose_shards_are_not_all_built_is_projected_the_bound(shards):
    assert scoring_forwards("dpo", arm(), {"train": shards["train"]}) == ()
    assert scoring_forwards("sft", arm(), shards) == ()
