"""docs/graph.md: its ```python blocks run, in order, in one namespace (in a
subprocess with a time limit, in a scratch directory)."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def python_blocks(text):
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_docs_graph_md_runs(tmp_path):
    blocks = python_blocks((ROOT / "docs" / "graph.md").read_text())
    assert len(blocks) >= 8
    script = tmp_path / "doc.py"
    script.write_text("\n\n".join(blocks))
    env = dict(os.environ)          # conftest.py's PYTHONPATH: the readerlib under test, not the source tree
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "['input/create_recordio_reader', 'input/create_shuffle_reader'" in res.stdout
    assert "layer/Add:0 layer:0 /job:w/device:GPU:1 ['Identity']" in res.stdout
