"""The notebooks execute without error, in a kernel running this interpreter, and are up to date."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"


def _builder():
    spec = importlib.util.spec_from_file_location("build_routing_notebook", NOTEBOOKS / "build_routing_notebook.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_routing_notebook_matches_its_builder():
    """The committed .ipynb is what build_routing_notebook.py writes (outputs stripped)."""
    committed = nbformat.read(NOTEBOOKS / "routing.ipynb", as_version=4)
    built = _builder().build()
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in built.cells], (
        "notebooks/routing.ipynb is stale: run `.venv/bin/python notebooks/build_routing_notebook.py`"
    )
    assert all(not c.get("outputs") for c in committed.cells if c.cell_type == "code")


@pytest.mark.parametrize("name", ["routing.ipynb"])
def test_notebook_executes(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    # "python3" is the native kernel: jupyter_client starts it with this interpreter
    # (sys.executable) when ipykernel is installed here, so it sees the same venv.
    client = NotebookClient(nb, kernel_name="python3", timeout=300,
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert f"python {sys.executable}" in text or f"python {pathlib.Path(sys.executable).resolve()}" in text, text[:300]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 4  # one figure per section
