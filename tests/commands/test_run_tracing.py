"""``pubsub-sidecar run`` with tracing on and an ``OTEL_*`` environment the sidecar cannot honour:
one line naming the variable, exit code 2, before anything starts (no Google access is looked for)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

_REPO = Path(__file__).resolve().parent.parent.parent

_CONFIG = """\
project: demo-project
subscriptions:
  - name: orders
    subscription: projects/demo-project/subscriptions/orders
    ordering: {mode: sequence, key: {attribute: order_id}, sequence: {attribute: seq}}
tracing: {enabled: true}
"""


@pytest.mark.parametrize(
    ("variable", "value"),
    [("OTEL_TRACES_EXPORTER", "zipkin"), ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")],
)
def test_an_exporter_the_sidecar_does_not_ship_stops_run_with_one_line(
    tmp_path: Path, variable: str, value: str
) -> None:
    config = tmp_path / "sidecar.yaml"
    config.write_text(_CONFIG)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and not k.endswith("_EMULATOR_HOST")}
    env.update({"PYTHONPATH": str(_REPO), variable: value})
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "run", "--config", str(config)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("pubsub-sidecar run: tracing: ") and f"{variable}={value!r}" in line
