"""Training: the step loop, stage adapters (SFT, DPO), optimizers, reference cache."""
