"""Scenarios for tests/project/test_scenario_runner.py, run by `support.vllm_runs.run_script` as every engine
scenario is: `python -m support.runner_probe SCENARIO WORKDIR`.

`orphan`: starts a grandchild that inherits stdout and stderr and outlives this process (what Ray's head processes
did after a second, auto-started cluster), writes its pid to WORKDIR/orphan.pid, prints its result and exits.
`hang`: prints its result, then never exits.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    scenario, work = sys.argv[1], Path(sys.argv[2])
    if scenario == "orphan":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        (work / "orphan.pid").write_text(str(child.pid))
    print("SCENARIO_RESULT " + json.dumps({"scenario": scenario}), flush=True)
    if scenario == "hang":
        while True:
            time.sleep(1)


if __name__ == "__main__":
    main()
