"""Trainers' weight pushes: vLLM's weight-update sessions, the safetensors-file transfer engine, the worker RPCs."""
