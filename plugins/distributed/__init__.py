"""Processes: data-parallel training through accelerate (DDP), sharded data, and the collectives features use."""
