"""Constants every layer shares: the dtypes align computes in, the token layout the
data layer writes and the model and losses read, the CPU instruction sets a run may
pin its math libraries to, and the names every configurable choice may take.

They live below every package so that `align.data` needs neither the model nor the losses,
and so that the config checks each choice against the one list its consumer accepts.
"""

# Every floating dtype a model, a cache or a kernel may hold or compute in, by torch's name.
DTYPES = ("float32", "bfloat16", "float16")

# A label the losses skip: prompt tokens, padding, and the shared prefix's copies.
IGNORE_INDEX = -100

# segment_ids values: padding, then each pair of a row in turn: its prefix (the prompt, or a
# plain row's every token) and its chosen and rejected responses. Pair j of a packed row is
# PREFIX_SEGMENT + j * SEGMENTS_PER_PAIR, its responses the two ids after it.
PAD_SEGMENT, PREFIX_SEGMENT = 0, 1
SEGMENTS_PER_PAIR = 3

# batch.layout / ref.layout: how pairs become rows (align.data.loader). `padded`: chosen and
# rejected as two right-padded rows; `shared`: one row per pair, [prompt | chosen |
# rejected], the prompt run once; `packed`: several shared rows' pairs per row, each pair
# blind to the others. The names also tag a reference cache's forward path.
PAIR_LAYOUTS = ("padded", "shared", "packed")

# run.cpu_isa: the variable each CPU math library reads at start-up to cap the instruction
# set it dispatches to (torch's own kernels, MKL's reproducible branch, oneDNN), and the
# capability torch then reports. MKL's branch is strict: its matrix products then give the
# same bits whatever the number of threads, so a rank of 2 threads matches a rank of 1.
CPU_ISAS = {
    "avx2": {
        "env": {
            "ATEN_CPU_CAPABILITY": "avx2",
            "MKL_CBWR": "AVX2,STRICT",
            "ONEDNN_MAX_CPU_ISA": "AVX2",
        },
        "torch_capability": "AVX2",
    },
    "avx512": {
        "env": {
            "ATEN_CPU_CAPABILITY": "avx512",
            "MKL_CBWR": "AVX512,STRICT",
            "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        },
        "torch_capability": "AVX512",
    },
}

# model/ref.attn_implementation: the backends align.model.attention registers, in its order.
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "triton_fa2", "flex")
# The backends whose mask keeps the shared and packed layouts' segments apart.
SEGMENT_MASK_ATTENTION = ("sdpa", "eager", "flex")
# The backends that run those layouts' rows as one unpadded stream of exact attention
# pieces (align.kernels.pieces) rather than padded rows under a dense mask.
STREAMED_ATTENTION = ("sdpa",)
# The backends proven by an equivalence gate before they run: the gate's module (its CLI),
# the source file its receipt is keyed by, and the variable a stage reads its receipt at.
GATED_ATTENTION = {
    "triton_fa2": (
        "align.kernels.equivalence",
        "align/kernels/flash_attn.py",
        "ALIGN_KERNEL_RECEIPT",
    ),
    "flex": ("align.kernels.flex_gate", "align/kernels/flex.py", "ALIGN_FLEX_RECEIPT"),
}
# The backends whose backward runs on CUDA only (torch's FlexAttention): they score on the CPU.
CUDA_BACKWARD_ATTENTION = ("flex",)

# dpo.loss: the pair losses align.losses.dpo registers, in its order; label smoothing
# (conservative DPO) applies to SMOOTHABLE_LOSSES only.
DPO_LOSSES = ("sigmoid", "ipo", "hinge")
SMOOTHABLE_LOSSES = ("sigmoid",)

# optimizer.name: torch's AdamW (float32 moments), bitsandbytes' 8-bit AdamW (align.train.optim).
OPTIMIZERS = ("adamw", "adamw8bit")

# run.device: what align.utils.dist.init_distributed can pin a rank to.
DEVICES = ("cpu", "cuda")

# run.heavy_lock: queue behind another heavy stage on this host, refuse to start, or take no lock.
LOCK_MODES = ("wait", "refuse", "off")

# data.format: the row layouts align.data.formats reads (its READERS, in this order).
DATA_FORMATS = ("argilla", "steppairs", "pairs", "ultrafeedback")
# data.truncation: how align.data.tokenize cuts a pair that does not fit seq_len.
TRUNCATION_POLICIES = ("prompt_left_response_right",)

# The selection rules align.stages.select can apply (config/selection.toml `rule`).
SELECTION_RULES = ("paired_accuracy",)

# The smallest vocabulary the byte-level BPE of align.model.tokenizer trains: 256 bytes + 4
# special tokens (the tiny default's vocab_size).
MIN_VOCAB_SIZE = 260

# Set by align.launch for the workers it starts: its pid, whose memory a stage counts as
# the job's (align.train.phases).
LAUNCHER_PID_ENV = "ALIGN_LAUNCHER_PID"
