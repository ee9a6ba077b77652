"""`bench_prefill --case`: which of the micro-benchmark's cases a run times (CPU: no kernel runs)."""

from __future__ import annotations

import pytest

from engine.kernels import bench_prefill
from engine.kernels.bench_prefill import CASES, select_cases


def test_no_filter_keeps_every_case_in_order() -> None:
    assert select_cases(None) == CASES
    assert select_cases([]) == CASES


def test_a_text_keeps_the_cases_whose_name_holds_it() -> None:
    names = [name for name, _ in select_cases(["4096"])]
    assert names == ["2 prompts x 4096", "1 prompt x 4096"]


def test_several_texts_keep_the_union_in_the_cases_order() -> None:
    names = [name for name, _ in select_cases(["1 prompt x 4096", "16 prompts"])]
    assert names == ["16 prompts x 512", "1 prompt x 4096"]


def test_a_text_matching_nothing_names_the_cases() -> None:
    with pytest.raises(ValueError, match=r"--case 'x 9999' matches no case; the cases: '2 prompts x 4096'"):
        select_cases(["4096", "x 9999"])


def test_the_command_line_rejects_an_unknown_case_before_looking_for_a_gpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_prefill.main(["--case", "no such case"])
    assert exit_info.value.code == 2
    assert "matches no case" in capsys.readouterr().err
