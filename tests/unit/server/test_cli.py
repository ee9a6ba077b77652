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
