"""Devices and processes: the device mesh that splits batches and parameters (mesh.py), and the processes of a run,
joined by JAX's distributed runtime, with their logging and how they take turns (processes.py)."""
