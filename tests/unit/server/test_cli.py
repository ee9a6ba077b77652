"""The server's flags map onto EngineArgs: prefix caching on by default, off with vLLM's flag."""

from __future__ import annotations

import pytest

from engine import EngineArgs
from server.cli import build_parser, engine_args


@pytest.mark.parametrize(
    ("flags", "expected"),
    [([], True), (["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False)],
)
def test_prefix_caching_flags(flags: list[str], expected: bool) -> None:
    args = engine_args(build_parser().parse_args(["--model", "m", *flags]))
    assert args.enable_prefix_caching is expected
    assert EngineArgs(model="m").enable_prefix_caching  # the default the flags leave alone


def test_help_lists_both_spellings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in capsys.readouterr().out


def test_a_negative_arrival_wait_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["--model", "m"]).arrival_wait_ms == 0.0  # off unless set
    assert build_parser().parse_args(["--model", "m", "--arrival-wait-ms", "2.5"]).arrival_wait_ms == 2.5
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--model", "m", "--arrival-wait-ms", "-1"])
    assert exit_info.value.code == 2
    assert "--arrival-wait-ms: must be at least 0" in capsys.readouterr().err
