"""Constants every layer shares: the dtypes align computes in, and the token layout the
data layer writes and the model and losses read.

They live below every package so that `align.data` needs neither the model nor the losses,
and so that the config checks a dtype against the list the model and kernels accept.
"""

# Every floating dtype a model, a cache or a kernel may hold or compute in, by torch's name.
DTYPES = ("float32", "bfloat16", "float16")

# A label the losses skip: prompt tokens, padding, and the shared prefix's copies.
IGNORE_INDEX = -100

# segment_ids values: padding, the shared prefix; branches are BRANCH_SEGMENT, +1, ...
PAD_SEGMENT, PREFIX_SEGMENT, BRANCH_SEGMENT = 0, 1, 2
