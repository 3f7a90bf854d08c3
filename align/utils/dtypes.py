"""The torch dtype of each name in align.constants.DTYPES: one table for every layer."""

from __future__ import annotations

import torch

from align.constants import DTYPES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
