"""Tiny real checkpoints and the in-process engine demo."""
