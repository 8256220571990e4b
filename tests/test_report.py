"""report.ipynb re-runs cleanly (reading mode) and shows what the committed results hold.

Executing it needs nbformat, nbclient and a Jupyter kernel, which a machine may lack (GPU images often do):
the report's tests then skip with the reason, and the rest of the suite is collected and runs as usual.
"""
import glob
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

import processes

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root (this file: tests/)


# The report run by nbclient in a process of its own (REPORT_RERUN=0: reading mode, CI never re-runs the benchmarks),
# the executed notebook written to the path given: run in the background (early_processes), as it reads only
# the committed results, which no test writes (test_syncbn.py only when SYNCBN_ERRORS_JSON asks, and atomically).
EXECUTE = """
import sys
import nbclient, nbformat
nb = nbformat.read("report.ipynb", as_version=4)
nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": "."}}).execute()
nbformat.write(nb, sys.argv[1])
"""


EARLY_PROCESSES_FIXTURE = "report"  # the fixture that collects them (conftest.py queues them for its tests)


def early_processes():
    try:
        import nbclient  # noqa: F401
        import nbformat  # noqa: F401
    except ImportError:
        return {}  # the report's tests skip, with the reason
    executed = os.path.join(tempfile.mkdtemp(prefix="report-"), "executed.ipynb")
    return {"report": ([sys.executable, "-c", EXECUTE, executed], dict(os.environ, REPORT_RERUN="0"))}


def executed_report():
    nbformat = pytest.importorskip("nbformat", reason="executing report.ipynb needs nbformat")
    pytest.importorskip("nbclient", reason="executing report.ipynb needs nbclient")
    run = processes.results_of(sys.modules[__name__], timeout=240)["report"]
    assert run.returncode == 0, run.stderr[-3000:]
    executed = run.args[-1]
    try:
        return nbformat.read(executed, as_version=4)
    finally:
        shutil.rmtree(os.path.dirname(executed), ignore_errors=True)


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


@pytest.mark.slow
def test_report_executes_without_errors(report):
    errors = [o for c in report.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors


@pytest.mark.slow
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


# Makes ``import nbformat`` and ``import nbclient`` fail in a Python started with this file's folder on its path.
BLOCK_NOTEBOOK_PACKAGES = """
import sys


class BlockNotebookPackages:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("nbformat", "nbclient"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, BlockNotebookPackages())
"""


@pytest.mark.slow
def test_without_the_notebook_packages_the_report_tests_skip(tmp_path):
    """pytest on a machine without nbformat/nbclient: collection goes on, and the report's tests skip with the
    reason (they used to stop the whole run at collection)."""
    (tmp_path / "sitecustomize.py").write_text(BLOCK_NOTEBOOK_PACKAGES)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", os.path.abspath(__file__), "-k",
                           "not without_the_notebook_packages"], cwd=HERE, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 skipped" in proc.stdout and "needs nbformat" in proc.stdout, proc.stdout[-3000:]
