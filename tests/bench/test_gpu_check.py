"""bench/gpu_check.sh's plumbing end to end on the CPU (`--device cpu --small`: every section, the
same code as the CUDA run with tiny shapes), its budget guard, the roofline's inputs, and the
llama.cpp peer's cheap parts (argument parsing, decoder export, command construction)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import gpu_check, llamacpp
from core.model import config as model_config
from core.model import demo, llava
from visor import cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.build(tmp_path_factory.mktemp("gpu-check") / "demo")


@pytest.mark.timeout(240)
def test_small_run_fills_every_section(demo_dir: Path) -> None:
    env = {**os.environ, "PY": sys.executable, "PYTHONPATH": str(ROOT)}
    cmd = ["bench/gpu_check.sh", "--device", "cpu", "--small", "--threads", "1"]
    cmd += ["--workdir", str(demo_dir.parent)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)  # one JSON object, nothing else on stdout
    for name, _ in gpu_check.SECTIONS:
        assert "error" not in out[name] and "skipped" not in out[name], (name, out[name])
    assert out["device"] == "cpu" and out["sizes"] == "small"
    assert out["checkpoint"]["bytes"] > 0
    parity = out["parity"]  # CPU float32 against itself: bitwise the same
    assert parity["identical"] == parity["prompts"] == 4
    assert parity["max_abs_logprob_diff"] == 0.0
    for b in gpu_check.SMALL.decode_batches:
        row = out["decode"][f"batch{b}"]
        assert row["output_tok_per_s"] > 0 and row["decode_tok_per_s"] > 0
        assert out["transformers"][f"batch{b}"]["output_tok_per_s"] > 0
    assert out["ttft"]["question_tokens"] >= 30 and out["ttft"]["ttft_ms_p50"] > 0
    assert set(out["mixed"]["req_per_s"]) == {"token-budget", "request-count", "none"}
    assert out["mixed"]["requests"] == gpu_check.SMALL.mixed_n
    assert out["encoder"]["torch_float32"]["parity_vs_cpu_fp32"]["min_cosine"] == 1.0
    assert "absent" in out["encoder"]["tensorrt"] or "version" in out["encoder"]["tensorrt"]


def _check(tmp_path: Path, budget_s: float) -> gpu_check.Check:
    device, dtype = torch.device("cpu"), torch.float32
    return gpu_check.Check(
        device, dtype, gpu_check.SMALL, tmp_path, 1, time.monotonic() + budget_s, {}, None
    )


def test_a_section_past_its_limit_is_recorded_and_the_next_runs(tmp_path: Path) -> None:
    import signal

    signal.signal(signal.SIGALRM, gpu_check._alarm)
    check = _check(tmp_path, budget_s=6)  # sections start only with >= 5 s left

    def slow(c: gpu_check.Check) -> dict[str, Any]:
        time.sleep(30)
        return {}

    def broken(c: gpu_check.Check) -> dict[str, Any]:
        raise RuntimeError("boom")

    t0 = time.monotonic()
    check.section("decode", slow)
    assert time.monotonic() - t0 < 8
    assert check.out["decode"]["error"] == "stopped at its 6 s limit"
    check.section("ttft", broken)  # budget spent: not run
    assert check.out["ttft"] == {"skipped": "the 480 s budget is spent"}
    check.deadline = time.monotonic() + 60
    check.section("ttft", broken)
    assert "boom" in check.out["ttft"]["error"]


def test_roofline_inputs(demo_dir: Path) -> None:
    assert gpu_check.hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert gpu_check.hbm_bandwidth("NVIDIA H200") == 4.8e12
    assert gpu_check.hbm_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert gpu_check.hbm_bandwidth("cpu") is None
    model = llava.load(demo_dir)
    lm = model.language_model
    read = sum(p.numel() for p in lm.parameters()) - lm.embed_tokens.weight.numel()
    read += model.lm_head.weight.numel()
    assert gpu_check.decoder_params(model_config.load(demo_dir).text) == read


def test_llava_7b_preset_has_7b_shapes() -> None:
    spec = demo.PRESETS["llava-7b"]
    assert spec["text"]["num_hidden_layers"] == 32 and spec["text"]["hidden_size"] == 4096
    assert spec["model_vocab_size"] == 32064 and spec["vision"]["image_size"] == 336


def test_peer_argument_parsing() -> None:
    args = cli.parser().parse_args(["bench", "batching", "--peer", "llama.cpp", "--threads", "2"])
    assert args.peer == "llama.cpp" and args.threads == 2
    assert cli.parser().parse_args(["bench", "batching"]).peer is None
    assert not args.compile
    assert (
        cli.parser().parse_args(["bench", "batching", "--peer", "llama.cpp", "--compile"]).compile
    )
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["bench", "batching", "--peer", "vllm"])


def test_decoder_export_loads_in_transformers(demo_dir: Path, tmp_path: Path) -> None:
    import transformers

    out = llamacpp.export_decoder(demo_dir, tmp_path / "decoder")
    lm = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    ours = llava.load(demo_dir)
    assert torch.equal(lm.lm_head.weight, ours.lm_head.weight)
    assert torch.equal(lm.model.embed_tokens.weight, ours.language_model.embed_tokens.weight)


def test_conversion_and_build_commands(tmp_path: Path) -> None:
    src, decoder, gguf = tmp_path / "llama.cpp", tmp_path / "dec", tmp_path / "m.gguf"
    cmd = llamacpp.convert_command(src, decoder, "f16", gguf)
    assert cmd[0] == sys.executable and cmd[3] == str(src)
    assert cmd[4:] == [str(decoder), "--outtype", "f16", "--outfile", str(gguf)]
    with pytest.raises(ValueError):
        llamacpp.convert_command(src, decoder, "q4_0", gguf)
    configure = llamacpp.configure_command(src, tmp_path / "build")
    assert configure[:7] == ["cmake", "-S", str(src), "-B", str(tmp_path / "build"), "-G", "Ninja"]
    assert "-DLLAMA_CURL=OFF" in configure and "-DCMAKE_BUILD_TYPE=Release" in configure
