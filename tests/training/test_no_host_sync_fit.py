"""The module's training forward, through the real Trainer, runs without a nonzero() sync and
with the packed max_seqlen (the metadata survives the sealed batch and its device transfer)."""

from lightning_lorafusion.data.microbatch import IGNORE_INDEX
from lightning_lorafusion.training.module import LoRAFusionModule

from test_equivalence import fit_joint, tiny_specs


def test_module_training_forward_has_no_nonzero_sync(tiny_model_dir, sync_guard, monkeypatch):
    """Through the real Trainer (sealed batches, transfer_batch_to_device): every training
    forward runs with nonzero() forbidden and gets the packed max_seqlen."""
    guard = sync_guard
    loss_sums = LoRAFusionModule.loss_sums
    seen = []

    def guarded(module, mb, **kwargs):
        seen.append((mb.max_seqlen, int((mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).max()), mb.num_label_rows,
                     int((mb.labels != IGNORE_INDEX).sum())))
        return guard.run(loss_sums, module, mb, **kwargs)

    monkeypatch.setattr(LoRAFusionModule, "loss_sums", guarded)
    module, _, _ = fit_joint(tiny_model_dir, tiny_specs())
    assert seen and module.global_step > 0
    for packed_max, device_max, packed_rows, device_rows in seen:
        assert packed_max == device_max and packed_rows == device_rows
    assert guard.max_seqlens and all(m is not None for m in guard.max_seqlens)
