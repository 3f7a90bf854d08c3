"""Hub-shaped checkpoints everywhere a checkpoint is read: sharded safetensors, both config
generations, Mistral's real sentencepiece tokenizer, and the whole chain on CPU from one."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from conftest import dry_run_rules, run_snakemake, snakemake_command
from hub_checkpoint import (
    MISTRAL_INSTRUCT_V01_TEMPLATE,
    SENTENCEPIECE_V3,
    write_hf_cache_snapshot,
    write_hub_checkpoint,
    write_mistral_tokenizer,
)

from align.data.synthetic import write_default_data
from align.model.checkpoint import load_pretrained, save_hf_checkpoint
from align.model.checkpoint_files import (
    NotACheckpoint,
    checkpoint_files,
    planned_checkpoint_files,
)
from align.model.checkpoint_shapes import verify_checkpoint
from align.model.hf_config import load_hf_config
from align.model.tokenizer import PAD_FROM_EOS, load_tokenizer
from align.paths import RunPaths
from align.receipts import PASSED, load_receipt, read_json
from align.utils.weights_hash import checkpoint_tensors

REPO = Path(__file__).resolve().parents[1]
HUB_CONFIGS = REPO / "tests" / "configs" / "hub"
INDEX = "model.safetensors.index.json"
LAYOUTS = ("v4", "v5")
CACHED_REPO = "mistralai/Mistral-tiny-random"


@pytest.fixture(scope="module")
def mistral_tokenizer(tmp_path_factory) -> Path:
    return write_mistral_tokenizer(tmp_path_factory.mktemp("mistral_tokenizer"))


@pytest.fixture(scope="module")
def hub(tmp_path_factory, mistral_tokenizer) -> dict[str, Path]:
    """The same random weights saved in the transformers 4 and 5 layouts."""
    root = tmp_path_factory.mktemp("hub")
    return {
        layout: write_hub_checkpoint(root / layout, mistral_tokenizer, layout) for layout in LAYOUTS
    }


def shards(directory: Path) -> list[str]:
    return sorted(set(json.loads((directory / INDEX).read_text())["weight_map"].values()))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpoint_files_lists_every_file_of_a_sharded_download(hub, layout):
    directory = hub[layout]
    assert len(shards(directory)) >= 3
    listed = {path.name for path in checkpoint_files(directory)}
    assert listed == {path.name for path in directory.iterdir()}
    assert {"config.json", INDEX, "tokenizer.json", "generation_config.json"} <= listed
    assert set(shards(directory)) <= listed


def test_checkpoint_files_refuses_what_is_not_a_checkpoint_naming_what_is_missing(hub, tmp_path):
    broken = shutil.copytree(hub["v5"], tmp_path / "broken")
    first_shard = shards(broken)[0]
    (broken / first_shard).unlink()
    (broken / "tokenizer.json").unlink()
    with pytest.raises(NotACheckpoint) as err:
        checkpoint_files(broken)
    message = str(err.value)
    assert str(broken) in message
    assert f"{first_shard} (named by {INDEX})" in message and "tokenizer.json" in message
    assert err.value.exit_code == 2

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NotACheckpoint, match=r"missing config\.json, tokenizer\.json"):
        checkpoint_files(empty)
    with pytest.raises(NotACheckpoint, match="no such directory"):
        checkpoint_files(tmp_path / "absent")


def test_a_plan_takes_a_download_without_its_shards_and_nothing_less(hub, tmp_path):
    plan = shutil.copytree(hub["v5"], tmp_path / "plan")
    for shard in shards(plan):
        (plan / shard).unlink()
    files, absent = planned_checkpoint_files(plan)
    assert {path.name for path in files} == {path.name for path in plan.iterdir()}
    assert absent == [f"{shard} (named by {INDEX})" for shard in shards(hub["v5"])]
    with pytest.raises(NotACheckpoint, match=r"model-00001-of-00003\.safetensors"):
        checkpoint_files(plan)
    (plan / "tokenizer.json").unlink()
    with pytest.raises(NotACheckpoint, match=r"missing tokenizer\.json"):
        planned_checkpoint_files(plan)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_index_total_size_is_the_bytes_of_the_shards_tensors(hub, layout):
    tensors = checkpoint_tensors(hub[layout])
    assert verify_checkpoint(hub[layout]).stored_bytes == sum(
        t.end - t.begin for t in tensors.values()
    )


def test_single_file_checkpoint_lists_its_one_weight_file(hub, tmp_path):
    model = load_pretrained(hub["v5"])
    single = save_hf_checkpoint(model, tmp_path / "single", source_dir=hub["v5"])
    names = {path.name for path in checkpoint_files(single)}
    assert "model.safetensors" in names and INDEX not in names
    both = shutil.copytree(hub["v5"], tmp_path / "both")
    shutil.copyfile(single / "model.safetensors", both / "model.safetensors")
    with pytest.raises(NotACheckpoint, match="holds both"):
        checkpoint_files(both)


def test_both_config_generations_give_one_model_equal_to_transformers(hub):
    from transformers import AutoModelForCausalLM

    v4, v5 = (load_hf_config(hub[layout]) for layout in LAYOUTS)
    assert v4 == v5
    assert (v4.rope_theta, v4.torch_dtype, v4.sliding_window) == (10000.0, "bfloat16", 4096)
    ids = torch.tensor([[1, 733, 16289, 28793, 22557, 28705, 28750, 243, 162]])
    theirs = AutoModelForCausalLM.from_pretrained(hub["v4"], dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs(ids).logits
        for layout in LAYOUTS:
            ours = load_pretrained(hub[layout], dtype=torch.float32).eval()
            torch.testing.assert_close(ours(ids), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mistral_tokenizer_special_tokens_pad_choice_template_and_byte_fallback(hub, layout):
    tokenizer = load_tokenizer(hub[layout])
    assert tokenizer.vocab_size == 32000
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    assert tokenizer.pad_id == tokenizer.eos_id and tokenizer.pad_source == PAD_FROM_EOS
    assert tokenizer.special_tokens() == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    assert tokenizer.chat_template == MISTRAL_INSTRUCT_V01_TEMPLATE
    text = "Mia has 3 apples 🍎 and gets 4 more."
    ids = tokenizer.encode(text)
    byte_pieces = [tokenizer.backend.id_to_token(i) for i in ids if 3 <= i < 3 + 256]
    assert byte_pieces == ["<0xF0>", "<0x9F>", "<0x8D>", "<0x8E>"]
    assert tokenizer.decode(ids) == text


def test_mistral_v03_tokenizer_keeps_its_control_tokens_whole(tmp_path):
    tokenizer = load_tokenizer(write_mistral_tokenizer(tmp_path, SENTENCEPIECE_V3))
    assert tokenizer.vocab_size == 32768 and (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    ids = tokenizer.encode("[INST] Hi 🍎 [/INST]")
    assert ids[0] == tokenizer.backend.token_to_id("[INST]") == 3
    assert ids[-1] == tokenizer.backend.token_to_id("[/INST]") == 4
    assert "<0xF0>" in [tokenizer.backend.id_to_token(i) for i in ids]
    assert tokenizer.decode(ids).strip() == "Hi 🍎"


def test_special_tokens_map_that_disagrees_with_the_config_is_refused(hub, tmp_path):
    copy = shutil.copytree(hub["v4"], tmp_path / "copy")
    (copy / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<unk>"}))
    with pytest.raises(ValueError, match=r"eos_token is '</s>' in tokenizer_config.json but"):
        load_tokenizer(copy)


def test_export_carries_the_generation_config_and_chat_template(hub, tmp_path):
    from transformers import AutoTokenizer

    for layout in LAYOUTS:
        out = save_hf_checkpoint(
            load_pretrained(hub[layout]), tmp_path / layout, source_dir=hub[layout]
        )
        for name in ("generation_config.json", "tokenizer.json", "tokenizer.model"):
            assert (out / name).read_bytes() == (hub[layout] / name).read_bytes(), name
        assert AutoTokenizer.from_pretrained(out).chat_template == MISTRAL_INSTRUCT_V01_TEMPLATE


@pytest.fixture(scope="module")
def cached(hub, tmp_path_factory) -> Path:
    """hub["v5"] as a snapshot of the Hugging Face cache, found by huggingface_hub itself."""
    from huggingface_hub import scan_cache_dir, snapshot_download

    cache_dir = tmp_path_factory.mktemp("hf_cache")
    written = write_hf_cache_snapshot(hub["v5"], cache_dir, CACHED_REPO)
    snapshot = Path(snapshot_download(CACHED_REPO, cache_dir=cache_dir, local_files_only=True))
    assert snapshot == written
    scanned = scan_cache_dir(cache_dir)
    assert not scanned.warnings and [r.repo_id for r in scanned.repos] == [CACHED_REPO]
    return snapshot


def test_a_hf_cache_snapshot_of_symlinks_into_its_blobs_is_the_checkpoint_it_links(hub, cached):
    from align.model.tokenizer_hash import tokenizer_hash
    from align.utils.weights_hash import weights_hash

    source = hub["v5"]
    assert all(path.is_symlink() for path in cached.iterdir())
    assert [p.name for p in checkpoint_files(cached)] == [p.name for p in checkpoint_files(source)]
    assert verify_checkpoint(cached) == verify_checkpoint(source)
    assert weights_hash(cached) == weights_hash(source)
    assert tokenizer_hash(cached) == tokenizer_hash(source)
    assert load_tokenizer(cached).encode("[INST] Hi [/INST]") == load_tokenizer(source).encode(
        "[INST] Hi [/INST]"
    )


def test_an_export_from_a_hf_cache_snapshot_copies_the_files_not_the_links(cached, tmp_path):
    out = save_hf_checkpoint(load_pretrained(cached), tmp_path / "policy", source_dir=cached)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert not (out / name).is_symlink() and (out / name).is_file(), name
        assert (out / name).read_bytes() == (cached / name).read_bytes(), name


def test_sharded_base_model_no_longer_fails_dag_build_with_missing_input(hub, tmp_path):
    rules = dry_run_rules(tmp_path, "arms", "--config", f"base_model={hub['v4']}")
    assert "sft" in rules and "sft_gate" in rules
    run = run_snakemake(
        tmp_path, "--dry-run", "arms", "--config", f"base_model={tmp_path}", timeout=300
    )
    assert run.returncode != 0
    assert f"{tmp_path} is not a checkpoint directory: missing config.json" in (
        run.stdout + run.stderr
    )


# --- the whole chain on CPU from a hub-shaped checkpoint ---------------------------------


def chain_config(work: Path, arm: str, **checkpoints: str) -> Path:
    """Data in the public schemas under work/data, and the workflow config pointing at it:
    one arm, the selection's default."""
    write_default_data(work / "data", seed=0, n_argilla=150, n_steppairs=150, n_sft=200)
    selection = work / "selection.toml"
    selection.write_text(
        (HUB_CONFIGS / "selection.toml")
        .read_text()
        .replace('default_arm = "argilla"', f'default_arm = "{arm}"')
    )
    config = {
        "arms": [arm],
        "arm_config_dir": str(HUB_CONFIGS / "arms"),
        "sft_config": str(HUB_CONFIGS / "sft.toml"),
        "selection_config": str(selection),
        # The two chains run side by side, one single-rank job each: one thread apiece.
        "threads": 1,
        **checkpoints,
    }
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def check_policy_in_transformers(policy: Path, source: Path) -> None:
    """The exported policy loads in transformers, equals ours in float32, and generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (policy / "generation_config.json").read_bytes() == (
        source / "generation_config.json"
    ).read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(policy)
    assert tokenizer.chat_template == MISTRAL_INSTRUCT_V01_TEMPLATE
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], return_dict=True, return_tensors="pt"
    )["input_ids"]
    assert ids[0, 0].item() == tokenizer.bos_token_id == 1
    theirs = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    ours = load_pretrained(policy, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=0, atol=1e-5)
        generated = theirs.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > ids.shape[1]


def check_chain(paths: RunPaths, arm: str, checkpoint: Path, source: Path) -> None:
    gate = load_receipt(paths.sft_gate, "sft_gate", stage="sft_gate")
    # Receipts name what lies under results/ relative to it, what lies outside as given.
    assert paths.results / gate["checkpoint"] == checkpoint and gate["passed"] is True
    manifest = load_receipt(paths.manifest, "manifest", stage="build_manifest")
    assert manifest["pins"]["pad_source"] == PAD_FROM_EOS
    assert manifest["pins"]["chat_template"] is True
    result = load_receipt(paths.arm(arm).arm_result, "dpo", stage="dpo")
    assert result["status"] == PASSED
    check_policy_in_transformers(paths.arm(arm).policy_dir, source)
    assert arm in read_json(paths.selection)["figures"]["policies"]


# One chain from each end, one arm each (CI time): the Step-DPO arm from the sharded
# base model, the argilla arm (its system turn folded for Mistral's template) from the
# SFT checkpoint as a Hugging Face cache snapshot. Each is one rank at a time, so the two
# run side by side.
@pytest.fixture(scope="module")
def chains(hub, cached, tmp_path_factory) -> dict[str, RunPaths]:
    """`snakemake arms` from each end, both started before either is waited on."""
    works = {name: tmp_path_factory.mktemp(f"chain-{name}") for name in ("base", "sft")}
    configs = {
        "base": chain_config(works["base"], "steppairs", base_model=str(hub["v4"])),
        "sft": chain_config(works["sft"], "argilla", sft_checkpoint=str(cached)),
    }
    runs = {}
    try:
        for name, work in works.items():
            args = ("--configfile", str(configs[name]), "--cores", "2", "arms")
            command, env = snakemake_command(work, *args, timeout=900)
            with (work / "snakemake.out").open("w") as log:
                runs[name] = subprocess.Popen(
                    command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT
                )
        for name, proc in runs.items():
            returncode = proc.wait(timeout=960)
            output = (works[name] / "snakemake.out").read_text()
            assert returncode == 0, f"chain from the {name} checkpoint:\n{output[-6000:]}"
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    return {name: RunPaths.of(work / "results") for name, work in works.items()}


@pytest.mark.slow
def test_whole_chain_from_a_sharded_hub_base_model(hub, chains):
    paths = chains["base"]
    assert load_receipt(paths.sft_receipt, "sft", stage="sft")["status"] == PASSED
    check_chain(paths, "steppairs", paths.sft_checkpoint, hub["v4"])


@pytest.mark.slow
def test_whole_chain_from_a_hub_sft_checkpoint_in_the_hf_cache(hub, cached, chains):
    paths = chains["sft"]
    assert not paths.sft_checkpoint.exists(), "rule sft ran although a checkpoint was given"
    check_chain(paths, "argilla", cached, hub["v5"])
