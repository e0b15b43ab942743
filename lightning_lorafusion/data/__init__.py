"""Sample sources, tokenization and packing into Microbatch tensors."""
