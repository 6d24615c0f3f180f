"""Arrow columns built from numpy buffers equal ``pyarrow.array``'s, and a training process that
records steps never imports pandas."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest

from stragglerwatch.record.arrowcols import column

CASES = [
    (pa.int32(), [1, -2, 3, None, 0]),
    (pa.int64(), [2**40, None, -1]),
    (pa.float64(), [0.5, float("nan"), None, 1e-9]),
    (pa.bool_(), [True, False, None, True, True, False, False, True, True]),
    (pa.string(), ["host", "", None, "cuda", "é ü"]),
    (pa.list_(pa.int32()), [[0, 1], [], None, [7]]),
    (pa.list_(pa.float64()), [[0.25], [], [float("nan"), 2.0], None]),
]


@pytest.mark.parametrize(("type_", "values"), CASES, ids=[str(t) for t, _ in CASES])
def test_a_column_equals_pyarrows_own(type_: pa.DataType, values: list) -> None:
    built = column(values, type_)
    built.validate(full=True)
    expected = pa.array(values, type=type_)
    assert built.type == expected.type and built.null_count == expected.null_count
    assert built.to_pylist() == pytest.approx(expected.to_pylist(), nan_ok=True) if type_ == pa.float64() else \
        str(built.to_pylist()) == str(expected.to_pylist())  # fmt: skip


@pytest.mark.parametrize(("type_", "values"), CASES, ids=[str(t) for t, _ in CASES])
def test_an_empty_column(type_: pa.DataType, values: list) -> None:
    built = column([], type_)
    built.validate(full=True)
    assert len(built) == 0 and built.type == type_


def test_an_unknown_type_is_refused() -> None:
    with pytest.raises(TypeError, match="no column builder"):
        column([1], pa.int8())


def test_recording_steps_does_not_import_pandas(tmp_path) -> None:
    code = textwrap.dedent(f"""
        import sys, torch, torch.distributed as dist
        from torch import nn
        import stragglerwatch
        dist.init_process_group("gloo", store=dist.FileStore({str(tmp_path / "store")!r}, 1), rank=0, world_size=1)
        model = nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        watch = stragglerwatch.attach(model, {str(tmp_path / "run")!r}, optimizer=opt)
        for _ in range(30):
            model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
        watch.flush()
        watch.close()
        assert watch.stats()["steps_written"] == 30, watch.stats()
        print("pandas" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False", "the training process imported pandas"
