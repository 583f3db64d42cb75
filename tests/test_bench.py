"""The benchmark's case lists and ratio pairing (no GPU needed: nothing here times anything)."""
from __future__ import annotations

from rawflash import bench, forms, iomodel


def test_feature_cases_are_the_targets_cases():
    cases = bench.feature_cases()
    names = [(c.name, c.direction) for c in cases]
    assert len(set(names)) == len(names), "one row per (case, direction): the ratios look cases up by name"
    window = next(c for c in cases if c.name == "window (1024, 0), N 16384")
    persistent = next(c for c in cases if c.name.endswith("persistent"))
    assert persistent.opts == window.opts and forms.Switches(**dict(persistent.switches)).persistent is True
    assert all(not c.switches for c in cases if c is not persistent), "every other case runs the defaults"


def test_feature_flops_count_visible_pairs_only():
    window = next(c for c in bench.feature_cases() if c.name == "window (1024, 0), N 16384")
    n, h, d = window.seqlen, window.heads, window.head_dim
    visible = sum(min(i + 1, 1025) for i in range(n))  # query i sees keys i - 1024 .. i
    assert window.flops == 4 * h * d * visible
    dense = iomodel.flops(iomodel.Shape(1, n, n, h, h, d, 2, True), "fwd")
    assert window.flops < dense / 7, "a 1024-key window over 16384 keys is about a sixteenth of causal's pairs"


def test_varlen_lengths_are_fixed_and_in_range():
    lengths = bench.varlen_lengths()
    assert lengths == bench.varlen_lengths() and len(lengths) == 16
    assert all(256 <= n <= 8192 for n in lengths) and len(set(lengths)) > 8


def test_feature_ratios_pair_each_case_with_its_target():
    rows = [{"case": c.name, "direction": c.direction, "kernel_tflops": 100.0 + i}
            for i, c in enumerate(bench.feature_cases())]
    out = {(r["case"], r["direction"]): r for r in bench._feature_ratios(rows)}
    assert out[("window (1024, 0), N 16384, persistent", "fwd")]["vs"] == "dense causal, N 2048"
    assert out[("varlen x16 causal", "fwd")]["vs"].endswith("causal")
    assert out[("softcap 30, N 4096", "bwd")]["vs"] == "plain, N 4096"
    assert "vs" not in out[("plain, N 4096", "fwd")]
