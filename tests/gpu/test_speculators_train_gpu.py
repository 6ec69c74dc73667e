"""speculators' own trainer on an hsx output, end to end, as docs/guides/gpu-node.md shows
it: `hsx export --format speculators`, then the `speculators train` command the export
prints (a few steps; speculators trains only on an accelerator) and the `hsx fix-draft`
it prints after it, then vLLM loads the draft it wrote
as the EAGLE-3 draft of the target and drafts with it (`hsx eval-draft --draft`).

The output is written by hand (tests/unit/test_trainer.py's: random states of the tiny
Llama), so no engine runs for it; acceptance means nothing here, loading and drafting
do. The CPU half (the command as printed builds speculators' draft) runs in `make test`
(tests/unit/test_export.py).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from hsx.cli import main
from tests.unit.test_trainer import make_output


def test_speculators_trains_on_the_export_and_vllm_loads_its_draft(
    tmp_path: Path, tiny_llama: Path, capsys: Any, record: Any
) -> None:
    source = make_output(tmp_path / "hsx", tiny_llama)
    assert main(["export", str(source), str(tmp_path / "spec"), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    command = shlex.split(printed["train_command"])
    command[0] = str(Path(sys.executable).parent / "speculators")
    if not Path(command[0]).exists():  # the GPU bundle installs no console scripts
        command[:1] = [sys.executable, "-m", "speculators"]
    trained = subprocess.run([*command, "--max-steps", "5", "--epochs", "1"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=900, check=False)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    saved = sorted(p.parent for p in (tmp_path / "spec-draft").rglob("config.json"))
    assert saved, list((tmp_path / "spec-draft").rglob("*"))
    draft = saved[-1]
    assert main(shlex.split(printed["fix_command"])[1:]) == 0  # two auxiliary layers here
    measured = subprocess.run(
        [sys.executable, "-m", "hsx.cli", "eval-draft", str(source), "--draft", str(draft),
         "--prompts", "4", "--max-tokens", "16", "--json"],
        capture_output=True, text=True, timeout=900, check=False)
    assert measured.returncode == 0, measured.stdout[-3000:] + measured.stderr[-3000:]
    result = json.loads([x for x in measured.stdout.splitlines() if x.startswith('{"k"')][-1])
    record("speculators_train_on_export", draft=str(draft.relative_to(tmp_path)), **result)
    assert result["drafts"] > 0
