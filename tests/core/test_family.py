"""Model families: `load_model` picks the family by config.json's `model_type`, and a checkpoint
no family serves (unknown type, broken or missing config.json, a family's own refusal) is one
`ModelConfigError` line; `visor core` turns it into one log line and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.model import demo, family, llava
from core.model.config import ModelConfigError
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.build(tmp_path_factory.mktemp("family") / "demo")


def _checkpoint(tmp_path: Path, config: str) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(config)
    return model


def test_llava_checkpoints_load_as_llava(demo_dir: Path) -> None:
    assert json.loads((demo_dir / "config.json").read_text())["model_type"] == "llava"
    model = family.load_model(demo_dir)
    assert isinstance(model, llava.Llava) and model.bidirectional_images is False
    assert family.sliding_windows(model) == {None}
    assert model.prompt_positions([1, 2, 3], [(1, 1, 1)]) == (None, 0)


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (
            '{"model_type": "qwen9_vl"}',
            "model_type 'qwen9_vl' is not served; "
            "supported: gemma3, llava, llava_onevision, qwen2_5_vl, qwen3_vl",
        ),
        ('{"model_type": "llava", ', "not JSON"),
        ("[1, 2]", "model_type None is not served"),
        ('{"model_type": "llava", "text_config": {"model_type": "mamba"}}', "unsupported model"),
    ],
)
def test_a_checkpoint_no_family_serves_is_one_line(tmp_path: Path, config: str, says: str) -> None:
    model = _checkpoint(tmp_path, config)
    with pytest.raises(ModelConfigError) as err:
        family.load_model(model)
    message = str(err.value)
    assert says in message and str(model / "config.json") in message and "\n" not in message


def test_a_missing_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"config\.json: cannot be read"):
        family.load_model(tmp_path)


@pytest.mark.parametrize(
    ("config", "says"), [('{"model_type": "qwen9_vl"}', "qwen9_vl"), ("{oops", "not JSON")]
)
def test_visor_core_exits_with_one_line_on_an_unservable_model(
    tmp_path: Path, config: str, says: str
) -> None:
    model = _checkpoint(tmp_path, config)
    env = {
        "VISOR_CORE_MODEL": str(model),
        "VISOR_CORE_LISTEN": "127.0.0.1:0",
        "VISOR_CORE_METRICS_LISTEN": "",
        "VISOR_CACHE_ENABLED": "false",
        "VISOR_DEPLOYMENT_SECRET_FILE": str(tmp_path / "deployment.secret"),
        "PATH": "/usr/bin:/bin",
    }
    done = subprocess.run(
        [sys.executable, "-m", "visor.cli", "core"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2, out
    assert len(out) == 1 and "Traceback" not in out[0], out
    line = json.loads(out[0])
    assert line["event"] == "model_unsupported" and says in line["config_error"]
