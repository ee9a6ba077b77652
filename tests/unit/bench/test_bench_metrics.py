"""Metric definitions: the percentile function, row-derived figures, summaries, key directions."""

import math

import numpy as np
import pytest

from bench.metrics import (
    HIGHER_IS_BETTER,
    LOWER_IS_BETTER,
    RequestRow,
    Slo,
    describe_failures,
    metric_direction,
    parse_slo,
    percentile,
    summarize,
)
from bench.results import read_rows, write_rows
from bench.runner import keep_up_rate


def make_row(
    index=0, scheduled=0.0, sent=None, first=0.1, done=1.0, tokens=10, status="ok", warmup=False, itls=None
):
    row = RequestRow(
        "t", "open", 1.0, None, 0, index, warmup, 16, tokens, scheduled, scheduled if sent is None else sent
    )
    row.first_token_s, row.done_s, row.output_tokens, row.status = first, done, tokens, status
    row.chunks = tokens
    row.itls_s = list(itls) if itls is not None else [(done - first) / max(tokens - 1, 1)] * (tokens - 1)
    return row


class TestPercentile:
    def test_matches_numpy_linear(self):
        values = [0.3, 0.1, 0.2, 0.5, 0.4, 1.0, 0.7]
        for percent in (0, 1, 50, 90, 99, 100):
            assert percentile(values, percent) == pytest.approx(np.percentile(values, percent))

    def test_p99_of_1_to_100(self):
        assert percentile(range(1, 101), 99) == pytest.approx(99.01)
        assert percentile(range(1, 101), 50) == pytest.approx(50.5)

    @pytest.mark.parametrize("fraction", [0.5, 0.9, 0.99, 0.999])
    def test_a_fraction_where_a_percent_is_expected_is_refused(self, fraction):
        with pytest.raises(ValueError, match=r"percent.*did you mean"):
            percentile([1.0, 2.0, 3.0], fraction)

    @pytest.mark.parametrize("percent", [-1, 100.5, 990])
    def test_out_of_range_is_refused(self, percent):
        with pytest.raises(ValueError):
            percentile([1.0], percent)

    def test_empty_is_nan_and_nan_input_is_refused(self):
        assert math.isnan(percentile([], 50))
        with pytest.raises(ValueError, match="NaN"):
            percentile([1.0, math.nan], 50)


class TestRow:
    def test_latencies_count_from_the_scheduled_time_not_the_send(self):
        row = make_row(scheduled=1.0, sent=1.25, first=1.5, done=3.0, tokens=4)
        assert row.ttft_s == pytest.approx(0.5)
        assert row.e2e_s == pytest.approx(2.0)
        assert row.send_lag_s == pytest.approx(0.25)
        assert row.tpot_s == pytest.approx((2.0 - 0.5) / 3)

    def test_tpot_needs_two_tokens(self):
        assert math.isnan(make_row(tokens=1, itls=[]).tpot_s)

    def test_csv_round_trip(self, tmp_path):
        rows = [make_row(0, itls=[0.01, 0.02]), make_row(1, status="http_500", first=None, tokens=0, itls=[])]
        rows[1].error = "boom, with a comma"
        write_rows(tmp_path / "requests.csv", rows)
        back = read_rows(tmp_path / "requests.csv")
        assert back == rows


class TestSummary:
    def test_figures_from_known_rows(self):
        rows = [
            make_row(0, scheduled=0.0, first=0.2, done=1.0, tokens=5, warmup=True),  # left out
            make_row(1, scheduled=1.0, first=1.1, done=2.0, tokens=10, itls=[0.1] * 9),
            make_row(2, scheduled=1.5, first=2.5, done=3.0, tokens=10, itls=[0.05] * 8 + [0.1]),
            make_row(3, scheduled=2.0, sent=2.1, first=2.3, done=5.0, tokens=4, itls=[0.9] * 3),
            make_row(4, scheduled=2.5, first=None, done=2.6, tokens=0, status="http_500", itls=[]),
        ]
        s = summarize(rows, Slo(ttft_s=0.5, tpot_s=0.2))
        assert (s["n_requests"], s["completed"], s["failures"]) == (4, 3, 1)
        assert s["duration_s"] == pytest.approx(5.0 - 1.0)  # first scheduled (non-warm-up) -> last completion
        assert s["served_req_s"] == pytest.approx(3 / 4.0)
        assert s["output_tok_s"] == pytest.approx(24 / 4.0)
        # row 1 meets the SLO; row 2 has TTFT 1.0; row 3 has TPOT (3.0 - 0.3) / 3 = 0.9
        assert s["goodput_req_s"] == pytest.approx(1 / 4.0)
        assert s["ttft_p50_s"] == pytest.approx(0.3)
        assert s["ttft_mean_s"] == pytest.approx((0.1 + 1.0 + 0.3) / 3)
        assert s["e2e_p50_s"] == pytest.approx(1.5)
        itls = [0.1] * 9 + [0.05] * 8 + [0.1] + [0.9] * 3
        assert s["itl_p50_s"] == pytest.approx(np.percentile(itls, 50))
        assert s["itl_p99_s"] == pytest.approx(np.percentile(itls, 99))
        assert s["tpot_p50_s"] == pytest.approx(0.1)  # of 0.9 / 9, 0.5 / 9 and 2.7 / 3
        assert s["send_lag_p99_s"] == pytest.approx(np.percentile([0, 0, 0.1, 0], 99))

    def test_no_completed_request(self):
        s = summarize([make_row(0, first=None, tokens=0, status="timeout", itls=[])])
        assert s["served_req_s"] == 0.0 and s["failures"] == 1 and math.isnan(s["ttft_p50_s"])

    def test_slo_parsing(self):
        assert parse_slo("ttft_s=0.5,tpot_s=0.05") == Slo(0.5, 0.05, None)
        assert parse_slo("e2e_s=2") == Slo(None, None, 2.0)
        with pytest.raises(ValueError, match="SLO"):
            parse_slo("ttft=0.5")


class TestDirection:
    def test_every_summary_figure_has_a_direction(self):
        s = summarize([make_row(0)])
        # what the level was, not how well it ran: no_text counts what the model's tokens decoded to
        identity = {"n_requests", "completed", "duration_s", "no_text"}
        for key in set(s) - identity:
            assert metric_direction(key) is not None, key

    def test_directions(self):
        assert metric_direction("served_req_s") == "higher"
        assert metric_direction("capacity_req_s") == "higher"
        assert metric_direction("ttft_p50_s") == "lower"
        assert metric_direction("e2e_p99_s") == "lower"
        assert metric_direction("failures") == "lower"
        assert HIGHER_IS_BETTER.isdisjoint(LOWER_IS_BETTER)

    @pytest.mark.parametrize("key", ["rate", "concurrency", "ttft_p50_s_min", "served_req_s_max", "mode"])
    def test_not_compared(self, key):
        assert metric_direction(key) is None


class TestKeepUpRate:
    def test_an_idle_server_meets_its_own_bar(self):
        # 10 arrivals 1 s apart, each served in 2 s: served_req_s = 10 / 11 s, under the nominal 1/s.
        rows = [make_row(i, scheduled=float(i), first=i + 0.1, done=i + 2.0) for i in range(10)]
        served = summarize(rows)["served_req_s"]
        assert served == pytest.approx(10 / 11)
        assert keep_up_rate(rows, 2.0) == pytest.approx(10 / 11)
        assert served >= 0.9 * keep_up_rate(rows, 2.0)

    def test_a_saturated_server_falls_below_it(self):
        # The same arrivals, served one after another every 2 s: completions fall behind.
        rows = [make_row(i, scheduled=float(i), first=2.0 * i + 1.9, done=2.0 * (i + 1)) for i in range(10)]
        e2e_p50 = summarize(rows)["e2e_p50_s"]
        assert summarize(rows)["served_req_s"] < 0.9 * keep_up_rate(rows, e2e_p50)

    def test_warmup_rows_and_degenerate_levels(self):
        rows = [make_row(0, warmup=True), make_row(1, scheduled=1.0, done=2.0)]
        assert math.isnan(keep_up_rate(rows, 1.0))
        assert math.isnan(keep_up_rate([make_row(0), make_row(1, scheduled=1.0)], math.nan))


def test_output_tok_s_counts_only_requests_that_finished_well():
    # two ok requests of 100 tokens; a truncated one ("short") that streamed 60 and one that failed
    # mid-stream after 30 (both count as failures), all within the same 2 seconds
    rows = [
        make_row(0, done=2.0, tokens=100),
        make_row(1, done=1.5, tokens=100),
        make_row(2, done=1.8, tokens=60, status="short"),
        make_row(3, done=1.0, tokens=30, status="stream_error"),
    ]
    summary = summarize(rows)
    assert summary["duration_s"] == 2.0 and summary["failures"] == 2
    assert summary["output_tok_s"] == pytest.approx(200 / 2.0)  # not (200 + 60 + 30) / 2
    assert summary["served_req_s"] == pytest.approx(2 / 2.0)


def test_failures_are_described_by_kind_with_the_first_error():
    rows = [make_row(i) for i in range(5)]
    rows[1].status, rows[1].error = "short", "got 3 of 10 tokens"
    rows[3].status, rows[3].error = "short", "got 7 of 10 tokens"
    rows[4].status, rows[4].error = "http_500", "boom"
    assert describe_failures(rows) == ["short x2: got 3 of 10 tokens", "http_500 x1: boom"]
    assert describe_failures(rows[:1]) == []
