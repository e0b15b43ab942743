"""LightningModule, LightningDataModule, per-adapter optimizers and callbacks."""
