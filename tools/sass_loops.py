"""Count the key loop's instructions of wgmma kernels in SASS, offline, for one source folder or two side by
side. A contributor runs it on a change to a Hopper kernel before any GPU run: a change that makes ptxas rebuild
the key loop's wgmma descriptors every step (more R2UR) or adds instructions to the loop shows here, with no GPU
needed. Example:

    python3 tools/sass_loops.py --filter 'fa3_fwd_sm90<__nv_bfloat16, 64' [--against OLD/cuda] [--jobs 2]

Each instantiation of ``forms.all_instantiations('sm_90')`` whose name contains ``--filter`` is compiled to PTX by
NVRTC (as the library does), assembled by ``ptxas`` (the CUDA toolkit's, ``--ptxas``) and disassembled by
``nvdisasm`` (``pip install nvidia-cuda-nvdisasm``, or the toolkit's; ``--nvdisasm``). Of the loops (backward
branches) whose body holds wgmma (HGMMA, or QGMMA for FP8), the one where the softmax's exponentials (MUFU) are
densest is the key loop; the tool prints its instructions, HGMMA (QGMMA), MUFU and R2UR counts. ``--against``
compiles the same name in another source folder (``RAWFLASH_CUDA_DIR``'s meaning); a template argument the other
tree lacks can be dropped with ``--drop POS`` (its position in the name's argument list).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def ptx_of(source: str, name: str, root: str | None) -> str:
    """NVRTC's PTX of one instantiation (compute_90a, the library's options otherwise)."""
    from cupy.cuda import nvrtc

    from rawflash.kernels import compile

    opts = [o.replace("sm_90a", "compute_90a") for o in compile.offline_options("sm_90a") if "ptxas" not in o]
    prog = nvrtc.createProgram(compile.assemble(source, Path(root) if root else None), source, [], [])
    try:
        nvrtc.addNameExpression(prog, name)
        nvrtc.compileProgram(prog, opts)
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return (ptx.decode() if isinstance(ptx, bytes) else ptx).rstrip("\x00")


def sass_of(ptx: str, ptxas: str, nvdisasm: str) -> list[str]:
    """The instructions (without addresses and predicates' spacing) of the PTX's kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        Path(src).write_text(ptx)
        subprocess.run([ptxas, "-arch=sm_90a", src, "-o", cubin], check=True, capture_output=True)
        text = subprocess.run([nvdisasm, "-c", cubin], check=True, capture_output=True, text=True).stdout
    return text.splitlines()


GMMA = ("HGMMA", "QGMMA")  # wgmma on 16-bit and on 8-bit operands


def key_loop(lines: list[str]) -> dict:
    """Counts of the key loop: of the loops holding wgmma (HGMMA; QGMMA for FP8), the one where MUFU is densest."""
    labels, ins = {}, []
    for line in lines:
        m = re.match(r"^\.L_x_(\d+):", line.strip())
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            ins.append(m.group(1).strip())
    op = lambda t: re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]  # noqa: E731
    loops = []
    for i, t in enumerate(ins):
        m = re.search(r"BRA.*\.L_x_(\d+)", t)
        if m and labels.get(m.group(1), 1 << 30) <= i:
            body = ins[labels[m.group(1)]:i + 1]
            if any(op(b) in GMMA for b in body):
                loops.append((labels[m.group(1)], i, Counter(op(b) for b in body)))
    if not loops:
        return {}
    # the softmax's exponentials are densest in the key loop (the tile loops around it add their prologue and
    # epilogue; a loop of the first or last key block has few)
    s, e, c = max(loops, key=lambda lp: (lp[2]["MUFU"] / (lp[1] - lp[0] + 1), lp[0] - lp[1]))
    gmma = {g: c[g] for g in GMMA if c[g]}
    return {"instructions": e - s + 1, **gmma, "MUFU": c["MUFU"], "R2UR": c["R2UR"]}


def _one(item):
    source, name, other, root, against, ptxas, nvdisasm = item
    out = [key_loop(sass_of(ptx_of(source, name, root), ptxas, nvdisasm))]
    if against:
        out.append(key_loop(sass_of(ptx_of(source, other, against), ptxas, nvdisasm)))
    return name, out


def _find(tool: str, *patterns: str) -> str:
    """``tool`` on PATH, else the newest match of ``patterns`` (a toolkit, the nvidia-cuda-nvdisasm wheel)."""
    found = shutil.which(tool) or next((sorted(glob.glob(p))[-1] for p in patterns if glob.glob(p)), None)
    return found or tool


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--filter", required=True, help="a substring of the instantiations' names")
    ap.add_argument("--cuda-dir", default=None, help="the source folder (default: the installed one)")
    ap.add_argument("--against", default=None, help="another source folder, compiled side by side")
    ap.add_argument("--drop", type=int, action="append", default=[],
                    help="template argument positions the --against tree does not have")
    ap.add_argument("--ptxas", default=_find("ptxas", "/usr/local/cuda*/bin/ptxas"), help="the ptxas to run")
    ap.add_argument("--nvdisasm", default=_find("nvdisasm",
                                                f"{sysconfig.get_paths()['purelib']}/nvidia/cu*/bin/nvdisasm",
                                                "/usr/local/cuda*/bin/nvdisasm"))
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="compiles side by side")
    args = ap.parse_args()
    from rawflash.kernels import forms

    items = []
    for lau in forms.all_instantiations("sm_90"):
        if args.filter in lau.name_expression and lau.compile_arch("sm_90") == "sm_90a":
            kernel, rest = lau.name_expression.split("<", 1)
            kept = [a for i, a in enumerate(rest[:-1].split(", ")) if i not in args.drop]
            items.append((lau.source, lau.name_expression, f"{kernel}<{', '.join(kept)}>", args.cuda_dir,
                          args.against, args.ptxas, args.nvdisasm))
    if not items:
        print(f"no sm_90a instantiation matches {args.filter!r}")
        return 1
    with ProcessPoolExecutor(args.jobs) as pool:
        for name, counts in pool.map(_one, items):
            cells = ["  ".join(f"{k} {v}" for k, v in c.items()) or "no wgmma loop" for c in counts]
            same = "" if len(counts) == 1 else ("  (same)" if counts[0] == counts[1] else "  <-- differs")
            print(f"{name}\n    {' | '.join(cells)}{same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
