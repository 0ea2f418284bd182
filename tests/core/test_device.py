"""`[core] device` and `dtype`: resolved once by `core.device.resolve`, refused at start when the
device is absent, with the key named."""

from __future__ import annotations

import pytest
import torch

from core.config import CoreConfig
from core.device import resolve
from shared.config import ConfigError, build

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present here")


@no_cuda
def test_auto_is_the_cpu_in_float32_here() -> None:
    assert resolve("auto", "auto") == (torch.device("cpu"), torch.float32)


def test_explicit_values_are_kept() -> None:
    assert resolve("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    assert resolve("cpu", "float16") == (torch.device("cpu"), torch.float16)
    assert resolve("cpu", "float32") == (torch.device("cpu"), torch.float32)


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_an_absent_cuda_device_is_refused_naming_the_key(device: str) -> None:
    with pytest.raises(ConfigError, match=r"\[core\] device .* 0 CUDA device"):
        resolve(device, "auto")
    with pytest.raises(ConfigError, match=r"\[core\] device"):
        build(CoreConfig, "core", {}, {"VISOR_CORE_DEVICE": device})


@pytest.mark.parametrize(
    "device,dtype,key",
    [("gpu", "auto", "device"), ("cuda:x", "auto", "device"), ("cpu", "half", "dtype")],
)
def test_unknown_values_are_refused(device: str, dtype: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"\[core\] {key} must be one of"):
        resolve(device, dtype)


def test_config_defaults_and_the_removed_bf16_backend() -> None:
    cfg = build(CoreConfig, "core", {}, {"VISOR_CORE_DTYPE": "bfloat16"})
    assert (cfg.device, cfg.dtype) == ("auto", "bfloat16")
    with pytest.raises(ConfigError, match='dtype = "bfloat16"'):
        build(CoreConfig, "core", {}, {"VISOR_CORE_ENCODER": "torch-bf16"})
