"""Read a run without torch: write a synthetic run of 16 ranks with one straggler (the real log
format), load its steps, analyse it from Python and read the typed report, its text and its JSON.

    python docs/examples/read_report.py
"""

import json
import subprocess
import sys

import stragglerwatch

cli = [sys.executable, "-m", "stragglerwatch"]  # the same as the stragglerwatch command
subprocess.run([*cli, "simulate", "sim-run", "--ranks", "16", "--steps", "400",
                "--straggler", "5:1.2:150:data"], check=True)  # rank 5, 20% busier from step 150

steps = stragglerwatch.load_run("sim-run")       # one row per rank and step: a pandas DataFrame
print(steps.groupby("rank")["busy_s"].median().round(4).to_string())

report = stragglerwatch.analyze("sim-run")       # what `stragglerwatch analyze sim-run` reports
for s in report.stragglers:
    print(f"rank {s.rank}: cause {s.cause}, {s.slowdown:.2f}x its peers' busy time from step {s.first_step}; "
          f"fixing it saves {s.saves_seconds:.1f} s")
assert [s.rank for s in report.stragglers] == [5]
print(report.to_text())                           # the command's text report

as_json = subprocess.run([*cli, "analyze", "sim-run", "--format", "json"],
                         check=True, capture_output=True, text=True)
assert report.to_dict() == json.loads(as_json.stdout)  # the command's JSON is the same report
