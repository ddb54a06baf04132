"""Reading and writing weights: the safetensors reader and writer, sharded checkpoints,
colibri's container stamp, drives (primary and mirrors) and the read buffers."""
