"""One MoE block of Qwen3.5-35B-A3B's shape (256 experts, top 8, hidden 2048, expert and shared expert 512) with
random int4 weights in groups of 64 (~400 MB, built in memory: no checkpoint), natively at prefill sizes: the
grouped int4 experts (kernels/cpu_moe_gemm.cpp) against the per-expert GEMV calls they replace, interleaved in one
process. Not a test: a benchmark.

    python bench/moe_block.py                      # 512 and 64 rows, medians of 5
    python bench/moe_block.py --rows 512 --reps 3

The grouped path starts at 4 rows per expert on average (512 rows: 16; 64 rows: 2, where both take the
per-expert calls: kGroupedRows in kernels/cpu_moe.cpp). GFLOP per call: 2·rows·(top_k + 1)·3·hidden·intermediate
(gate, up and down of the routed and the shared expert; the router's 2·rows·hidden·257 besides), ~29 at 512 rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwenrt import native  # noqa: E402
from qwenrt.kernels import cpu_kernels, cpu_level  # noqa: E402
from qwenrt.quant import QuantLinear, QuantSpec  # noqa: E402

HIDDEN, EXPERTS, TOP_K, INTERMEDIATE, GROUP = 2048, 256, 8, 512, 64


def int4(g: torch.Generator, *shape: int) -> QuantLinear:
    """A random int4 weight [*shape] (stored layout, groups of GROUP), scales ~ a 0.02-std weight's."""
    *lead, n, k = shape
    codes = torch.randint(0, 256, (*lead, n, k // 2), generator=g, dtype=torch.uint8)
    scales = (torch.rand(*lead, n, k // GROUP, generator=g) * 0.01 + 0.002).bfloat16()
    zeros = (torch.randn(*lead, n, k // GROUP, generator=g) * 0.002).bfloat16()
    return QuantLinear(codes, scales, QuantSpec(4, GROUP), k, zeros)


def blocks(kernels):
    """The block bound twice: grouped prefill (the default) and the per-expert calls."""
    g = torch.Generator().manual_seed(0)
    gate_up, down = int4(g, EXPERTS, 2 * INTERMEDIATE, HIDDEN), int4(g, EXPERTS, HIDDEN, INTERMEDIATE)
    banks = [native.expert_bank(kernels, w) for w in (gate_up, down)]
    router = kernels.Projection("bf16", [(torch.randn(n, HIDDEN, generator=g) * 0.02).bfloat16()
                                         for n in (EXPERTS, 1)], [], [], 0)
    shared = [int4(g, 2 * INTERMEDIATE, HIDDEN), int4(g, HIDDEN, INTERMEDIATE)]
    gu = shared[0]
    shared_gate_up = kernels.Projection("q4", [gu.qweight[:INTERMEDIATE], gu.qweight[INTERMEDIATE:]],
                                        [gu.scales[:INTERMEDIATE], gu.scales[INTERMEDIATE:]],
                                        [gu.zeros[:INTERMEDIATE], gu.zeros[INTERMEDIATE:]], GROUP)
    shared_down = native.bind(kernels, [shared[1]])
    args = (router, *banks, shared_gate_up, shared_down, TOP_K)
    return {"grouped": kernels.MoE(*args), "per-expert": kernels.MoE(*args, grouped=False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 64])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("bench/moe_block.py: the native kernels are off or failed to build")
    options = blocks(kernels)
    print(f"kernels {cpu_level()}, {torch.get_num_threads()} threads; 35B-A3B MoE block, int4 g{GROUP}")
    for rows in args.rows:
        x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).bfloat16()
        times = {name: [] for name in options}
        for _ in range(args.reps):
            for name, block in options.items():
                start = time.perf_counter()
                block(x)
                times[name].append(time.perf_counter() - start)
        gflop = 2 * rows * (TOP_K + 1) * 3 * HIDDEN * INTERMEDIATE / 1e9
        for name, ts in times.items():
            t = statistics.median(ts)
            print(f"{rows:4d} rows  {name:10s}  {t * 1e3:7.1f} ms  {gflop / t:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
