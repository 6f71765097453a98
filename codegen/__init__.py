"""Triton kernels and their launchers, one kernel family per module. No nn.Module here."""
