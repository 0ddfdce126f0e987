"""`hpcpipe trace summary|export|plot|compare`: output, files, and exit 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import pytest
from conftest import ROOT, clean_environ
from trace_synth import V_SHAPE, one_f_one_b, write_synthetic

from hpcpipe.cli import main
from hpcpipe.schedules.simulate import CostModel


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    a, _ = write_synthetic(
        d / "a.h5", one_f_one_b(2, 2), CostModel(), steps=2, peak_bytes=[2 << 20, 1 << 20]
    )
    b, _ = write_synthetic(d / "b.h5", V_SHAPE, CostModel(), steps=2, peak_bytes=[1 << 20, 1 << 20])
    return d, a, b


def test_summary_and_json(traces, capsys):
    d, a, _ = traces
    out = d / "a.json"
    assert main(["trace", "summary", str(a), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pipeline bubble: measured 33.3%, predicted 33.3%" in text
    assert "per step:" in text and "critical path" in text
    data = json.loads(out.read_text())
    assert data["bubble"] == pytest.approx(1 / 3) and data["peak_bytes"] == 2 << 20
    assert main(["trace", "summary", str(a), "--step", "1"]) == 0
    assert "step(s) 1 (1 recorded)" in capsys.readouterr().out


def test_export_plot_compare(traces, capsys):
    d, a, b = traces
    assert main(["trace", "export", str(b), "--chrome", str(d / "b.json")]) == 0
    assert json.loads((d / "b.json").read_text())["traceEvents"]
    assert main(["trace", "plot", str(b), "--png", str(d / "b.png"), "--arrows"]) == 0
    assert (d / "b.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert main(["trace", "compare", str(a), str(b)]) == 0
    text = capsys.readouterr().out
    assert "bubble measured" in text and "peak memory" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("peak memory"))
    assert row.split()[-1] == "0.500"
    # schedule names are shown whole in both tables, however long
    from hpcpipe.analysis.metrics import summarize
    from hpcpipe.io.trace import read_trace

    names = [summarize(read_trace(p)).schedule for p in (a, b)]
    assert max(map(len, names)) > 16, names  # longer than the old fixed column
    assert all(name in text for name in names), text
    assert main(["trace", "table", str(a), str(b)]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in names), table


@pytest.mark.parametrize(
    "make,expect",
    [
        (lambda p: p.write_text("not hdf5"), "is not an HDF5 file"),
        (lambda p: h5py.File(p, "w").close(), "not an hpcpipe trace"),
        (None, "no such file"),
    ],
)
def test_bad_files_exit_2(tmp_path, capsys, make, expect):
    path = tmp_path / "bad.h5"
    if make is not None:
        make(path)
    assert main(["trace", "summary", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ERROR: ") and expect in err and str(path) in err


def test_bad_arguments_exit_2(traces, capsys):
    d, a, _b = traces
    assert main(["trace", "plot", str(a), "--png", str(d / "x.png"), "--step", "9"]) == 2
    assert "step 9" in capsys.readouterr().err
    assert main(["trace", "export", str(a), "--chrome", str(d / "no" / "x.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["trace", "compare", str(a), str(d / "missing.h5")]) == 2


def test_real_entry_point_and_no_mpi_or_matplotlib_on_import(traces):
    _, a, _ = traces
    proc = subprocess.run(
        [sys.executable, "-m", "hpcpipe", "trace", "summary", str(a)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=clean_environ(),
    )
    assert proc.returncode == 0, proc.stderr
    assert "pipeline bubble" in proc.stdout
    code = (
        "import sys, hpcpipe.analysis, hpcpipe.analysis.cli, hpcpipe.io.trace_config; "
        "bad = [m for m in ('mpi4py', 'matplotlib') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=clean_environ(),
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
