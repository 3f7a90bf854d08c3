"""Constants every layer shares: the dtypes align computes in, the token layout the
data layer writes and the model and losses read, and the CPU instruction sets a run may
pin its math libraries to.

They live below every package so that `align.data` needs neither the model nor the losses,
and so that the config checks a dtype against the list the model and kernels accept.
"""

# Every floating dtype a model, a cache or a kernel may hold or compute in, by torch's name.
DTYPES = ("float32", "bfloat16", "float16")

# A label the losses skip: prompt tokens, padding, and the shared prefix's copies.
IGNORE_INDEX = -100

# segment_ids values: padding, the shared prefix; branches are BRANCH_SEGMENT, +1, ...
PAD_SEGMENT, PREFIX_SEGMENT, BRANCH_SEGMENT = 0, 1, 2

# run.cpu_isa: the variable each CPU math library reads at start-up to cap the instruction
# set it dispatches to (torch's own kernels, MKL's reproducible branch, oneDNN), and the
# capability torch then reports.
CPU_ISAS = {
    "avx2": {
        "env": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
        "torch_capability": "AVX2",
    },
    "avx512": {
        "env": {
            "ATEN_CPU_CAPABILITY": "avx512",
            "MKL_CBWR": "AVX512",
            "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        },
        "torch_capability": "AVX512",
    },
}
