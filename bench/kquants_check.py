"""qwenrt's K-quantizers (qwenrt/gguf/kquants.py) against llama.cpp's own `llama-quantize` (issue 44). Not a test:
a check script that needs a llama.cpp build (tests/test_gguf_kquants.py replays its small fixture without one).

    python bench/kquants_check.py --llama-build LLAMA_SRC/build/bin
    python bench/kquants_check.py --llama-build LLAMA_SRC/build/bin --rows 4 --width 512 --no-builtin \\
        --write-fixture tests/data/kquants_golden.npz

Writes the test tensors to an F32 GGUF (GGUFWriter with a minimal `llama` header: llama-quantize reads only the
hyperparameters, never builds the model), runs `llama-quantize --pure` (every tensor the one type) to Q4_K_M,
Q5_K_M and Q6_K, reads each file back with GGUFReader and compares qwenrt's blocks with llama.cpp's, tensor by
tensor. The tensors: synthetic kinds (normal, heavy-tailed, offset, bf16-rounded, sparse, zero and constant rows,
tiny magnitudes down to fp16's subnormals, one huge outlier per row, integer ties) and, unless --no-builtin, every
matrix of the built-in model qwenrt-tiny (trained weights), flattened to rows of 256. Then a sweep against ggml's
reference quantizers called directly (libggml-base: the functions llama-quantize runs): random rows of several
distributions at every magnitude from 1e-45 to 1e38. Then qwenrt's throughput per type (MB/s of fp32 in, CPU time
of one thread) beside ggml's.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwenrt.gguf.kquants import quantize_q4_k, quantize_q5_k, quantize_q6_k  # noqa: E402

# llama-quantize ftype -> (GGUF type name, qwenrt quantizer, bytes per 256 values, ggml's reference function)
TYPES = {
    "Q4_K_M": ("Q4_K", quantize_q4_k, 144, "quantize_row_q4_K_ref"),
    "Q5_K_M": ("Q5_K", quantize_q5_k, 176, "quantize_row_q5_K_ref"),
    "Q6_K": ("Q6_K", quantize_q6_k, 210, "quantize_row_q6_K_ref"),
}
BUILTIN = Path(__file__).resolve().parents[1] / "qwenrt" / "tiny" / "model" / "model.safetensors"


def synthetic_tensors(rows: int, width: int, seed: int = 0) -> dict[str, np.ndarray]:
    """name -> float32 [rows, width]: the kinds of rows a real checkpoint has, and its edge cases."""
    rng = np.random.default_rng(seed)
    shape = (rows, width)
    normal = rng.standard_normal(shape) * 0.02
    outlier = normal.copy()
    outlier[np.arange(rows), rng.integers(0, width, rows)] = rng.choice([-50.0, 50.0], rows)
    tensors = {
        "normal": normal,
        "heavy": rng.standard_t(2.5, shape) * 0.02,
        "offset": rng.laplace(0.05, 0.02, shape),
        "bf16": _bf16_rounded(normal * 2.5),
        "sparse": normal * (rng.random(shape) < 0.05),
        "edge": _edge_rows(rng, rows, width),
        "tiny": rng.standard_normal(shape) * 10.0 ** rng.uniform(-9, -4, (rows, 1)),
        "outlier": outlier,
        "ties": rng.integers(-16, 17, shape) * 0.125,
    }
    return {name: np.ascontiguousarray(values, dtype=np.float32) for name, values in tensors.items()}


def _bf16_rounded(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def _edge_rows(rng, rows: int, width: int) -> np.ndarray:
    """Row r by r % 8: zeros; constants 0.37, -0.25, 3.0; normal at 1e-6 (fp16 d subnormal) and 3e-9 (d rounds
    to 0); zeros beside normal blocks; largest |x| tied between signs."""
    edge = np.zeros((rows, width))
    for row in range(rows):
        kind = row % 8
        if kind in (1, 2, 3):
            edge[row] = (0.37, -0.25, 3.0)[kind - 1]
        elif kind in (4, 5):
            edge[row] = rng.standard_normal(width) * (1e-6, 3e-9)[kind - 4]
        elif kind == 6:
            edge[row, : width // 2] = rng.standard_normal(width // 2) * 0.1
        elif kind == 7:
            edge[row] = rng.standard_normal(width) * 0.01
            edge[row, ::16] = np.where(np.arange(0, width, 16) % 32 == 0, 1.0, -1.0)
    return edge


def builtin_tensors() -> dict[str, np.ndarray]:
    """The built-in model's matrices (trained bf16 weights) as float32 rows of 256."""
    from safetensors import safe_open

    tensors = {}
    with safe_open(BUILTIN, "pt") as file:
        for name in file.keys():
            values = file.get_tensor(name).float().numpy()
            if values.ndim == 2 and values.size % 256 == 0:
                tensors["tiny." + name.removeprefix("model.").removesuffix(".weight")] = values.reshape(-1, 256)
    return tensors


def write_f32_gguf(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(path, "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(256)
    writer.add_block_count(1)
    writer.add_feed_forward_length(256)
    writer.add_head_count(1)
    writer.add_layer_norm_rms_eps(1e-6)
    for name, values in tensors.items():
        writer.add_tensor(name + ".weight", values)  # llama-quantize quantizes only names ending in "weight"
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_quantize(build: Path, source: Path, ftype: str, out: Path) -> dict[str, np.ndarray]:
    """name -> llama.cpp's blocks [rows, bytes] for every tensor of `source` quantized to `ftype`."""
    from gguf import GGUFReader

    command = [str(build / "llama-quantize"), "--pure", str(source), str(out), ftype, "1"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"llama-quantize failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    blocks = {}
    for tensor in GGUFReader(out).tensors:
        assert tensor.tensor_type.name == TYPES[ftype][0], f"{tensor.name} came out {tensor.tensor_type.name}"
        blocks[tensor.name.removesuffix(".weight")] = np.array(tensor.data)
    return blocks


def compare(tensors, llama_blocks, quantize, block_bytes) -> dict[str, tuple[int, int]]:
    """name -> (blocks that differ, blocks)."""
    result = {}
    for name, values in tensors.items():
        ours = quantize(values).reshape(-1, block_bytes)
        theirs = llama_blocks[name].reshape(-1, block_bytes)
        result[name] = (int((ours != theirs).any(axis=1).sum()), len(ours))
    return result


def _by_group(result: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The built-in model's tensors summed into one line, the synthetic kinds one line each."""
    groups: dict[str, tuple[int, int]] = {}
    for name, (differ, blocks) in result.items():
        group = "qwenrt-tiny (trained)" if name.startswith("tiny.") else name
        before = groups.get(group, (0, 0))
        groups[group] = (before[0] + differ, before[1] + blocks)
    return groups


def ggml_reference(build: Path, reference: str, block_bytes: int):
    """ggml's quantize_row_*_ref as a function [rows, K] float32 -> [rows, K / 256 * block_bytes] uint8."""
    function = getattr(ctypes.CDLL(str(build / "libggml-base.so")), reference)
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]

    def quantize(values: np.ndarray) -> np.ndarray:
        values = np.ascontiguousarray(values, dtype=np.float32)
        out = np.empty((len(values), values.shape[1] // 256 * block_bytes), dtype=np.uint8)
        function(values.ctypes.data, out.ctypes.data, values.size)
        return out

    return quantize


def magnitude_sweep(build: Path, seed: int = 0) -> dict[str, tuple[int, int]]:
    """type -> (blocks that differ from ggml's own function, blocks) over random rows at magnitudes 1e-45 .. 1e38."""
    rng = np.random.default_rng(seed)
    rows = []
    for exponent in range(-45, 39):
        for draw in (rng.standard_normal, lambda size: rng.standard_t(2, size), lambda size: rng.uniform(0, 1, size)):
            rows.append(np.clip(draw(256 * 4) * 10.0 ** exponent, -3e38, 3e38))
    values = np.array(rows, dtype=np.float32)
    result = {}
    for name, quantize, block_bytes, reference in TYPES.values():
        ours = quantize(values).reshape(-1, block_bytes)
        theirs = ggml_reference(build, reference, block_bytes)(values).reshape(-1, block_bytes)
        result[name] = (int((ours != theirs).any(axis=1).sum()), len(ours))
    return result


def throughput(build: Path, seconds: float = 3.0) -> list[str]:
    """MB/s of fp32 in, one thread: qwenrt's quantizers beside ggml's reference ones on N(0, 0.02) [2048, 1024]."""
    values = (np.random.default_rng(1).standard_normal((2048, 1024)) * 0.02).astype(np.float32)
    lines = []
    for name, quantize, block_bytes, reference in TYPES.values():
        ggml_quantize = ggml_reference(build, reference, block_bytes)
        ours = _rate(lambda: quantize(values), values.nbytes, seconds)
        theirs = _rate(lambda: ggml_quantize(values), values.nbytes, seconds)
        lines.append(f"{name}: qwenrt {ours:.1f} MB/s, ggml reference {theirs:.1f} MB/s")
    return lines


def _rate(run, nbytes: int, seconds: float) -> float:
    """MB/s over the best of runs timed in this process's CPU seconds (both sides run on one thread), so that
    other load on a shared machine does not count."""
    best, spent = float("inf"), 0.0
    while spent < seconds:
        start = time.process_time()
        run()
        elapsed = time.process_time() - start
        best, spent = min(best, elapsed), spent + elapsed
    return nbytes / best / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-build", type=Path, required=True,
                        help="llama.cpp's bin/ (llama-quantize, libggml-base.so)")
    parser.add_argument("--rows", type=int, default=64, help="rows of each synthetic tensor")
    parser.add_argument("--width", type=int, default=1024, help="values per row (a multiple of 256)")
    parser.add_argument("--no-builtin", action="store_true", help="leave out the built-in model's weights")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--write-fixture", type=Path, help="save the synthetic inputs and llama.cpp's blocks (npz)")
    args = parser.parse_args()

    synthetic = synthetic_tensors(args.rows, args.width)
    tensors = synthetic | ({} if args.no_builtin else builtin_tensors())
    fixture = {f"input.{name}": values for name, values in synthetic.items()}
    identical = True
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "f32.gguf"
        write_f32_gguf(source, tensors)
        print(f"{len(tensors)} tensors, {sum(v.size for v in tensors.values()):,} values")
        for ftype, (name, quantize, block_bytes, _) in TYPES.items():
            llama_blocks = llama_quantize(args.llama_build, source, ftype, Path(tmp) / f"{ftype}.gguf")
            result = compare(tensors, llama_blocks, quantize, block_bytes)
            differ = sum(d for d, _ in result.values())
            identical &= differ == 0
            print(f"{name}: {differ} of {sum(n for _, n in result.values())} blocks differ from llama-quantize's")
            for group, (d, n) in _by_group(result).items():
                print(f"  {group:32s} {n - d:6d}/{n} identical")
            fixture |= {f"{name}.{tensor}": llama_blocks[tensor] for tensor in synthetic}
    if args.write_fixture:
        np.savez_compressed(args.write_fixture, **fixture)
        print(f"wrote {args.write_fixture} ({args.write_fixture.stat().st_size:,} bytes)")
    for name, (differ, blocks) in magnitude_sweep(args.llama_build).items():
        print(f"{name}: {differ} of {blocks} blocks differ from ggml's own function (magnitudes 1e-45 .. 1e38)")
        identical &= differ == 0
    if not args.no_timing:
        print("\n".join(throughput(args.llama_build)))
    sys.exit(0 if identical else 1)


if __name__ == "__main__":
    main()
