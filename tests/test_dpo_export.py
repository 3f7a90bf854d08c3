"""The DPO stage's export: the trainer, and with it the optimizer state, is gone before the
policy is exported and then evaluated, whose memory projections count no optimizer."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import torch

from align.stages import dpo
from align.train.phases import PhaseMeter


def test_dpo_export_and_evaluation_held_the_optimizer_state(monkeypatch, tmp_path):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    assert optimizer.state, "the optimizer holds state once it has stepped"
    optimizer_alive = weakref.ref(optimizer)
    info = SimpleNamespace(is_main=True)
    session = dpo.Session(info, {}, {}, model, SimpleNamespace(optimizer=optimizer))
    del optimizer
    at_export = []

    def export(policy, info, checkpoint, out):
        gc.collect()
        at_export.append(optimizer_alive())

    monkeypatch.setattr(dpo, "export_policy", export)
    monkeypatch.setattr(dpo, "barrier", lambda: None)
    gated = SimpleNamespace(checkpoint=tmp_path / "sft", arm=SimpleNamespace(policy_dir=tmp_path))
    dpo.export_trained(session, gated, PhaseMeter("cpu"))
    assert at_export == [None]
    assert session.trainer is None and session.model is model
