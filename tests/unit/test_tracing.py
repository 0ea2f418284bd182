"""shared.tracing without servers: when the environment turns tracing on, that off installs
nothing, and where each stage's span is placed (tests/integration/test_tracing.py runs the
rest through real services and a real OTLP collector)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from shared import tracing
from shared.config import ConfigError


@pytest.mark.parametrize(
    ("env", "wanted"),
    [
        ({}, ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, ()),  # told where, not to
        ({"OTEL_TRACES_EXPORTER": "none"}, ()),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": " OTLP , console"}, ("otlp", "console")),
        ({"OTEL_TRACES_EXPORTER": "console"}, ("console",)),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, ()),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "false"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ("otlp",)),
    ],
)
def test_the_standard_variables_decide(env: dict[str, str], wanted: tuple[str, ...]) -> None:
    assert tracing.exporters(env) == wanted


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_TRACES_EXPORTER": "zipkin"},
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
    ],
)
def test_what_visor_cannot_export_is_a_config_error(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="OTEL_"):
        tracing.exporters(env)


def test_off_installs_nothing_and_loads_no_sdk() -> None:
    """In a fresh interpreter without OTEL_* variables: configure() declines, no interceptor is
    made, the global provider stays the API's no-op proxy, and the SDK is never imported."""
    code = (
        "import os, sys\n"
        "for k in [k for k in os.environ if k.startswith('OTEL_')]: del os.environ[k]\n"
        "from shared import tracing\n"
        "from opentelemetry import trace\n"
        "s = tracing.Stages(); s['receive'] = 1.0\n"
        "tracing.note(request_id='x'); tracing.refused('INTERNAL'); tracing.record_stages(s)\n"
        "print(tracing.configure('visor-core'), tracing.server_interceptors(),\n"
        "      tracing.client_interceptors(), type(trace.get_tracer_provider()).__name__,\n"
        "      sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk',\n"
        "             'opentelemetry.exporter', 'opentelemetry.instrumentation'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "[]", "[]", "ProxyTracerProvider", "[]"]


def test_on_installs_a_provider_named_for_the_service() -> None:
    code = (
        "import os\n"
        "os.environ.pop('OTEL_SERVICE_NAME', None)\n"
        "os.environ['OTEL_TRACES_EXPORTER'] = 'console'\n"
        "from shared import tracing\n"
        "from opentelemetry import trace\n"
        "assert tracing.configure('visor-gateway')\n"
        "p = trace.get_tracer_provider()\n"
        "print(p.resource.attributes['service.name'], len(tracing.server_interceptors()),\n"
        "      len(tracing.client_interceptors()))\n"
        "tracing.shutdown()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["visor-gateway", "1", "4"]


def test_a_stage_set_alone_ends_when_it_is_set() -> None:
    stages = tracing.Stages()
    before = time.perf_counter()
    stages["sniff"] = 2.0
    after = time.perf_counter()
    start, end = stages.intervals()["sniff"]
    assert before <= end <= after
    assert end - start == pytest.approx(0.002)
    assert stages == {"sniff": 2.0} and isinstance(stages, dict)


def test_stages_reported_together_ran_back_to_back() -> None:
    stages = tracing.Stages()
    before = time.perf_counter()
    stages.update({"queue": 1.0, "prefill": 30.0, "generate": 200.0})
    after = time.perf_counter()
    got = stages.intervals()
    assert before <= got["generate"][1] <= after
    assert got["generate"][0] == got["prefill"][1] and got["prefill"][0] == got["queue"][1]
    assert got["queue"][1] - got["queue"][0] == pytest.approx(0.001)
    assert got["generate"][1] - got["queue"][0] == pytest.approx(0.231)
    stages.update(image_decode=3.0)  # keyword form, as dict.update takes it
    assert stages["image_decode"] == 3.0 and "image_decode" in stages.intervals()
