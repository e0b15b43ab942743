"""One "node" of the simulated two-node ``fit`` (run by test_dp_fit, not collected by pytest).

2 nodes x 2 processes = a 2-stage pipeline x 2 data-parallel replicas, launched the way a
cluster without a scheduler does it: NODE_RANK, MASTER_ADDR and MASTER_PORT in the
environment; Lightning's own launcher starts this node's second process by re-running this
file with LOCAL_RANK set.
Usage: python two_node_fit.py MODEL_DIR EXPORT_DIR
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_lorafusion.parallel.strategy import MultiAdapterPipelineStrategy  # noqa: E402
from lightning_lorafusion.training.datamodule import MultiAdapterDataModule  # noqa: E402
from lightning_lorafusion.training.module import LoRAFusionModule  # noqa: E402
from test_equivalence import tiny_specs  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    model_dir, export_dir = sys.argv[1:3]
    module = LoRAFusionModule(base_model=model_dir, adapters=tiny_specs(), backend="torch",
                              grad_clip=0.0, export_dir=export_dir)
    dm = MultiAdapterDataModule(capacity=128, pad_multiple=8, max_length=48, planner={"window": 2})
    trainer = L.Trainer(
        accelerator="cpu", devices=2, num_nodes=2, max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=MultiAdapterPipelineStrategy(pipeline_size=2, process_group_backend="gloo"),
    )
    trainer.fit(module, datamodule=dm)
    layout = trainer.strategy.layout
    assert (layout.pipeline_size, layout.data_parallel_size) == (2, 2), layout


if __name__ == "__main__":
    main()
