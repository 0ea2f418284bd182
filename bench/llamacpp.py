"""llama.cpp as a peer of `visor bench batching --peer llama.cpp`: the engine people run models on
CPUs with, on the same weights, in the same run.

`llama-server` is built on demand from the llama.cpp sources vendored in the `llama-cpp-python`
sdist (cmake + ninja, about 8 minutes on 2 cores; the binary is cached under `.visor/llama.cpp`),
the bench model's decoder is exported as a plain Llama checkpoint and converted with llama.cpp's
own `convert_hf_to_gguf.py` (f32 and f16), and the same text prompts run through visor's engine
and through the server, alternating, with the same thread count. Never part of `make test`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import load_file, save_file

from shared.net import free_port
from visor.cli import OPENMP_WAITS

VERSION = "0.3.36"  # llama-cpp-python sdist whose vendored llama.cpp is built and converted with
CACHE = Path(".visor/llama.cpp")
OUTTYPES = ("f32", "f16")


def _run(cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    """Runs a build or conversion step; its output goes to stderr, so stdout stays one JSON."""
    subprocess.run(cmd, cwd=cwd, env=env, check=True, stdout=sys.stderr)


def source(cache: Path = CACHE) -> Path:
    """The vendored llama.cpp tree of the sdist, downloaded (pip, no binary) and unpacked once."""
    src = cache / f"llama.cpp-{VERSION}"
    if (src / "CMakeLists.txt").exists():
        return src
    sdist = cache / "sdist"
    name = f"llama_cpp_python-{VERSION}"
    archive = sdist / f"{name}.tar.gz"
    if not archive.exists():
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        _run([*pip, "-d", str(sdist), f"llama-cpp-python=={VERSION}"])
    prefix = f"{name}/vendor/llama.cpp/"
    tmp = cache / "unpack"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(tmp, members=members, filter="data")
    (tmp / prefix).rename(src)
    shutil.rmtree(tmp)
    return src


def configure_command(src: Path, build: Path) -> list[str]:
    """A Release build of llama-server alone, tuned for this CPU, with no network code."""
    flags = {
        "CMAKE_BUILD_TYPE": "Release",
        "GGML_NATIVE": "ON",
        "BUILD_SHARED_LIBS": "OFF",
        "LLAMA_CURL": "OFF",
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF",
        "LLAMA_BUILD_TOOLS": "ON",
        "LLAMA_BUILD_SERVER": "ON",
    }
    return ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja"] + [
        f"-D{k}={v}" for k, v in flags.items()
    ]


def server_binary(cache: Path = CACHE) -> Path:
    """llama-server, built when it is not cached yet."""
    binary = cache / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama-server needs {tool} on PATH")
    src = source(cache)
    _run(configure_command(src, cache / "build"))
    _run(["cmake", "--build", str(cache / "build"), "--target", "llama-server"])
    return binary


def export_decoder(model_dir: Path, out: Path) -> Path:
    """The checkpoint's language model as a LlamaForCausalLM directory (config, weights,
    tokenizer): what `convert_hf_to_gguf.py` reads. The vision tower and projector stay behind:
    the peer runs text prompts only."""
    raw = json.loads((model_dir / "config.json").read_text())
    text = {**raw["text_config"], "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    text.setdefault("torch_dtype", "float32")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(text, indent=2) + "\n")
    state: dict[str, Any] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            if name.startswith("language_model.model."):
                state["model." + name[len("language_model.model.") :]] = tensor
            elif name.startswith("language_model.lm_head."):
                state[name[len("language_model.") :]] = tensor
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, out / name)
    return out


# The converter reads a Llama tokenizer as SentencePiece first and refuses a BPE one whose
# pre-tokenizer it does not know by hash (the demo tokenizer is trained here, so none is known).
# The peer is sent token ids, never text: the byte-level BPE (`gpt2`) path is taken, with the
# GPT-2 pre-tokenizer named.
_CONVERT = (
    "import sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/gguf-py']; "
    "import convert_hf_to_gguf as c; "
    "base = c if hasattr(c, 'TextModel') else __import__('conversion.base').base; "
    "T = base.TextModel; T.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'; "
    "T._set_vocab_sentencepiece = T._set_vocab_llama_hf = lambda self: T._set_vocab_gpt2(self); "
    "sys.argv = [sys.argv[1] + '/convert_hf_to_gguf.py', *sys.argv[2:]]; c.main()"
)


def convert_command(src: Path, decoder: Path, outtype: str, outfile: Path) -> list[str]:
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, not {outtype!r}")
    args = [str(decoder), "--outtype", outtype, "--outfile", str(outfile)]
    return [sys.executable, "-c", _CONVERT, str(src), *args]


def gguf(model_dir: Path, outtype: str, cache: Path = CACHE) -> Path:
    """The decoder of `model_dir` as GGUF (cached by checkpoint name and type)."""
    outfile = cache / "models" / f"{model_dir.resolve().name}-{outtype}.gguf"
    if outfile.exists() and outfile.stat().st_mtime >= _mtime(model_dir):
        return outfile
    decoder = export_decoder(model_dir, cache / "models" / f"{model_dir.resolve().name}-hf")
    outfile.parent.mkdir(parents=True, exist_ok=True)
    _run(convert_command(source(cache), decoder, outtype, outfile))
    return outfile


def _mtime(model_dir: Path) -> float:
    return max(p.stat().st_mtime for p in model_dir.glob("*.safetensors"))


@contextmanager
def serve(binary: Path, model: Path, threads: int, slots: int, ctx: int) -> Iterator[str]:
    """A llama-server on loopback with `slots` parallel sequences; yields its base URL."""
    port = free_port()
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(ctx * slots)]
    cmd += ["--no-warmup", "--log-disable"]
    # llama.cpp runs on libgomp too: it gets libgomp's defaults, as its users run it, not visor's.
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_WAITS}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start (exit {proc.poll()})")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _complete(url: str, ids: list[int], new: int) -> dict[str, Any]:
    """One greedy completion of exactly `new` tokens (end-of-sequence ignored, no prompt cache)."""
    body = {
        "prompt": ids,
        "n_predict": new,
        "ignore_eos": True,
        "temperature": 0.0,
        "cache_prompt": False,
    }
    req = urllib.request.Request(
        f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        out: dict[str, Any] = json.load(r)
    return out


def measure(url: str, prompts: list[list[int]], new: int, concurrency: int) -> dict[str, float]:
    """Output tokens per wall second over all prompts, `concurrency` at a time, and prefill
    tokens per second as the server timed them."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda ids: _complete(url, ids, new), prompts))
    wall = time.perf_counter() - t0
    tokens = sum(int(o["timings"]["predicted_n"]) for o in outs)
    prompt_ms = sum(float(o["timings"]["prompt_ms"]) for o in outs)
    prompt_n = sum(int(o["timings"]["prompt_n"]) for o in outs)
    return {
        "output_tok_per_s": round(tokens / wall, 3),
        "prefill_tok_per_s": round(prompt_n / (prompt_ms / 1000), 3) if prompt_ms else 0.0,
    }


def compare(
    model: Path,
    ours: Callable[[int], Callable[[list[list[int]], int, int], dict[str, float]]],
    threads: tuple[int, ...] = (1, 2),
    batches: tuple[int, ...] = (1, 8),
    rounds: int = 2,
    new: int = 64,
    seed: int = 7,
) -> dict[str, Any]:
    """8 text prompts x `new` forced tokens through visor (`ours(threads)` returns a function of
    (prompts, new, concurrency)) and llama-server on the f32 and f16 GGUF of the same decoder,
    alternating within each round, at each thread count and concurrency; the best round of each
    is kept (the least disturbed by the rest of the machine)."""
    binary = server_binary()
    models = {t: gguf(model, t) for t in OUTTYPES}
    vocab = json.loads((model / "config.json").read_text())["text_config"]["vocab_size"]
    rng = np.random.default_rng(seed)
    prompts = [
        [int(t) for t in rng.integers(5, vocab, int(rng.integers(32, 256)))] for _ in range(8)
    ]
    rows: dict[str, Any] = {}
    for t in threads:
        run_ours = ours(t)
        with (
            serve(binary, models["f32"], t, max(batches), 512) as f32,
            serve(binary, models["f16"], t, max(batches), 512) as f16,
        ):
            peers = {
                "visor": run_ours,
                "llama_cpp_f32": _client(f32),
                "llama_cpp_f16": _client(f16),
            }
            best: dict[str, dict[str, dict[str, float]]] = {}
            for _ in range(rounds):
                for b in batches:
                    for name, fn in peers.items():
                        got = fn(prompts, new, b)
                        key = f"batch{b}"
                        prev = best.setdefault(key, {}).get(name)
                        if prev is None or got["output_tok_per_s"] > prev["output_tok_per_s"]:
                            best[key][name] = got
        rows[f"threads{t}"] = {key: _ratios(row) for key, row in best.items()}
    return {
        "prompts": len(prompts),
        "new_tokens": new,
        "rounds": rounds,
        **environment(),
        "results": rows,
        "targets": {
            "visor_vs_llama_cpp_f32": ">= 1.0 (batch 1 and 8, 1 and 2 threads)",
            "prefill_vs_llama_cpp_f32": ">= 1.0",
        },
    }


def _client(url: str) -> Callable[[list[list[int]], int, int], dict[str, float]]:
    return lambda prompts, new, concurrency: measure(url, prompts, new, concurrency)


def _ratios(row: dict[str, dict[str, float]]) -> dict[str, Any]:
    ours = row["visor"]
    out: dict[str, Any] = dict(row)
    for peer in ("llama_cpp_f32", "llama_cpp_f16"):
        theirs = row[peer]
        out[f"visor_vs_{peer}"] = round(ours["output_tok_per_s"] / theirs["output_tok_per_s"], 3)
        if ours.get("prefill_tok_per_s") and theirs.get("prefill_tok_per_s"):
            out[f"prefill_vs_{peer}"] = round(
                ours["prefill_tok_per_s"] / theirs["prefill_tok_per_s"], 3
            )
    return out


def environment() -> dict[str, str]:
    """What a reader needs to repeat the peer's numbers."""
    return {"llama_cpp_python_sdist": VERSION, "cpu": _cpu_name()}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
