"""Functional decoder, adapter bank, HF weight loading and PEFT export/import."""
