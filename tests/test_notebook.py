"""notebooks/quickstart.ipynb runs top to bottom (nbclient, a real kernel, CPU) and is kept
without outputs in the repository."""

from __future__ import annotations

import os
import time
from pathlib import Path

import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    cache = os.environ.get("KSANA_TEST_JAX_CACHE", str(Path.home() / ".cache/ksana-jax/jax"))
    monkeypatch.setenv("KSANA_JAX_COMPILATION_CACHE", cache)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    start = time.perf_counter()
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    ).execute()
    print(f"notebook ran in {time.perf_counter() - start:.0f}s")
    text = "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
    )
    assert "runtime: CPU" in text
    assert "Paris" in text  # the chat cell's greedy answer
    assert "prefix cache:" in text and "batch 8:" in text
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 1  # the throughput plot
