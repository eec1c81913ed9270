"""Reproducible benchmarks: each script prints a table (ratios against a baseline measured in the same run) and
writes JSON to `benchmarks/results/NAME.json` (or `--json PATH`). Run one with `python -m benchmarks.NAME`
(or `python benchmarks/NAME.py`), all with `make bench`; `--quick` is a seconds-long smoke run."""
