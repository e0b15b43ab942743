"""One "node" of the simulated two-node launch (run by test_strategy, not collected by pytest).

Lightning's own launcher starts this node's second process by re-running this file with
LOCAL_RANK set; node rank, master address and port come from the environment
(NODE_RANK, MASTER_ADDR, MASTER_PORT), as on a real cluster without a scheduler.
Usage: python two_node_launch.py OUT_DIR
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_lorafusion.parallel.strategy import MultiAdapterPipelineStrategy  # noqa: E402
from tests.parallel.pipeline_case import PipelineCaseModule  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    out_dir = sys.argv[1]
    trainer = L.Trainer(
        accelerator="cpu", devices=2, num_nodes=2, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=MultiAdapterPipelineStrategy(pipeline_size=2, process_group_backend="gloo"),
    )
    trainer.fit(PipelineCaseModule(out_dir, num_stages=2, replicas=2))


if __name__ == "__main__":
    main()
