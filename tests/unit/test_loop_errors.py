"""asyncio's own error reports (a task's exception nobody retrieved) reach the log as one JSON
line with the error's type and site, never as a text traceback or the error's message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import asyncio, gc
from shared import logs, serving

async def main():
    serving.log_loop_errors(asyncio.get_running_loop())

    async def fails():
        raise ValueError("user text that must not be logged")

    task = asyncio.ensure_future(fails())
    await asyncio.sleep(0.01)
    del task  # never awaited: asyncio reports its exception when the task is collected
    gc.collect()

logs.configure("test")
asyncio.run(main())
"""


def test_an_unretrieved_task_exception_is_one_json_line() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "user text" not in out.stderr
    records = [json.loads(line) for line in out.stderr.splitlines()]
    assert [(r["event"], r["error_type"]) for r in records] == [("loop_error", "ValueError")]
    assert str(records[0]["where"]).startswith("<string>:")
