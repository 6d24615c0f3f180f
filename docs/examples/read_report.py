"""Read a run without torch: write a synthetic run of 16 ranks with one straggler (the real log
format), load its steps, analyse it and read the JSON report as typed dataclasses.

    python docs/examples/read_report.py
"""

import json
import subprocess
import sys

import stragglerwatch
from stragglerwatch.analysis.reportschema import Report

cli = [sys.executable, "-m", "stragglerwatch"]  # the same as the stragglerwatch command
subprocess.run([*cli, "simulate", "sim-run", "--ranks", "16", "--steps", "400",
                "--straggler", "5:0.2:150:data"], check=True)  # rank 5, 20% busier from step 150

steps = stragglerwatch.load_run("sim-run")       # one row per rank and step: a pandas DataFrame
print(steps.groupby("rank")["busy_s"].median().round(4).to_string())

analysis = subprocess.run([*cli, "analyze", "sim-run", "--format", "json"],
                          check=True, capture_output=True, text=True)
report = Report.from_dict(json.loads(analysis.stdout))
for s in report.stragglers:
    print(f"rank {s.rank}: cause {s.cause}, {s.slowdown:.2f}x its peers' busy time from step {s.first_step}")
assert [s.rank for s in report.stragglers] == [5]
assert report.to_dict() == json.loads(analysis.stdout)  # the same JSON back
