"""The Triton flash-attention kernel against SDPA, and the receipt gate in front of it.

Without a usable GPU the kernels run in Triton's interpreter on CPU tensors. Triton
reads TRITON_INTERPRET when it is first imported, so this module sets it before
importing triton; when another test module imported triton first, the `test_kernel_*`
tests run in a child pytest with the variable set. The interpreter's tl.dot misreads
bfloat16, so bfloat16 cases run only on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"


def _triton_imported_uninterpreted() -> bool:
    if "triton" not in sys.modules:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return not isinstance(sys.modules["triton"].language.zeros, InterpretedFunction)


TRITON_WAS_IMPORTED_UNINTERPRETED = not ON_GPU and _triton_imported_uninterpreted()

import pytest  # noqa: E402
from tiny_models import tiny_mistral_config  # noqa: E402

from align.kernels import equivalence as eq  # noqa: E402
from align.kernels import flash_attn, gate  # noqa: E402
from align.model import attention as attention_module  # noqa: E402
from align.model import mistral  # noqa: E402
from align.model.attention import attention, select_attn_implementation  # noqa: E402
from align.model.hf_config import MistralConfig  # noqa: E402
from align.receipts import hash_json, write_json_atomic  # noqa: E402

KERNELS_RUN_HERE = ON_GPU or (not TRITON_WAS_IMPORTED_UNINTERPRETED and flash_attn.INTERPRETED)
kernel_test = pytest.mark.skipif(
    not KERNELS_RUN_HERE,
    reason="triton was imported before TRITON_INTERPRET=1; "
    "test_interpreted_kernel_tests_pass_in_a_child_process runs these",
)
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
torch.set_num_threads(1)  # tiny tensors: thread hand-offs cost more than the arithmetic

FLOAT32_TOLERANCE = 1e-5
CASES = [
    # batch, q heads, kv heads, length, head dim, seq_lens, causal
    (2, 4, 2, 33, 16, (33, 20), True),
    (2, 4, 4, 50, 32, None, True),
    (3, 6, 2, 40, 16, (40, 1, 0), True),
    (1, 4, 1, 70, 32, (64,), True),
    (3, 2, 1, 40, 16, (40, 17, 0), False),
]
DTYPES = ["float32", "float16"]
if ON_GPU:
    CASES += [(2, 32, 8, 300, 128, (300, 177), True), (2, 8, 2, 129, 64, (129, 1), True)]
    DTYPES += ["bfloat16"]


def random_inputs(shape: eq.GateShape, seed: int = 0):
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    dtype = getattr(torch, shape.dtype)

    def draw(heads: int) -> torch.Tensor:
        size = (shape.batch, heads, shape.length, shape.head_dim)
        return torch.randn(size, generator=generator, device=DEVICE).to(dtype)

    q, k, v, grad_out = (
        draw(shape.q_heads),
        draw(shape.kv_heads),
        draw(shape.kv_heads),
        draw(shape.q_heads),
    )
    lengths = shape.seq_lens or (shape.length,) * shape.batch
    return q, k, v, grad_out, torch.tensor(lengths, dtype=torch.int32, device=DEVICE)


def forward_backward(fn, q, k, v, grad_out, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad_out.to(dtype))
    return [out.detach()] + [leaf.grad for leaf in leaves]


def test_reference_matches_the_per_head_definition():
    shape = eq.GateShape(2, 4, 2, 9, 8, "float32", (9, 4))
    q, k, v, _, seq_lens = random_inputs(shape)
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    found = eq.reference_attention(q, k, v, seq_lens.cpu())
    expected = torch.zeros_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        for h in range(shape.q_heads):
            scores = q[b, h, :length] @ k[b, h // 2, :length].T / shape.head_dim**0.5
            scores = scores.masked_fill(torch.ones_like(scores).triu(1).bool(), float("-inf"))
            expected[b, h, :length] = scores.softmax(-1) @ v[b, h // 2, :length]
    assert (found - expected).abs().max().item() < 1e-12


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(map(str, case)))
def test_kernel_forward_and_backward_match_sdpa(case, dtype: str):
    batch, q_heads, kv_heads, length, head_dim, seq_lens, causal = case
    shape = eq.GateShape(batch, q_heads, kv_heads, length, head_dim, dtype, seq_lens, causal)
    q, k, v, grad_out, lengths = random_inputs(shape)
    compute = getattr(torch, dtype)

    def kernel(q_, k_, v_):
        return flash_attn.flash_attention(q_, k_, v_, seq_lens=lengths, causal=causal)

    def reference(q_, k_, v_):
        return eq.reference_attention(q_, k_, v_, lengths, causal)

    found = forward_backward(kernel, q, k, v, grad_out, compute)
    expected = forward_backward(reference, q, k, v, grad_out, torch.float64)
    thresholds = eq.THRESHOLDS.get(dtype) or dict.fromkeys(eq.TENSORS, FLOAT32_TOLERANCE)
    for name, got, want in zip(eq.TENSORS, found, expected, strict=True):
        assert got.dtype == compute and got.shape == want.shape
        error = gate.relative_error(got, want)
        assert error <= thresholds[name], f"{name}: relative error {error:.3g}"
    out, dq, dk, dv = found
    padding = torch.arange(length, device=DEVICE)[None, :] >= lengths[:, None]
    for tensor in (out, dq, dk, dv):
        assert tensor.transpose(1, 2)[padding].abs().sum().item() == 0


@kernel_test
def test_kernel_reads_strided_views_and_defaults_to_full_length():
    batch, length, q_heads, kv_heads, head_dim = 2, 37, 4, 2, 32
    generator = torch.Generator(device=DEVICE).manual_seed(3)
    # The model's layout: [B, T, H, D] projections viewed as [B, H, T, D].
    q = torch.randn(batch, length, q_heads, head_dim, generator=generator, device=DEVICE)
    kv = torch.randn(batch, length, 2 * kv_heads, head_dim, generator=generator, device=DEVICE)
    q_view, k_view, v_view = q.transpose(1, 2), *kv.transpose(1, 2).chunk(2, dim=1)
    assert not q_view.is_contiguous() and not k_view.is_contiguous()
    strided = flash_attn.flash_attention(q_view, k_view, v_view)
    full = torch.full((batch,), length, dtype=torch.int32, device=DEVICE)
    contiguous = flash_attn.flash_attention(
        q_view.contiguous(), k_view.contiguous(), v_view.contiguous(), seq_lens=full
    )
    assert torch.equal(strided, contiguous)
    expected = eq.reference_attention(q_view.double(), k_view.double(), v_view.double(), full)
    assert gate.relative_error(strided, expected) <= FLOAT32_TOLERANCE


@kernel_test
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seq_lens": torch.tensor([9, 3])}, r"seq_lens must lie in \[0, 8\]"),
        ({"seq_lens": torch.tensor([-1, 3])}, r"seq_lens must lie in \[0, 8\]"),
        ({"seq_lens": torch.tensor([8])}, "shape"),
        ({"seq_lens": torch.tensor([8.0, 3.0])}, "integer"),
        ({"softmax_scale": 0.0}, "softmax_scale"),
        ({"head_dim": 8}, "head dim 8"),
        ({"k_dtype": torch.float16}, "share one dtype"),
        ({"kv_heads": 3}, "multiple"),
    ],
)
def test_kernel_wrapper_refuses_what_it_cannot_honour(change: dict, message: str):
    head_dim = change.pop("head_dim", 16)
    kv_heads = change.pop("kv_heads", 2)
    k_dtype = change.pop("k_dtype", torch.float32)
    q = torch.randn(2, 4, 8, head_dim, device=DEVICE)
    k = torch.randn(2, kv_heads, 8, head_dim, device=DEVICE).to(k_dtype)
    if "seq_lens" in change:
        change["seq_lens"] = change["seq_lens"].to(DEVICE)
    with pytest.raises(ValueError, match=message):
        flash_attn.flash_attention(q, k, k, **change)


def test_key_lengths_follow_the_right_padded_attention_mask():
    shape = torch.Size((3, 6))
    attention_mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] + [0] * 5])
    lengths = mistral.build_key_lengths(attention_mask, shape, sliding_window=None)
    assert lengths.dtype == torch.int32 and lengths.tolist() == [6, 4, 1]
    assert mistral.build_key_lengths(torch.ones(3, 6), shape, sliding_window=6) is None
    assert mistral.build_key_lengths(None, shape, sliding_window=None) is None
    with pytest.raises(ValueError, match="right-padded"):
        mistral.build_key_lengths(attention_mask.flip(-1), shape, sliding_window=None)
    with pytest.raises(ValueError, match="sliding window"):
        mistral.build_key_lengths(attention_mask, shape, sliding_window=5)


def tiny_config(sliding_window: int | None = None) -> MistralConfig:
    return tiny_mistral_config(
        vocab_size=61, hidden_size=64, intermediate_size=96, sliding_window=sliding_window
    )


@kernel_test
def test_kernel_model_path_matches_sdpa_on_real_tokens(monkeypatch):
    # Bypasses only the device and receipt checks; the model's own length hook is exercised.
    monkeypatch.setattr(mistral, "select_attn_implementation", lambda name, device: name)
    monkeypatch.setitem(
        attention_module.ATTENTION_BACKENDS,
        "triton_fa2",
        lambda q, k, v, lengths: flash_attn.flash_attention(q, k, v, seq_lens=lengths),
    )
    torch.manual_seed(0)
    with torch.device(DEVICE):
        sdpa_model = mistral.NmoMistralForCausalLM(tiny_config(), "sdpa")
        triton_model = mistral.NmoMistralForCausalLM(tiny_config(), "triton_fa2")
    triton_model.load_state_dict(sdpa_model.state_dict())
    input_ids = torch.randint(1, 61, (2, 21), device=DEVICE)
    lengths = torch.tensor([[21], [13]], device=DEVICE)
    attention_mask = (torch.arange(21, device=DEVICE)[None, :] < lengths).long()
    real = attention_mask.bool()
    logits, grads = [], []
    for model in (sdpa_model, triton_model):
        model_logits = model(input_ids, attention_mask)
        model_logits[real].square().mean().backward()
        logits.append(model_logits.detach()[real])
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert gate.relative_error(logits[1], logits[0]) <= 1e-5
    for name, grad in grads[1].items():
        assert gate.relative_error(grad, grads[0][name]) <= 1e-4, name

    windowed = mistral.NmoMistralForCausalLM(tiny_config(sliding_window=8), "triton_fa2").to(DEVICE)
    with pytest.raises(ValueError, match="sliding window"):
        windowed(input_ids, attention_mask)


TINY_GRID = (
    eq.GateShape(2, 4, 2, 33, 16, "float16", (33, 20)),
    eq.GateShape(3, 2, 1, 40, 32, "float16", (40, 1, 0), causal=False),
)


@kernel_test
def test_kernel_gate_passes_the_kernel_and_fails_a_broken_one(monkeypatch):
    key = eq.kernel_key("Fake GPU", "9.0")
    receipt = eq.run_gate(DEVICE, key, TINY_GRID)
    assert receipt["passed"] and len(receipt["results"]) == len(TINY_GRID)
    assert receipt["receipt_sha256"] == hash_json(
        {name: value for name, value in receipt.items() if name != "receipt_sha256"}
    )

    real_kernel = flash_attn.flash_attention

    def ignores_padding(q, k, v, seq_lens=None, causal=True):
        return real_kernel(q, k, v, causal=causal)

    monkeypatch.setattr(flash_attn, "flash_attention", ignores_padding)
    broken = eq.run_gate(DEVICE, key, TINY_GRID)
    assert not broken["passed"]
    assert all(not result["passed"] for result in broken["results"])


def test_interpreted_kernel_tests_pass_in_a_child_process():
    if KERNELS_RUN_HERE:
        pytest.skip("the kernel tests ran in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "test_kernel_",
            __file__,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and "skipped" not in child.stdout


# Receipt checks: plain JSON and hashes, so a fake device name stands in for a GPU.
FAKE_DEVICE = "Fake GPU 80GB"


def fake_key(**changes: str) -> dict[str, str]:
    return {**eq.kernel_key(FAKE_DEVICE, "9.0"), **changes}


def passing_results(scale: float = 0.5) -> list[dict]:
    results = []
    for seed, shape in enumerate(eq.EQUIVALENCE_GRID):
        thresholds = eq.THRESHOLDS[shape.dtype]
        errors = {name: scale * limit for name, limit in thresholds.items()}
        results.append(
            {
                "shape": shape.as_dict(),
                "seed": seed,
                "errors": errors,
                "thresholds": thresholds,
                "passed": scale <= 1,
                "sdpa_same_dtype_errors": errors,
            }
        )
    return results


@pytest.fixture
def receipts(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(gate.RECEIPTS_ENV, str(tmp_path))
    return tmp_path


def write_receipt(key: dict[str, str], results: list[dict]) -> Path:
    path = eq.receipt_path(key)
    write_json_atomic(path, eq.seal_receipt(key, results, seconds=1.0))
    return path


def test_a_passed_current_receipt_is_accepted(receipts: Path):
    key = fake_key()
    path = write_receipt(key, passing_results())
    assert path.parent == receipts and path.name == "triton_fa2-Fake_GPU_80GB-sm90.json"
    assert eq.verify_receipt(path, key)["passed"]


def test_selector_accepts_cuda_with_a_passed_receipt(receipts: Path, monkeypatch):
    key = fake_key()
    write_receipt(key, passing_results())
    monkeypatch.setattr(eq, "device_key", lambda device: key)
    assert select_attn_implementation("triton_fa2", "cuda:0") == "triton_fa2"


def test_selector_refuses_a_missing_receipt(receipts: Path, monkeypatch):
    monkeypatch.setattr(eq, "device_key", lambda device: fake_key())
    with pytest.raises(ValueError, match="no equivalence receipt") as error:
        select_attn_implementation("triton_fa2", "cuda")
    assert "python -m align.kernels.equivalence" in str(error.value)


def test_selector_refuses_a_receipt_for_other_kernel_source(receipts: Path, monkeypatch, tmp_path):
    old_key = fake_key()
    write_receipt(old_key, passing_results())
    edited = tmp_path / "flash_attn.py"
    edited.write_bytes(eq.KERNEL_SOURCE.read_bytes() + b"\n# edited\n")
    new_key = eq.kernel_key(FAKE_DEVICE, "9.0", kernel_source=edited)
    monkeypatch.setattr(eq, "device_key", lambda device: new_key)
    with pytest.raises(ValueError, match="stale") as error:
        select_attn_implementation("triton_fa2", "cuda")
    message = str(error.value)
    assert "kernel source" in message
    assert old_key["kernel_source_sha256"] in message and new_key["kernel_source_sha256"] in message


@pytest.mark.parametrize(
    ("component", "label"),
    [
        ("triton_version", "triton version"),
        ("torch_version", "torch version"),
        ("device_name", "device name"),
        ("cuda_capability", "CUDA capability"),
    ],
)
def test_a_receipt_for_other_software_or_device_is_stale(receipts: Path, component, label):
    old_key = fake_key()
    path = write_receipt(old_key, passing_results())
    new_key = fake_key(**{component: "0.0-other"})
    with pytest.raises(ValueError, match="stale") as error:
        eq.verify_receipt(path, new_key)
    message = str(error.value)
    assert label in message and "0.0-other" in message and repr(old_key[component]) in message


def test_a_receipt_for_another_grid_is_stale(receipts: Path):
    key = fake_key()
    path = write_receipt(key, passing_results()[:-1])
    with pytest.raises(ValueError, match="equivalence grid"):
        eq.verify_receipt(path, key)


def test_a_tampered_receipt_is_refused(receipts: Path):
    key = fake_key()
    path = write_receipt(key, passing_results(scale=2.0))
    receipt = json.loads(path.read_text())
    for result in receipt["results"]:
        result["errors"] = {name: 0.0 for name in result["errors"]}
        result["passed"] = True
    receipt["passed"] = True
    path.write_text(json.dumps(receipt))
    with pytest.raises(ValueError, match="tampered"):
        eq.verify_receipt(path, key)

    # Re-sealed by hand, the verdicts still have to follow from the recorded errors.
    receipt = eq.seal_receipt(key, passing_results(scale=2.0), seconds=1.0)
    receipt["passed"] = True
    body = {name: value for name, value in receipt.items() if name != "receipt_sha256"}
    path.write_text(json.dumps({**body, "receipt_sha256": hash_json(body)}))
    with pytest.raises(ValueError, match="verdicts disagree"):
        eq.verify_receipt(path, key)


def test_a_failed_receipt_is_refused(receipts: Path, monkeypatch):
    key = fake_key()
    write_receipt(key, passing_results(scale=2.0))
    monkeypatch.setattr(eq, "device_key", lambda device: key)
    with pytest.raises(ValueError, match="FAILED equivalence run"):
        select_attn_implementation("triton_fa2", "cuda")


def test_cpu_is_refused_even_with_a_passed_receipt(receipts: Path, monkeypatch):
    key = fake_key()
    write_receipt(key, passing_results())
    monkeypatch.setattr(eq, "device_key", lambda device: key)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for device in ("cpu", torch.device("cpu")):
        with pytest.raises(ValueError, match="needs a CUDA device") as error:
            select_attn_implementation("triton_fa2", device)
        assert "no fallback" in str(error.value)
    q = torch.randn(1, 2, 4, 64)
    with pytest.raises(ValueError, match="CUDA tensors"):
        attention(q, q, q, None, "triton_fa2")


def test_gate_cli_refuses_a_machine_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; gpu_check.sh runs the gate itself")
    child = subprocess.run(
        [sys.executable, "-m", "align.kernels.equivalence", "--out", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 2 and "needs a CUDA device" in child.stderr
    assert not (tmp_path / "r.json").exists()
