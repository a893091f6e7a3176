"""`pubsub-sidecar skip-gap` against a real delivery layer (grpc.aio server on port 0): the line it
prints, its refusals with their exit codes, and that what it frees is what `status` names."""

from __future__ import annotations

import asyncio
import io
import json
import shlex

import pytest
from gap_sidecar import gap_sidecar, until

from sidecar.commands import main as cli
from sidecar.commands.status import fetch_and_render

pytestmark = pytest.mark.timeout(60)


async def run(*argv: str) -> int:
    return await asyncio.to_thread(cli.main, list(argv))


async def test_the_command_status_names_skips_the_gap_and_the_key_goes_on_in_order(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with gap_sidecar() as sidecar:
        out, err = io.StringIO(), io.StringIO()
        assert await fetch_and_render(sidecar.address, as_json=True, out=out, err=err) == 0
        (key,) = json.loads(out.getvalue())["subscriptions"][0]["keys_detail"]
        argv = shlex.split(key["free_with"])
        assert argv[:2] == ["pubsub-sidecar", "skip-gap"] and argv[-2:] == ["--through", "3"]
        assert await run(*argv[1:]) == 0
        assert capsys.readouterr().out == (
            "skipped the gap of key 'a' of subscription 'orders': missing sequence 3 passed over\n"
        )
        assert await sidecar.take_and_ack() == [4]
        assert await sidecar.take_and_ack() == [5]
        # Run again: the key no longer waits on a gap. FAILED_PRECONDITION, exit 1, one line.
        assert await run(*argv[1:]) == 1
        err_line = capsys.readouterr().err
        assert err_line.startswith("pubsub-sidecar skip-gap: the sidecar at ") and err_line.count("\n") == 1
        assert "FAILED_PRECONDITION: key 'a' is not waiting on a gap" in err_line
        await sidecar.store_and_hand(3)
        await until(lambda: sidecar.sink.published == [(3, "late")], "3 dead-lettered as late")


@pytest.mark.parametrize(
    ("subscription", "key", "through", "code", "text"),
    [
        ("nope", "a", "3", 2, "NOT_FOUND: unknown subscription 'nope'"),
        ("orders", "", "3", 2, "--key must not be empty"),
        ("orders", "a", "4", 2, "INVALID_ARGUMENT: key 'a' misses sequence 3: the last sequence to skip"),
        ("orders", "never-seen", "3", 1, "FAILED_PRECONDITION: key 'never-seen' is not waiting on a gap"),
    ],
)
async def test_refusals_are_one_line_with_their_exit_code(
    capsys: pytest.CaptureFixture[str], subscription: str, key: str, through: str, code: int, text: str
) -> None:
    async with gap_sidecar() as sidecar:
        argv = ("skip-gap", "--target", sidecar.address, "--subscription", subscription, "--key", key)
        assert await run(*argv, "--through", through) == code
        err = capsys.readouterr().err
        assert text in err and err.count("\n") == 1
        assert sidecar.runtime.take("app", 10) == []  # nothing changed


async def test_an_unreachable_sidecar_is_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("skip-gap", "--target", "127.0.0.1:1", "--subscription", "orders", "--key", "a", "--through", "3")
    assert await run(*argv, "--timeout", "2") == 1
    assert "pubsub-sidecar skip-gap: cannot reach the sidecar at 127.0.0.1:1" in capsys.readouterr().err
