"""qwenrt's GGUF import and export checked against llama.cpp itself (issue 44, checks (a)-(c)). Not a test: a check
script that needs a llama.cpp build.

    python bench/gguf_check.py --llama-cpp LLAMA_SRC --llama-build LLAMA_SRC/build/bin
    python bench/gguf_check.py --models dense --types BF16,Q4_K_M --tokens 8

LLAMA_SRC is a llama.cpp source tree with Qwen3.5 support (the one the `llama-cpp-python==0.3.36` sdist vendors:
its convert_hf_to_gguf.py and gguf-py run from there) and --llama-build its bin/ (llama-quantize, libllama.so),
built as BUILD_COMMAND below. The llama.cpp Python bindings come from the sdist beside the tree (LLAMA_SRC/../..),
or --llama-python.

Tiny random Qwen3.5 checkpoints (bf16 safetensors over the real 248,320-token vocabulary, which the converter
needs to recognise the tokenizer): `dense` (Hv > Hk, so the V-head reorder is exercised), `moe` (untied head) and
`mtp` (dense with an MTP head). Hidden sizes are multiples of 256 (else llama-quantize silently falls back to
Q5_0/Q8_0 for K and IQ types), key and value head sizes are equal (llama.cpp's qwen35 loader takes the value head
size from ssm.state_size), and DeltaNet's k rows are a perturbed copy of its q rows (independent random q and k make
the output a sum of near-cancelling products that amplifies any rounding).

Rows of the table, per model and GGUF type (max|diff| / max|ref| over the prompt's logits and those of a greedy
continuation, teacher-forced on llama.cpp's tokens; greedy = steps agreeing before the first difference):
  (a) qwenrt  = llama.cpp's F32 graph on the file dequantized by llama.cpp itself (`llama-quantize
                --allow-requantize FILE OUT F32`: llama.cpp's exact answer for that file; its own quantized kernels
                round activations to bf16/q8_0/q8_K first, shown as `llama.cpp kernels`)
      BF16: qwenrt on the file = qwenrt on the safetensors; mtp: qwenrt's MTP head on the file against the same
      head on the F32 dequantization (on the safetensors for BF16)
  (b) `qwenrt convert CKPT out.gguf --type T`: llama.cpp's F32 graph on the export against qwenrt on the checkpoint,
      beside llama.cpp's own file of that type; qwenrt on its export = llama.cpp's F32 graph on it
  (c) qwenrt on its export against qwenrt on the checkpoint (bf16: identical)
(b) and (c) run once `qwenrt convert` exists; until then their rows say so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BUILD_COMMAND = ("cmake -S LLAMA_SRC -B LLAMA_SRC/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON "
                 "-DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=ON && cmake --build LLAMA_SRC/build --target llama-quantize "
                 "llama-completion llama-bench (LLAMA_SRC: vendor/llama.cpp of the llama-cpp-python==0.3.36 sdist)")
CONVERTER_TYPES = ("BF16", "F16", "F32")  # convert_hf_to_gguf.py --outtype
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_K_M", "Q6_K", "IQ4_XS")  # llama-quantize from the F32 file
EXPORT_TYPES = ("bf16", "q8_0", "q4_0", "q4_k_m")  # qwenrt convert --type
BOUND_FILE = 1e-3  # qwenrt against llama.cpp's F32 graph on the same file
BOUND_EXACT = 1e-4  # qwenrt against qwenrt (the BF16 file against the bf16 safetensors)
PROMPT = "The capital of France is Paris. The capital of Germany is Berlin, and the capital of Italy is"

# Shapes: hidden and every matrix's input a multiple of 256, dk == dv, Hv > Hk, 3 DeltaNet layers + 1 attention.
TEXT = dict(vocab_size=248320, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
            linear_value_head_dim=64, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
            eos_token_id=[248046, 248044], pad_token_id=248044,
            rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                 mrope_section=[3, 3, 2], mrope_interleaved=True))
DENSE = dict(TEXT, intermediate_size=512, tie_word_embeddings=True)
MOE = dict(TEXT, moe_intermediate_size=256, shared_expert_intermediate_size=256, num_experts=8, num_experts_per_tok=3,
           tie_word_embeddings=False)
MODELS = ("dense", "moe", "mtp")
CHECKPOINT_VERSION = "1"  # bump when the checkpoints change, so cached ones are rebuilt


@dataclass
class Row:
    model: str
    check: str
    type: str
    size: int | None = None  # file bytes
    rel: float | None = None  # max|diff| / max|ref|
    greedy: str = ""
    bound: float | None = None
    note: str = ""

    @property
    def verdict(self) -> str:
        if self.bound is None or self.rel is None:
            return ""
        return "ok" if self.rel <= self.bound and not self.greedy_differs else "FAIL"

    @property
    def greedy_differs(self) -> bool:
        agreed, _, total = self.greedy.partition("/")
        return bool(total) and agreed != total


@dataclass
class Timer:
    seconds: dict = field(default_factory=dict)

    def add(self, stage: str, start: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start


class CheckError(Exception):
    """A tool of the check failed: one line for the table or the exit message."""


# ---------------------------------------------------------------------------------------------------- llama.cpp

@dataclass(frozen=True)
class LlamaCpp:
    source: Path  # the llama.cpp tree: convert_hf_to_gguf.py, gguf-py/
    bin: Path  # llama-quantize, libllama.so
    python: Path  # the directory holding the llama_cpp bindings package

    @staticmethod
    def add_options(p: argparse.ArgumentParser) -> None:
        """The options naming llama.cpp's tree, build and bindings, which `find` reads."""
        p.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_DIR"),
                       help="llama.cpp source tree (convert_hf_to_gguf.py, gguf-py/); default $LLAMA_CPP_DIR")
        p.add_argument("--llama-build", default=os.environ.get("LLAMA_CPP_BUILD"),
                       help="its build's bin/ (llama-quantize, libllama.so); default $LLAMA_CPP_BUILD")
        p.add_argument("--llama-python", default=os.environ.get("LLAMA_CPP_PYTHON"),
                       help="the directory holding the llama_cpp bindings package; default: the sdist around "
                            "--llama-cpp")

    @classmethod
    def find(cls, args: argparse.Namespace) -> "LlamaCpp":
        """The llama.cpp that `add_options`' options name, every file the checks use there."""
        source, build, bindings = args.llama_cpp, args.llama_build, args.llama_python
        prog = Path(sys.argv[0]).stem
        if not source or not build:
            sys.exit(f"{prog}: no llama.cpp: pass --llama-cpp SRC and --llama-build SRC/build/bin (or set "
                     f"LLAMA_CPP_DIR and LLAMA_CPP_BUILD); build it with: {BUILD_COMMAND}")
        found = cls(Path(source), Path(build), Path(bindings) if bindings else Path(source).resolve().parent.parent)
        missing = [p for p in (found.source / "convert_hf_to_gguf.py", found.source / "gguf-py",
                               found.bin / "llama-quantize", found.bin / "libllama.so",
                               found.python / "llama_cpp" / "llama_cpp.py") if not p.exists()]
        if missing:
            sys.exit(f"{prog}: no {missing[0]}: build llama.cpp with: {BUILD_COMMAND} (the bindings: "
                     "--llama-python DIR holding llama_cpp/)")
        return found

    def convert(self, checkpoint: Path, out: Path, outtype: str, mtp: bool) -> None:
        env = dict(os.environ, PYTHONPATH=str(self.source / "gguf-py"))
        cmd = [sys.executable, str(self.source / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype",
               outtype.lower(), "--outfile", str(out)] + ([] if mtp else ["--no-mtp"])
        run_tool(cmd, out, env)

    def quantize(self, src: Path, out: Path, qtype: str) -> None:
        cmd = [str(self.bin / "llama-quantize")] + (["--allow-requantize"] if qtype == "F32" else [])
        run_tool(cmd + [str(src), str(out), qtype, "2"], out)

    def logits(self, gguf: Path, prompt: list[int], n_gen: int, log: Path,
               follow: list[int] | None = None) -> tuple[np.ndarray, list[int]]:
        """llama.cpp on `gguf`, 2 threads, fp32 KV cache, no flash attention: the prompt's logits at every position,
        then n_gen - 1 steps fed its greedy tokens (or `follow`'s) -> (logits [P + n_gen - 1, V], the n_gen greedy
        picks)."""
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "logits.npz"
            job = dict(gguf=str(gguf), prompt=prompt, n_gen=n_gen, out=str(out), bindings=str(self.python),
                       follow=follow)
            env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(self.bin))
            with open(log, "a") as err:
                err.write(f"--- {gguf}\n")
                err.flush()
                done = subprocess.run([sys.executable, __file__, "--llama-worker", json.dumps(job)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=err)
            if done.returncode != 0:
                raise CheckError(f"llama.cpp failed on {gguf.name} (exit {done.returncode}): {last_line(log)}")
            data = np.load(out)
            return data["logits"], data["tokens"].tolist()


def run_tool(cmd: list[str], out: Path, env: dict | None = None) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not out.is_file():
        tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["(no output)"]
        raise CheckError(f"{Path(cmd[0]).name if 'python' not in cmd[0] else Path(cmd[1]).name} -> {out.name}: "
                         f"{tail[0]}")


def last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def llama_bindings(directory: Path):
    """llama-cpp-python's ctypes module (llama_cpp.llama_cpp) from `directory`, without running llama_cpp/__init__
    (its high-level API needs packages this check does not); the library comes from $LLAMA_CPP_LIB_PATH."""
    package = types.ModuleType("llama_cpp")
    package.__path__ = [str(directory / "llama_cpp")]
    sys.modules["llama_cpp"] = package
    from llama_cpp import llama_cpp

    return llama_cpp


def warnings_to_stderr(lc):
    """Send llama.cpp's warnings and errors (not its info and debug lines) to stderr -> the callback, which the
    caller must hold."""
    shown = [False]

    def log(level: int, text: bytes, _) -> None:
        if level != 5:  # GGML_LOG_LEVEL_CONT continues the previous line
            shown[0] = level >= 3  # WARN, ERROR
        if shown[0]:
            sys.stderr.write(text.decode(errors="replace"))

    callback = lc.llama_log_callback(log)
    lc.llama_log_set(callback, None)
    return callback


def llama_worker(job: dict) -> None:
    """In a child process (a llama.cpp abort ends only it): decode job["prompt"] with logits at every position, then
    job["n_gen"] - 1 steps, each fed the greedy pick (or job["follow"]'s token); save the logits and the greedy
    picks to job["out"]."""
    lc = llama_bindings(Path(job["bindings"]))
    log = warnings_to_stderr(lc)  # noqa: F841 (held: llama.cpp keeps the pointer)
    lc.llama_backend_init()
    model_params = lc.llama_model_default_params()
    model_params.load_mtp = True  # else llama.cpp skips the nextn block unchecked ("unused tensor ... ignoring")
    model = lc.llama_model_load_from_file(job["gguf"].encode(), model_params)
    if not model:
        sys.exit(f"llama.cpp could not load {job['gguf']}")
    prompt, n_gen = job["prompt"], job["n_gen"]
    params = lc.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = 64 * ((len(prompt) + n_gen) // 64 + 1)
    params.n_threads = params.n_threads_batch = 2
    params.type_k = params.type_v = 0  # GGML_TYPE_F32: an f16 KV cache would round K and V
    params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = lc.llama_init_from_model(model, params)
    if not ctx:
        sys.exit(f"llama.cpp could not make a context for {job['gguf']}")
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(len(prompt), 0, 1)

    def decode(tokens: list[int], pos: int) -> list[np.ndarray]:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos + i, 1, True
            batch.seq_id[i][0] = 0
        if lc.llama_decode(ctx, batch) != 0:
            sys.exit(f"llama_decode failed on {job['gguf']}")
        return [np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(vocab,)).copy()
                for i in range(len(tokens))]

    rows = decode(prompt, 0)
    picks = [int(rows[-1].argmax())]
    fed = job["follow"] or picks  # picks grows as it is read
    while len(picks) < n_gen:
        rows += decode([fed[len(picks) - 1]], len(prompt) + len(picks) - 1)
        picks.append(int(rows[-1].argmax()))
    np.savez(job["out"], logits=np.stack(rows), tokens=np.array(picks))


# ---------------------------------------------------------------------------------------------------- checkpoints

def build_checkpoint(name: str, path: Path, tokenizer: Path) -> Path:
    """The random bf16 checkpoint `name` in `path` (built once): see the module docstring."""
    import torch
    from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                              Qwen3_5TextConfig)

    from tests.checkpoints import add_mtp_head, randomize

    stamp = path / "gguf_check.version"
    if stamp.is_file() and stamp.read_text() == CHECKPOINT_VERSION:
        return path
    shutil.rmtree(path, ignore_errors=True)
    plain = path.with_name(path.name + "-plain") if name == "mtp" else path
    shutil.rmtree(plain, ignore_errors=True)
    if name == "moe":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**MOE))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**DENSE))
    model = randomize(model.eval(), seed=MODELS.index(name))
    correlate_qk(model, seed=MODELS.index(name))
    model.to(torch.bfloat16).save_pretrained(plain)
    for file in tokenizer.iterdir():
        shutil.copy(file, plain / file.name)
    if name == "mtp":
        add_mtp_head(plain, path)
        shutil.rmtree(plain)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(dict(config, mtp_num_hidden_layers=1), indent=2))
    stamp.write_text(CHECKPOINT_VERSION)
    return path


def correlate_qk(model, seed: int) -> None:
    """DeltaNet's k rows := its q rows plus 30% noise (in_proj_qkv rows: q [Hk·dk], k [Hk·dk], v [Hv·dv])."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.in_proj_qkv.weight"):
                cfg = model.config
                qk = cfg.linear_num_key_heads * cfg.linear_key_head_dim
                q = p[:qk]
                p[qk:2 * qk] = q + 0.3 * q.std() * torch.randn(q.shape, generator=g)


def prompt_ids(tokenizer: Path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer / "tokenizer.json")).encode(PROMPT).ids


# ---------------------------------------------------------------------------------------------------- qwenrt

def qwenrt_logits(path: Path, ids: list[int], mtp: bool = False):
    """qwenrt in fp32 on `path` (a checkpoint or a GGUF file): logits [T, V] over ids, and with `mtp` the MTP
    head's logits [T - 1, V] too."""
    import torch

    import qwenrt
    from qwenrt.mtp import load_mtp_head, mtp_hidden

    model, _ = qwenrt.load(path, dtype=torch.float32, threads=2)
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x)[0].numpy()
        head = model.lm_head(mtp_hidden(model, load_mtp_head(model), x))[0].numpy() if mtp else None
    return logits, head


def qwenrt_convert_available() -> bool:
    done = subprocess.run([sys.executable, "-m", "qwenrt", "convert", "--help"], capture_output=True)
    return done.returncode == 0


def qwenrt_convert(checkpoint: Path, out: Path, qtype: str) -> None:
    run_tool([sys.executable, "-m", "qwenrt", "convert", str(checkpoint), str(out), "--type", qtype], out)


# ---------------------------------------------------------------------------------------------------- comparing

def rel(ours: np.ndarray, ref: np.ndarray) -> float:
    """max|ours - ref| / max|ref| (float64)."""
    ours, ref = ours.astype(np.float64), ref.astype(np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def greedy(ours: np.ndarray, gen: list[int], n_prompt: int) -> str:
    """How many of llama.cpp's greedy tokens `gen` our logits (teacher-forced on them) pick before the first
    difference: 'k/N'."""
    picks = ours[n_prompt - 1:].argmax(-1)
    agreed = 0
    while agreed < len(gen) and picks[agreed] == gen[agreed]:
        agreed += 1
    return f"{agreed}/{len(gen)}"


class Checker:
    def __init__(self, llama: LlamaCpp, work: Path, n_gen: int, timer: Timer):
        self.llama, self.work, self.n_gen, self.timer = llama, work, n_gen, timer
        self.log = work / "llama.log"
        self.rows: list[Row] = []
        self.sources: dict = {}  # (checkpoint, ids) -> qwenrt's (logits, MTP logits) on the safetensors

    def on_source(self, checkpoint: Path, ids: list[int], mtp: bool):
        key = (checkpoint, tuple(ids))
        if key not in self.sources:
            self.sources[key] = self.run_qwenrt(checkpoint, ids, mtp)
        return self.sources[key]

    def run_llama(self, gguf: Path, ids: list[int], follow: list[int] | None = None):
        start = time.perf_counter()
        try:
            return self.llama.logits(gguf, ids, self.n_gen, self.log, follow)
        finally:
            self.timer.add("llama.cpp runs", start)

    def run_qwenrt(self, path: Path, ids: list[int], mtp: bool):
        from qwenrt.errors import QwenrtError

        start = time.perf_counter()
        try:
            return qwenrt_logits(path, ids, mtp)
        except QwenrtError as e:
            raise CheckError(f"qwenrt: {e}") from None
        finally:
            self.timer.add("qwenrt runs", start)

    def tool(self, stage: str, fn, *args) -> None:
        start = time.perf_counter()
        try:
            fn(*args)
        finally:
            self.timer.add(stage, start)

    def reference(self, gguf: Path, qtype: str, prompt: list[int]):
        """llama.cpp's F32 graph on `gguf` dequantized by llama.cpp -> (logits, greedy tokens, the ids run, the
        dequantized file: gguf itself for F32, else FILE.f32.gguf, which the caller removes)."""
        f32 = gguf
        if qtype != "F32":
            f32 = gguf.with_suffix(".f32.gguf")
            self.tool("llama-quantize", self.llama.quantize, gguf, f32, "F32")
        logits, gen = self.run_llama(f32, prompt)
        return logits, gen, prompt + gen[:-1], f32

    def check_model(self, name: str, checkpoint: Path, prompt: list[int], qtypes: list[str],
                    export: bool) -> None:
        mtp = name == "mtp"
        out = self.work / name
        out.mkdir(exist_ok=True)
        f32 = out / "F32.gguf"
        self.tool("convert_hf_to_gguf", self.llama.convert, checkpoint, f32, "F32", mtp)
        ref_f32, gen_f32, ids, _ = self.reference(f32, "F32", prompt)
        source = self.on_source(checkpoint, ids, mtp)
        self.rows.append(Row(name, "llama.cpp F32 vs qwenrt safetensors (info)", "F32", f32.stat().st_size,
                             rel(ref_f32, source[0]), greedy(source[0], gen_f32, len(prompt))))
        for qtype in qtypes:
            gguf = out / f"{qtype}.gguf"
            try:
                self.check_file(name, qtype, gguf, f32, checkpoint, prompt, mtp)
            except CheckError as e:
                self.rows.append(Row(name, "(a) qwenrt vs llama.cpp F32 on file", qtype, note=str(e)))
        if export:
            self.check_exports(name, checkpoint, prompt)

    def check_file(self, name, qtype, gguf, f32, checkpoint, prompt, mtp) -> None:
        if qtype in CONVERTER_TYPES:
            if qtype != "F32":
                self.tool("convert_hf_to_gguf", self.llama.convert, checkpoint, gguf, qtype, mtp)
        else:
            self.tool("llama-quantize", self.llama.quantize, f32, gguf, qtype)
        size = gguf.stat().st_size
        ref, gen, ids, f32 = self.reference(gguf, qtype, prompt)
        try:
            if qtype != "F32":
                native, native_gen = self.run_llama(gguf, prompt, gen)
                self.rows.append(Row(name, "llama.cpp kernels vs its F32 (info)", qtype, size, rel(native, ref),
                                     agreement(native_gen, gen)))
            ours, ours_mtp = self.run_qwenrt(gguf, ids, mtp)
            self.rows.append(Row(name, "(a) qwenrt vs llama.cpp F32 on file", qtype, size, rel(ours, ref),
                                 greedy(ours, gen, len(prompt)), BOUND_FILE))
            source = self.on_source(checkpoint, ids, mtp)
            if qtype == "BF16":
                self.rows.append(Row(name, "(a) qwenrt BF16 file vs safetensors", qtype, size,
                                     rel(ours, source[0]), agreement(ours[len(prompt) - 1:].argmax(-1).tolist(),
                                                                     source[0][len(prompt) - 1:].argmax(-1).tolist()),
                                     BOUND_EXACT))
            if mtp:  # the head against itself on the exact weights: the safetensors, or the F32 dequantization
                exact = qtype in ("F32", "BF16")
                mtp_ref = source[1] if exact else self.run_qwenrt(f32, ids, True)[1]
                self.rows.append(Row(name, "(a) MTP head: file vs " + ("safetensors" if exact else "F32 dequant"),
                                     qtype, size, rel(ours_mtp, mtp_ref), "", BOUND_EXACT if exact else BOUND_FILE))
        finally:
            if f32 != gguf:
                f32.unlink(missing_ok=True)
            if qtype in QUANTIZED_TYPES:
                gguf.unlink()  # cheap to remake; keeps the disk use bounded

    def exact(self, gguf: Path, qtype: str, prompt: list[int]):
        """`reference` without the dequantized file -> (logits, greedy tokens, the ids run)."""
        ref, gen, ids, f32 = self.reference(gguf, qtype, prompt)
        if f32 != gguf:
            f32.unlink()
        return ref, gen, ids

    def check_exports(self, name: str, checkpoint: Path, prompt: list[int]) -> None:
        """(b) and (c) on `qwenrt convert`'s exports of `checkpoint`."""
        for qtype in EXPORT_TYPES:
            try:
                self.check_export(name, checkpoint, prompt, qtype)
            except CheckError as e:
                self.rows.append(Row(name, "(b) qwenrt convert", qtype.upper(), note=str(e)))

    def check_export(self, name: str, checkpoint: Path, prompt: list[int], qtype: str) -> None:
        export = self.work / name / f"export-{qtype}.gguf"
        export.unlink(missing_ok=True)  # a run's exports are written anew: they check this qwenrt's convert
        self.tool("qwenrt convert", qwenrt_convert, checkpoint, export, qtype)
        size, label, mtp = export.stat().st_size, qtype.upper(), name == "mtp"
        ref, gen, ids = self.exact(export, label, prompt)
        source = self.on_source(checkpoint, ids, mtp)[0]
        self.rows.append(Row(name, "(b) llama.cpp F32 on export vs qwenrt source", label, size, rel(ref, source),
                             greedy(source, gen, len(prompt)), BOUND_FILE if qtype == "bf16" else None))
        if qtype != "bf16":  # llama.cpp's own file of that type, for the size and the distance to expect
            own = self.work / name / f"{label}.gguf"
            self.tool("llama-quantize", self.llama.quantize, self.work / name / "F32.gguf", own, label)
            own_ref, own_gen, own_ids = self.exact(own, label, prompt)
            own_source = self.on_source(checkpoint, own_ids, mtp)[0]
            self.rows.append(Row(name, "(b) llama.cpp's own file: F32 vs qwenrt source (info)", label,
                                 own.stat().st_size, rel(own_ref, own_source), greedy(own_source, own_gen,
                                                                                      len(prompt))))
            own.unlink()
        native, native_gen = self.run_llama(export, prompt, gen)
        self.rows.append(Row(name, "(b) llama.cpp kernels on export vs its F32 (info)", label, size,
                             rel(native, ref), agreement(native_gen, gen)))
        ours = self.run_qwenrt(export, ids, False)[0]
        self.rows.append(Row(name, "(b) qwenrt vs llama.cpp F32 on export", label, size, rel(ours, ref),
                             greedy(ours, gen, len(prompt)), BOUND_FILE))
        self.rows.append(Row(name, "(c) qwenrt on export vs qwenrt source", label, size, rel(ours, source), "",
                             0.0 if qtype == "bf16" else None))


def agreement(tokens: list[int], ref: list[int]) -> str:
    agreed = 0
    while agreed < len(ref) and agreed < len(tokens) and tokens[agreed] == ref[agreed]:
        agreed += 1
    return f"{agreed}/{len(ref)}"


# ---------------------------------------------------------------------------------------------------- output

def print_table(rows: list[Row]) -> None:
    header = ("model", "check", "type", "MiB", "max|diff|/max|ref|", "greedy", "bound", "")
    lines = [header] + [(r.model, r.check, r.type, f"{r.size / 2**20:.1f}" if r.size else "",
                         f"{r.rel:.2e}" if r.rel is not None else r.note, r.greedy,
                         f"{r.bound:.0e}" if r.bound else ("0" if r.bound == 0 else ""), r.verdict) for r in rows]
    widths = [max(len(line[i]) for line in lines if not (i == 4 and len(line[i]) > 40)) for i in range(len(header))]
    for line in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    LlamaCpp.add_options(p)
    p.add_argument("--models", default=",".join(MODELS), help=f"of {','.join(MODELS)}")
    p.add_argument("--types", default=",".join(CONVERTER_TYPES + QUANTIZED_TYPES), help="GGUF types for (a)")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens after the prompt")
    p.add_argument("--no-export", action="store_true", help="skip (b) and (c)")
    p.add_argument("--workdir", type=Path, help="checkpoints and GGUF files (default ~/.cache/qwenrt/bench/gguf-check)")
    p.add_argument("--llama-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.llama_worker:
        llama_worker(json.loads(args.llama_worker))
        return 0
    llama = LlamaCpp.find(args)
    models = [m for m in args.models.split(",") if m]
    qtypes = [t.upper() for t in args.types.split(",") if t]
    bad = [m for m in models if m not in MODELS] + [t for t in qtypes if t not in CONVERTER_TYPES + QUANTIZED_TYPES]
    if bad:
        p.error(f"unknown model or type {bad[0]!r}")
    from qwenrt.bench import cache_dir
    from tests.tokenizer_fixture import cached_qwen35_tokenizer

    work = args.workdir or cache_dir() / "gguf-check"
    work.mkdir(parents=True, exist_ok=True)
    timer = Timer()
    begin = time.perf_counter()
    start = time.perf_counter()
    tokenizer = cached_qwen35_tokenizer(cache_dir())
    checkpoints = {m: build_checkpoint(m, work / f"ckpt-{m}", tokenizer) for m in models}
    timer.add("checkpoints", start)
    prompt = prompt_ids(tokenizer)
    export = not args.no_export and qwenrt_convert_available()
    checker = Checker(llama, work, args.tokens, timer)
    for name in models:
        print(f"{name}: {checkpoints[name]}", file=sys.stderr)
        try:
            checker.check_model(name, checkpoints[name], prompt, qtypes, export)
        except CheckError as e:
            checker.rows.append(Row(name, "convert", "F32", note=str(e)))
        if not export:
            checker.rows.append(Row(name, "(b), (c)", "-", note="skipped" if args.no_export else
                                    "not run: no `qwenrt convert` yet"))
    print(f"prompt {len(prompt)} tokens + {args.tokens} greedy; fp32 logits, 2 threads; llama.cpp log: {checker.log}")
    print_table(checker.rows)
    total = time.perf_counter() - begin
    print("time: " + ", ".join(f"{k} {v:.0f} s" for k, v in timer.seconds.items()) + f"; total {total:.0f} s")
    return 1 if any(r.verdict == "FAIL" or (r.note and "not run" not in r.note and r.note != "skipped")
                    for r in checker.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
