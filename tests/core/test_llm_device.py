"""The language model on `[core] device` in `[core] dtype`.

On the CPU here: the weights load in the dtype asked for (float32 bit for bit the checkpoint's),
the KV cache follows them, and a bfloat16 engine answers as the float32 one does.

Without a GPU: torch's FakeTensorMode runs one mixed step (a decode beside a prefill chunk)
through `ModelRunner.execute` on device "cuda" with a LLaVA-1.5-7B-shaped decoder (32 layers,
4096 wide, 32 heads, 11008 MLP; fake bf16 weights that never exist) and checks every op: nothing
computed from a device tensor lands on the host but the step's one device-to-host copy (the
sampled ids), no op waits on a device value (no `.item()`), the KV cache and every matmul are
bf16, and the host-to-device copies are the step's inputs only. Fake tensors cannot be copied
from the host to "cuda" on a torch built without CUDA, so the recorder stands in for those copies
(a fake CUDA tensor of the same shape), and the step's device-to-host copy (`download`) is made
but its values read as 0, since fake tensors hold none."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from core import generate
from core.engine import Engine
from core.model import llava
from core.model.config import parse
from core.model.llava import Llava, canonical_name
from core.model.tokenizer import ChatTurn
from core.outputs import NewRequestData, ScheduledChunk, SchedulerOutput
from core.runner import ModelRunner
from core.types import Result, SamplingParams
from tests.core.test_encoder_device import LLAVA_15_7B, _fake_on_cuda
from tests.helpers import run_in_child

CUDA = torch.device("cuda", 0)
ATEN = torch.ops.aten
GEMMS = ("aten.linear", "aten.mm", "aten.addmm", "aten.matmul", "aten.bmm")
LLAVA_15_7B_TEXT = {  # the text fields of llava-hf/llava-1.5-7b-hf's config.json
    **LLAVA_15_7B,
    "text_config": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
        "vocab_size": 32064,
        "rms_norm_eps": 1e-5,
    },
}


def test_weights_load_in_the_dtype_asked_for(model_dir: Path) -> None:
    checkpoint = {}
    for path in model_dir.glob("*.safetensors"):
        for name, tensor in load_file(str(path)).items():
            if (canonical := canonical_name(name)) is not None:
                checkpoint[canonical] = tensor
    default = llava.load(model_dir)
    for name, tensor in default.state_dict().items():
        if name in checkpoint:
            assert tensor.dtype == torch.float32 and torch.equal(tensor, checkpoint[name].float())
    half = llava.load(model_dir, torch.device("cpu"), torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    # The derived buffers (rotary frequencies, pixel normalisation) stay float32.
    assert half.language_model.rotary.inv_freq.dtype == torch.float32
    assert half.encoder_digest() != default.encoder_digest()


def _answers(engine: Engine, questions: list[str]) -> list[str]:
    async def one(text: str) -> str:
        ids = engine.tokenizer.encode_prompt([ChatTurn("user", text, 0)])
        result = None
        async for out in engine.generate_ids(ids, SamplingParams(max_new_tokens=24)):
            if isinstance(out, Result):
                result = out
        assert result is not None
        return result.text

    return [asyncio.run(one(q)) for q in questions]


def test_a_bfloat16_engine_answers_as_the_float32_one(model_dir: Path) -> None:
    questions = ["What is in the picture?", "Describe the colours.", "How many shapes are there?"]
    answers = {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine(model_dir, dtype, device="cpu", dtype=dtype)
        try:
            kv = engine.runner.kv.keys[0]
            assert kv.dtype == engine.model.lm_head.weight.dtype == getattr(torch, dtype)
            answers[dtype] = _answers(engine, questions)
        finally:
            engine.close()
    assert all(a.strip() for a in answers["bfloat16"])
    assert answers["bfloat16"] == answers["float32"]


class _Trace(TorchDispatchMode):
    """Records every op (name, input devices, output device/dtype/shape) while `recording`. Host
    work on host data (the step's inputs, built from Python values) runs for real, so the host
    side computes as it would; a host-to-"cuda" copy, which a torch without CUDA cannot make,
    becomes a fake CUDA tensor of the same shape. Anything else goes to FakeTensorMode, which
    refuses a real (host) tensor mixed into device work."""

    def __init__(self) -> None:
        super().__init__()
        self.recording = False
        self.ops: list[tuple[str, set[str], list[tuple[str, torch.dtype, tuple[int, ...]]]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in (ATEN.pin_memory.default, ATEN._pin_memory.default):
            return args[0]
        # Under inference mode `.to` arrives whole (aten.to.*), else as aten._to_copy.
        if func.overloadpacket in (ATEN.to, ATEN._to_copy) and _to_cuda(args[0], args, kwargs):
            given = [a for a in args[1:] if isinstance(a, torch.dtype)]  # `.to(device, dtype)`
            dtype = kwargs.get("dtype") or (given[0] if given else args[0].dtype)
            out: Any = torch.empty(args[0].shape, dtype=dtype, device=CUDA)
        elif not any(isinstance(t, FakeTensor) for t in ins) and not _names_cuda(args, kwargs):
            with _disable_current_modes():
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if self.recording:
            outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            made = [(t.device.type, t.dtype, tuple(t.shape)) for t in outs]
            self.ops.append((str(func), {t.device.type for t in ins}, made))
        return out


def _names_cuda(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    named = [kwargs.get("device"), *(a for a in args if isinstance(a, torch.device))]
    return any(d is not None and torch.device(d).type == "cuda" for d in named)


def _to_cuda(x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a `.to` call copies host tensor `x` to a CUDA device."""
    return x.device.type == "cpu" and _names_cuda(args, kwargs)


_GETITEM = torch.Tensor.__getitem__


def _getitem(x: torch.Tensor, index: Any) -> torch.Tensor:
    """`x[index]` for basic indices (ints, slices, None, ...) as select/slice/unsqueeze ops on a
    fake CUDA tensor: Python indexing opens a CUDA device guard first, which a torch without CUDA
    cannot; the ops themselves run under FakeTensorMode as they would on a GPU."""
    if not (isinstance(x, FakeTensor) and x.device.type == "cuda"):
        return _GETITEM(x, index)
    parts = index if isinstance(index, tuple) else (index,)
    if any(p is Ellipsis for p in parts):
        at = next(i for i, p in enumerate(parts) if p is Ellipsis)
        named = sum(p is not None for p in parts) - 1
        parts = parts[:at] + (slice(None),) * (x.dim() - named) + parts[at + 1 :]
    dim = 0
    for p in parts:
        if p is None:
            x, dim = x.unsqueeze(dim), dim + 1
        elif isinstance(p, int):
            x = x.select(dim, p)
        elif isinstance(p, slice) and p.step in (None, 1):
            start, stop, _ = p.indices(x.shape[dim])
            x, dim = x.narrow(dim, start, max(0, stop - start)), dim + 1
        else:
            return _GETITEM(x, index)  # advanced indexing: let it fail as it would
    return x


def _prompt(n: int) -> tuple[int, ...]:
    return tuple(range(10, 10 + n))


def test_one_mixed_step_on_cuda_keeps_every_tensor_on_the_device() -> None:
    """`mixed_step_on_fake_cuda`, in a child process: its `Tensor.__getitem__` stand-in cannot
    be undone in this one."""
    assert "mixed step ok" in run_in_child("tests.core.test_llm_device.mixed_step_on_fake_cuda")


def mixed_step_on_fake_cuda() -> None:
    cfg = parse(LLAVA_15_7B_TEXT, {})
    with torch.device("meta"):
        model = Llava(cfg)  # no memory: the 7B model is never materialised
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=40)
    a, b = _prompt(48), _prompt(100)
    first = SchedulerOutput(
        new_requests=(
            NewRequestData(0, a, (), params, 1, None),
            NewRequestData(1, b, (), params, 2, None),
        ),
        chunks=(ScheduledChunk(0, 0, 48, (0, 1, 2), True), ScheduledChunk(1, 0, 32, (3, 4), False)),
        num_batched_tokens=80,
        preempted=(),
        finished_ids=(),
    )
    mixed = SchedulerOutput(  # A decodes its 49th token beside B's second prefill chunk
        new_requests=(),
        chunks=(
            ScheduledChunk(0, 48, 1, (0, 1, 2, 5), True),
            ScheduledChunk(1, 32, 32, (3, 4, 6, 7), False),
        ),
        num_batched_tokens=33,
        preempted=(),
        finished_ids=(),
    )
    downloads: list[tuple[int, ...]] = []

    def download(values: torch.Tensor) -> list[float]:
        """The step's device-to-host copy, made (and traced); its values read as 0 (token 0)."""
        downloads.append(tuple(values.cpu().shape))
        return [0.0] * values.numel()

    generate.download = download  # type: ignore[assignment]
    torch.Tensor.__getitem__ = _getitem  # type: ignore[method-assign,assignment]
    with FakeTensorMode(allow_non_fake_inputs=False), _Trace() as trace:
        _fake_on_cuda(model.language_model, torch.bfloat16)
        _fake_on_cuda(model.lm_head, torch.bfloat16)
        with torch.device(CUDA):
            model.language_model.rotary.reset_buffers()
        runner = ModelRunner(model, num_blocks=64, block_size=16, eos_ids={2})
        assert runner.execute(first).sampled == {0: 0}
        trace.recording = True
        out = runner.execute(mixed)
    assert out.sampled == {0: 0} and not out.errors
    kv = runner.kv.keys + runner.kv.values
    assert len(kv) == 64 and {(t.device, t.dtype) for t in kv} == {(CUDA, torch.bfloat16)}
    ops = trace.ops
    # Under inference mode F.linear arrives whole; elsewhere as mm / addmm.
    gemm = [made for op, _, made in ops if op.startswith(GEMMS)]
    assert len(gemm) >= 32 * 4 + 1  # every layer's projections and MLP, and the lm_head
    assert {(m[0], m[1]) for made in gemm for m in made} == {("cuda", torch.bfloat16)}
    writes = [made for op, _, made in ops if op.startswith("aten.index_copy")]
    assert len(writes) == 2 * 32 and all(m[0][:2] == ("cuda", torch.bfloat16) for m in writes)
    # Nothing computed from a device tensor lands on the host, but one copy: the sampled id.
    back = [
        (op, made) for op, ins, made in ops if "cuda" in ins and any(m[0] != "cuda" for m in made)
    ]
    assert len(back) == 1 and back[0][0].startswith(("aten.to.", "aten._to_copy.")), back
    assert downloads == [(1,), (1,)]  # per step one copy: its one sampling row's token id
    # No `.item()` on a device tensor (fake tensors would have raised on any read).
    assert not any(op == "aten._local_scalar_dense.default" for op, _, _ in ops)
    sent = [op for op, ins, made in ops if ins == {"cpu"} and any(m[0] == "cuda" for m in made)]
    assert 1 <= len(sent) <= 2, sent  # the runner's inputs, and the forward pass's metadata
    print("mixed step ok")
