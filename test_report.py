"""report.ipynb re-runs cleanly (reading mode) and shows what the committed results hold."""
import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

HERE = os.path.dirname(os.path.abspath(__file__))


def executed_report():
    nb = nbformat.read(os.path.join(HERE, "report.ipynb"), as_version=4)
    env_before = os.environ.get("REPORT_RERUN")
    os.environ["REPORT_RERUN"] = "0"  # reading mode: CI never re-runs the benchmarks
    try:
        NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": HERE}}).execute()
    finally:
        if env_before is None:
            os.environ.pop("REPORT_RERUN", None)
        else:
            os.environ["REPORT_RERUN"] = env_before
    return nb


def cell_text(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", ""))
        data = output.get("data", {})
        parts.append(data.get("text/markdown", ""))
        parts.append(data.get("text/plain", ""))
    return "\n".join(parts)


@pytest.fixture(scope="module")
def report():
    return executed_report()


def test_report_executes_without_errors(report):
    errors = [o for c in report.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors


def test_every_results_file_is_listed_and_read(report):
    text = "\n".join(cell_text(c) for c in report.cells if c.cell_type == "code")
    for path in glob.glob(os.path.join(HERE, "results", "*.json")):
        name = os.path.join("results", os.path.basename(path))
        assert name in text, f"{name} is not shown in the report"
    if glob.glob(os.path.join(HERE, "results", "*.json")):
        assert "Reading" in text
    plots = sum(1 for c in report.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {}))
    bench_files = [p for p in glob.glob(os.path.join(HERE, "results", "*.json")) if "test-errors" not in p]
    assert plots >= len(bench_files)
