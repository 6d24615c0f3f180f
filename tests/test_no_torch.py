"""Analysis hosts without torch: importing stragglerwatch, the command line's analysis commands and
the dashboard must work where importing torch fails (only ``attach`` needs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "tests" / "data" / "whatif-traces"

# every import of torch fails, as on a host without it
SCRIPT = r"""
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("no torch on this host")
sys.meta_path.insert(0, NoTorch())
out = sys.argv[1]
import stragglerwatch
from stragglerwatch.cli import main
assert main(["simulate", out + "/run", "--ranks", "8", "--steps", "120", "--straggler", "3:1.3:40"]) == 0
assert main(["analyze", out + "/run", "--format", "json", "--out", out + "/r.json"]) == 0
assert main(["analyze", out + "/run", "--format", "html", "--out", out + "/r.html"]) == 0
assert main(["summary", out + "/run"]) == 0
assert main(["analyze", sys.argv[2], "--meta", sys.argv[3], "--format", "json", "--out", out + "/t.json"]) == 0
from stragglerwatch.presentation.dashboard import create_app
from stragglerwatch.presentation.dashboard.sources import RunDirSource
create_app(RunDirSource(out + "/run"))
stragglerwatch.load_run(out + "/run")
try:
    stragglerwatch.attach
except ImportError:
    print("attach needs torch")
assert "torch" not in sys.modules
print("ok")
"""


def test_analysis_commands_and_dashboard_run_without_torch(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), str(TRACES / "trace-ST.parquet"), str(TRACES / "meta-ST.yaml")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-2:] == ["attach needs torch", "ok"], proc.stdout[-2000:]
    assert [s["rank"] for s in json.loads((tmp_path / "r.json").read_text())["stragglers"]] == [3]
    assert json.loads((tmp_path / "t.json").read_text())["whatif_verdict"] == "stage imbalance"


# neither torch nor the dashboard's dash, plotly (and flask, werkzeug) can be imported: the base install
NO_EXTRAS = r"""
import sys
class NoExtras:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "dash", "plotly", "flask", "werkzeug"):
            raise ImportError(f"no {name} on this host")
sys.meta_path.insert(0, NoExtras())
out = sys.argv[1]
import stragglerwatch
from stragglerwatch.cli import main
assert main(["simulate", out + "/run", "--ranks", "4", "--steps", "60"]) == 0
assert main(["dashboard", out + "/run"]) == 2
assert main(["analyze", out + "/run", "--format", "html"]) == 2
try:
    stragglerwatch.attach
except ImportError as exc:
    print(exc, file=sys.stderr)
assert not [m for m in sys.modules if m.split(".")[0] in ("torch", "dash", "plotly", "flask", "werkzeug")]
"""


def test_missing_extras_say_which_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "STRAGGLERWATCH_DEBUG"}
    proc = subprocess.run([sys.executable, "-c", NO_EXTRAS, str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[1:] == [
        "stragglerwatch: error: stragglerwatch dashboard needs dash and plotly, which are not installed: "
        'pip install "stragglerwatch[dashboard]"',
        "stragglerwatch: error: ImportError: the HTML report (analyze --format html) needs plotly, which is not "
        'installed: pip install "stragglerwatch[dashboard]" (STRAGGLERWATCH_DEBUG=1 shows where)',
        'stragglerwatch.attach needs torch, which is not installed: pip install "stragglerwatch[train]"',
    ], proc.stderr
    assert not (tmp_path / "run" / "report.html").exists()
