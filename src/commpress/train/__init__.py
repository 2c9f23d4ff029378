"""The reference trainer: data, the 3D-parallel training loop, checkpoints."""
