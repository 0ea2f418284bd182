"""The processes visor starts wait at GNU OpenMP barriers with a bounded spin (visor.cli), as
the libgomp that torch loads reads it, and an operator's own setting wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from visor.cli import OPENMP_WAITS

SET_THEN_LOAD = "from visor import cli; cli._set_openmp_waits(); import torch"


def _libgomp_settings(**env: str) -> dict[str, str]:
    """What libgomp reports it read (OMP_DISPLAY_ENV) when torch loads after the CLI's set-up."""
    base = {k: v for k, v in os.environ.items() if k not in OPENMP_WAITS}
    full = {**base, "OMP_DISPLAY_ENV": "VERBOSE", **env}
    out = subprocess.run(
        [sys.executable, "-c", SET_THEN_LOAD], env=full, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    pairs = (line.strip().split(" = ", 1) for line in out.stderr.splitlines() if " = " in line)
    return {k: v.strip("'") for k, v in pairs if k in OPENMP_WAITS}


def test_visor_processes_wait_actively_with_a_bounded_spin() -> None:
    assert _libgomp_settings() == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "20000"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"OMP_WAIT_POLICY": "passive"}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}),
        ({"GOMP_SPINCOUNT": "300000"}, {"GOMP_SPINCOUNT": "300000"}),
    ],
)
def test_an_operators_setting_is_left_as_set(env: dict[str, str], expected: dict[str, str]) -> None:
    got = _libgomp_settings(**env)
    assert {k: got[k] for k in expected} == expected
    assert got.get("OMP_WAIT_POLICY") != "ACTIVE" or "OMP_WAIT_POLICY" in env
