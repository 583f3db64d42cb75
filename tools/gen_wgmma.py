"""Write cuda/wgmma_ops.cuh: the inline-PTX wrappers of wgmma.mma_async for the shapes rawflash uses.

The wrappers are pure operand lists (one float per accumulator register), too long and too regular to write by
hand; everything else about wgmma (descriptors, fences, the tile layout) is hand-written in cuda/hopper.cuh. The
output keeps within WIDTH columns: operand lists wrap after a comma, and a PTX string too long for one line
continues on the next through a backslash-newline, which the compiler splices away before it forms tokens, so
each instruction stays one string literal. Run ``python tools/gen_wgmma.py`` after changing SHAPES;
``--check`` (run by tests/test_forms.py) exits non-zero when the file on disk differs from what it would write.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

SHAPES = (32, 64, 80, 96, 112, 128, 144, 160, 176, 192, 256)  # N of m64nNk16: N / 2 accumulator floats a thread
TYPES = (("__half", "f16"), ("__nv_bfloat16", "bf16"))
FP8_SHAPES = (64, 128, 192, 256)  # N of m64nNk32.e4m3: the FP8 rows' key blocks (S = Q K^T), head dims (O += P V)
OUT = Path(__file__).resolve().parents[1] / "cuda" / "wgmma_ops.cuh"
WIDTH = 120  # the longest line the generated header may have (the project's limit for cuda/)
ASM_INDENT = " " * 8  # the PTX strings and operand lists sit inside asm volatile(...)


def _regs(first: int, count: int) -> str:
    return "{" + ", ".join(f"%{first + i}" for i in range(count)) + "}"


def _outs(count: int) -> list[str]:
    return [f'"+f"(d[{i // 4}][{i % 4}])' for i in range(count)]


def _operands(lead: str, items: list[str]) -> str:
    """`lead` (": " for an asm operand section) and the comma-separated items, wrapped after a comma within WIDTH,
    continuation lines indented under the first item."""
    first = ASM_INDENT + lead
    lines, line = [], first
    for k, item in enumerate(items):
        piece = item + ("," if k + 1 < len(items) else "")
        if line not in (first,) and len(line) + 1 + len(piece) > WIDTH:
            lines.append(line)
            line = ASM_INDENT + " " * len(lead) + piece
        else:
            line += ("" if line == first else " ") + piece
    lines.append(line)
    return "\n".join(lines)


def _ptx_string(body: str) -> str:
    """`body` as one C string literal at ASM_INDENT, continued by backslash-newlines (spliced by the compiler before
    tokenising, so the continuation lines start at column 0 and the literal's text is exactly `body`)."""
    text = ASM_INDENT + '"' + body + '"'
    lines = []
    while len(text) > WIDTH:
        cut = text.rfind(" ", 0, WIDTH - 1) + 1  # break after a space, leaving room for the backslash
        lines.append(text[:cut] + "\\")
        text = text[cut:]
    lines.append(text)
    return "\n".join(lines)


def _asm(head: str, ptx: str, outs: list[str], ins: list[str]) -> str:
    """An asm volatile statement: the predicate set-up `head`, the wgmma instruction `ptx`, the operands."""
    return (f'    asm volatile("{head}"\n{_ptx_string(ptx)}\n'
            f'{_operands(": ", outs)}\n{_operands(": ", ins)});')


def _wrapper(declaration: str, n: int, ss: str, rs: str) -> str:
    """A struct `declaration` with its ss and rs members around the asm statements `ss` and `rs`."""
    rows = n // 8
    return (f"{declaration} {{\n"
            f"  static __device__ __forceinline__ void ss(float (&d)[{rows}][4], unsigned long long a, "
            f"unsigned long long b, int acc) {{\n{ss}\n  }}\n"
            f"  static __device__ __forceinline__ void rs(float (&d)[{rows}][4], const u32 (&a)[4], "
            f"unsigned long long b, int acc) {{\n{rs}\n  }}\n"
            "};\n")


def _struct(ctype: str, ptx: str, n: int) -> str:
    nr = n // 2
    op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx}.{ptx}"
    ss = _asm(f"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nr + 2}, 0;\\n",
              f"{op} {_regs(0, nr)}, %{nr}, %{nr + 1}, p, 1, 1, %{nr + 3}, %{nr + 4};\\n}}\\n",
              _outs(nr), ['"l"(a)', '"l"(b)', '"r"(acc)', '"n"(TA)', '"n"(TB)'])
    rs = _asm(f"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nr + 5}, 0;\\n",
              f"{op} {_regs(0, nr)}, {_regs(nr, 4)}, %{nr + 4}, p, 1, 1, %{nr + 6};\\n}}\\n",
              _outs(nr), ['"r"(a[0])', '"r"(a[1])', '"r"(a[2])', '"r"(a[3])', '"l"(b)', '"r"(acc)', '"n"(TB)'])
    return _wrapper(f"template <int TA, int TB> struct Wgmma<{ctype}, {n}, TA, TB>", n, ss, rs)


def _struct_fp8(n: int) -> str:
    nr = n // 2
    op = f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3"
    ss = _asm(f"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nr + 2}, 0;\\n",
              f"{op} {_regs(0, nr)}, %{nr}, %{nr + 1}, p, 1, 1;\\n}}\\n",
              _outs(nr), ['"l"(a)', '"l"(b)', '"r"(acc)'])
    rs = _asm(f"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nr + 5}, 0;\\n",
              f"{op} {_regs(0, nr)}, {_regs(nr, 4)}, %{nr + 4}, p, 1, 1;\\n}}\\n",
              _outs(nr), ['"r"(a[0])', '"r"(a[1])', '"r"(a[2])', '"r"(a[3])', '"l"(b)', '"r"(acc)'])
    return _wrapper(f"template <> struct WgmmaE4m3<{n}>", n, ss, rs)


def render() -> str:
    """The text of cuda/wgmma_ops.cuh."""
    head = f"""// GENERATED by tools/gen_wgmma.py: do not edit. wgmma.mma_async.m64nNk16 with float32 accumulators.
// Wgmma<T, N, TA, TB>::ss: A and B from shared memory (descriptors); ::rs: A from registers (the mma.sync A
// fragment layout, warp w of the warpgroup holding rows 16w..16w+15), B from shared memory. TA / TB = 1 reads
// that operand MN-major (transposed). acc = 0 overwrites d instead of adding to it.
// Accumulator layout: d[j][e] is row 16w + lane/4 + 8(e/2), column 8j + 2(lane%4) + e%2 (mma.sync's C layout,
// repeated over the N/8 column tiles).
// Lines keep within {WIDTH} columns: a PTX string that does not fit continues on the next line after a
// backslash-newline (spliced before tokenising, so each instruction is one literal and its continuation starts
// at column 0).
#pragma once
#include "core.cuh"

namespace rf {{

template <typename T, int N, int TA, int TB> struct Wgmma;

"""
    body = "\n".join(_struct(c, p, n) for c, p in TYPES for n in SHAPES)
    fp8 = """
// FP8: wgmma.mma_async.m64nNk32.f32.e4m3.e4m3. Both shared-memory operands K-major (8-bit types have no
// transpose); ::rs takes A from registers in the 8-bit A layout (thread lane of warp w: row 16w + lane/4
// (+8 in registers 1, 3), columns 4(lane%4)..+3 (+16 in registers 2, 3), one byte each, low byte first).
template <int N> struct WgmmaE4m3;

"""
    body += fp8 + "\n".join(_struct_fp8(n) for n in FP8_SHAPES)
    text = head + body + "\n}  // namespace rf\n"
    too_long = [k + 1 for k, line in enumerate(text.splitlines()) if len(line) > WIDTH]
    assert not too_long, f"lines longer than {WIDTH} columns: {too_long[:5]}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write cuda/wgmma_ops.cuh, the inline-PTX wgmma.mma_async wrappers for the shapes in SHAPES "
                    "and FP8_SHAPES, wrapped within %d columns." % WIDTH)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when cuda/wgmma_ops.cuh differs from the generated text")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print("cuda/wgmma_ops.cuh is out of date: run tools/gen_wgmma.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
