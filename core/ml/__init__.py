"""Rank side: the maths and model code a stage worker computes with (imported under torchrun)."""
