"""`hsx demo`, the README's main command: model, chats, coordinator, REST, shards."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hsx.dataset import HiddenStatesDataset

pytestmark = pytest.mark.integration


def test_demo_runs_end_to_end_through_the_coordinator(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The hf engine keeps this quick; the vllm engine is what the rest of the suite runs.
    result = subprocess.run(
        [sys.executable, "-m", "hsx.cli", "demo", "--dir", str(tmp_path), "--samples", "60",
         "--engine", "hf", "--port", str(port)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"dashboard: http://127.0.0.1:{port}/#/jobs/" in result.stderr
    assert "shards:" in result.stderr
    ds = HiddenStatesDataset(tmp_path / "hidden-states")
    assert ds.complete and len(ds) == 60
    assert len(ds.errors()) == 3
    assert ds.verify() == len(ds.records)
    assert (tmp_path / "job.yaml").exists() and (tmp_path / "ledger.sqlite").exists()
