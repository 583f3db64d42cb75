"""tools/ab_sources.py's --trees plumbing (no GPU: a fake tree's child writes the rows a GPU run would)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ab():
    spec = importlib.util.spec_from_file_location("ab_sources", ROOT / "tools" / "ab_sources.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(d, n, causal, **cols):
    return dict(direction="bwd", dtype="bfloat16", head_dim=d, seqlen=n, causal=causal, **cols)


def test_merge_tree_rows_keys_each_tree_and_its_own_peer_by_case():
    ab = _ab()
    rows = ab.merge_tree_rows({
        "main": [_row(192, 1024, False, cuda=269.0, **{"torch-cudnn": 256.0}), _row(192, 1024, True, cuda=204.0)],
        "new": [_row(192, 1024, True, cuda=221.0), _row(192, 1024, False, cuda="invalid: x",
                                                         **{"cuda check": "why", "torch-cudnn": 260.0})],
    })
    assert [r["causal"] for r in rows] == [False, True], "the first tree's order of cases"
    assert rows[0]["main"] == 269.0 and rows[0]["new"] == "invalid: x" and rows[0]["new check"] == "why"
    assert rows[0]["torch-cudnn (main)"] == 256.0 and rows[0]["torch-cudnn (new)"] == 260.0
    assert rows[1] == _row(192, 1024, True, main=204.0, new=221.0)


FAKE_CHILD = '''
import argparse, json, os, sys
from pathlib import Path
ap = argparse.ArgumentParser()
for a in ("--sources", "--direction", "--dtype", "--head-dims", "--seqlens", "--causal", "--repeats", "--out"):
    ap.add_argument(a)
ap.add_argument("--no-peer", action="store_true")
a = ap.parse_args()
assert "RAWFLASH_CUDA_DIR" not in os.environ and os.environ["PYTHONPATH"].split(os.pathsep)[0] == os.getcwd()
rows = [dict(direction=a.direction, dtype=a.dtype, head_dim=int(d), seqlen=int(n), causal=False, cuda=float(TFLOPS))
        for d in a.head_dims.split(",") for n in a.seqlens.split(",")]
Path(a.out).write_text(json.dumps(dict(sources=["cuda"], rows=rows)))
'''


def test_trees_run_each_tree_in_its_own_process_with_its_own_rawflash(tmp_path, monkeypatch, capsys):
    ab = _ab()
    trees = []
    for name, tflops in (("old", 100), ("new", 125)):
        (tmp_path / name / "tools").mkdir(parents=True)
        (tmp_path / name / "tools" / "ab_sources.py").write_text(FAKE_CHILD.replace("TFLOPS", str(tflops)))
        trees.append(str(tmp_path / name))
    out = tmp_path / "merged.json"
    monkeypatch.setenv("RAWFLASH_CUDA_DIR", "/nonexistent")  # the parent's choice does not reach the children
    monkeypatch.setattr(sys, "argv", ["ab_sources.py", "--trees", "--sources", ",".join(trees), "--direction",
                                      "bwd", "--head-dims", "192", "--seqlens", "1024,4096", "--causal", "false",
                                      "--no-peer", "--out", str(out)])
    ab.main()
    rows = json.loads(out.read_text())["rows"]
    names = json.loads(out.read_text())["sources"]
    assert [r["seqlen"] for r in rows] == [1024, 4096]
    assert all(r[names[0]] == 100.0 and r[names[1]] == 125.0 for r in rows)
    assert "1.250x" in capsys.readouterr().out


def test_trees_refuse_decode(monkeypatch):
    ab = _ab()
    monkeypatch.setattr(sys, "argv", ["ab_sources.py", "--trees", "--decode"])
    with pytest.raises(SystemExit) as err:
        ab.main()
    assert err.value.code == 2
