"""What the tests share: fixtures' helpers, reference computations and the vLLM scenario scripts.

The test files import from here (`from support.family_helpers import Fam`); pytest puts `tests/` on the path, and
the scenario processes get it in PYTHONPATH (`support.vllm_runs.PYTHONPATH`) and run as
`python -m support.vllm_scenarios ...`. `support.needs` declares which helpers start a vLLM engine, import vLLM or
render in Chromium; `tests/conftest.py` marks the tests that reach them.
"""
