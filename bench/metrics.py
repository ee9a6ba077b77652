"""Metric definitions: the per-request row, the one percentile function, and a level's summary.

The client fills `RequestRow`s with raw timestamps; everything derived from them (TTFT, TPOT, ITL,
served rate, goodput) is defined here and nowhere else, and the README quotes these definitions.
`metric_direction` says which summary keys are better higher and which lower; compare and the
perf tier both read it.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

import numpy as np

STAT_NAMES = ("mean", "p50", "p90", "p99")
LATENCY_METRICS = ("ttft", "itl", "tpot", "e2e")


def percentile(values: Iterable[float], percent: float) -> float:
    """The `percent`-th percentile of `values`, linear between closest ranks (numpy's default).

    `percent` is a percent: 99 for p99, 50 for the median, in [1, 100] or exactly 0. A value strictly
    between 0 and 1 is refused, because it is almost always a fraction (0.99) passed where a percent
    (99) was meant, which would silently report a near-minimum as a tail latency. NaNs are refused too;
    drop undefined values before calling. An empty input gives NaN.
    """
    if not (percent == 0 or 1 <= percent <= 100):
        hint = f"; did you mean {percent * 100:g}?" if 0 < percent < 1 else ""
        raise ValueError(f"percentile() takes a percent in [1, 100] such as 99 for p99, got {percent}{hint}")
    array = np.asarray(list(values), dtype=float)
    if array.size == 0:
        return math.nan
    if np.isnan(array).any():
        raise ValueError("percentile() got NaN values; drop undefined values first")
    return float(np.percentile(array, percent))


@dataclass
class RequestRow:
    """What happened to one request. Times are seconds from the run's start (one monotonic clock).

    `scheduled_s` is when the request was due (open loop: its arrival time; closed loop: when a slot
    freed), `sent_s` when the client actually started it, `first_token_s` when the first streamed chunk
    carrying a choice arrived (even with empty text; in a chat stream the first with content, see
    bench.client.is_arrival), `done_s` when the stream ended or failed.
    """

    target: str
    mode: str  # "open" or "closed"
    rate: float | None
    concurrency: int | None
    seed: int
    index: int
    warmup: bool
    prompt_len: int
    max_tokens: int
    scheduled_s: float
    sent_s: float
    first_token_s: float | None = None
    done_s: float = math.nan
    output_tokens: int = 0
    chunks: int = 0
    usage_prompt_tokens: int | None = None
    status: str = "ok"  # "ok" or an error kind: http_<code>, short, no_done, connect, timeout, error
    error: str = ""
    worker: int = 0
    itls_s: list[float] = field(default_factory=list)  # gaps between consecutive chunks with a choice

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft_s(self) -> float:
        """TTFT = first_token_s − scheduled_s (from the scheduled arrival, not from sending)."""
        return math.nan if self.first_token_s is None else self.first_token_s - self.scheduled_s

    @property
    def e2e_s(self) -> float:
        """End-to-end latency = done_s − scheduled_s."""
        return self.done_s - self.scheduled_s

    @property
    def send_lag_s(self) -> float:
        """Send lag = sent_s − scheduled_s: how late the client was."""
        return self.sent_s - self.scheduled_s

    @property
    def tpot_s(self) -> float:
        """TPOT = (e2e_s − ttft_s) / (output_tokens − 1); undefined (NaN) for fewer than 2 tokens."""
        if self.output_tokens < 2 or self.first_token_s is None:
            return math.nan
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_mean_s(self) -> float:
        return sum(self.itls_s) / len(self.itls_s) if self.itls_s else math.nan

    @property
    def itl_max_s(self) -> float:
        return max(self.itls_s) if self.itls_s else math.nan

    def to_record(self) -> dict[str, object]:
        """A flat dict for requests.csv: the raw fields, the derived ones, ITL gaps space-separated."""
        record: dict[str, object] = asdict(self)
        record["itls_s"] = " ".join(f"{gap:.6f}" for gap in self.itls_s)
        for name in ("ttft_s", "e2e_s", "tpot_s", "send_lag_s", "itl_mean_s", "itl_max_s"):
            record[name] = getattr(self, name)
        return record

    @classmethod
    def from_record(cls, record: dict[str, object]) -> RequestRow:
        """Inverse of `to_record` (derived columns are ignored; they are recomputed)."""
        kwargs: dict[str, object] = {}
        for f in fields(cls):
            value = record.get(f.name)
            if f.name == "itls_s":
                kwargs[f.name] = [float(x) for x in str(value or "").split()]
            elif _missing(value):
                if f.name in ("rate", "concurrency", "first_token_s", "usage_prompt_tokens"):
                    kwargs[f.name] = None
                elif f.name == "error":
                    kwargs[f.name] = ""
            else:
                kwargs[f.name] = value
        row = cls(**kwargs)  # type: ignore[arg-type]
        for name in ("seed", "index", "prompt_len", "max_tokens", "output_tokens", "chunks", "worker"):
            setattr(row, name, int(getattr(row, name)))
        if row.concurrency is not None:
            row.concurrency = int(row.concurrency)
        if row.usage_prompt_tokens is not None:
            row.usage_prompt_tokens = int(row.usage_prompt_tokens)
        row.warmup = str(row.warmup).lower() in ("true", "1")
        return row


def _missing(value: object) -> bool:
    return value is None or value == "" or (isinstance(value, float) and math.isnan(value))


@dataclass(frozen=True)
class Slo:
    """Service-level objective for goodput; a request meets it when every set bound holds."""

    ttft_s: float | None = 0.5
    tpot_s: float | None = 0.05
    e2e_s: float | None = None

    def met_by(self, row: RequestRow) -> bool:
        """OK, and TTFT <= ttft_s, TPOT <= tpot_s (a 1-token request has no TPOT and passes it), e2e <= e2e_s."""
        if not row.ok:
            return False
        if self.ttft_s is not None and not row.ttft_s <= self.ttft_s:
            return False
        if self.tpot_s is not None and row.output_tokens >= 2 and not row.tpot_s <= self.tpot_s:
            return False
        return self.e2e_s is None or row.e2e_s <= self.e2e_s


def parse_slo(text: str) -> Slo:
    """`"ttft_s=0.5,tpot_s=0.05"` -> Slo; seconds; bounds left out are not checked."""
    values: dict[str, float | None] = {"ttft_s": None, "tpot_s": None, "e2e_s": None}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if key not in values or not value:
            raise ValueError(f"bad SLO item {item!r}; expected ttft_s=, tpot_s= or e2e_s= seconds")
        values[key] = float(value)
    return Slo(**values)


def summarize(rows: Sequence[RequestRow], slo: Slo = Slo()) -> dict[str, float | int | None]:
    """One level's figures from its rows; warm-up rows are left out.

    - duration_s = last done_s of an ok request − first scheduled_s
    - served_req_s = ok requests / duration_s; output_tok_s = their output tokens / duration_s
    - goodput_req_s = ok requests meeting the SLO / duration_s
    - ttft, e2e, tpot: over ok requests; itl: over every gap of every ok request, pooled
    - no_text: ok requests whose stream brought no output the client could time (a chat stream of
      tokens that all decode to nothing, e.g. special tokens the server skips): their tokens count in
      output_tok_s and e2e, but they have no TTFT or TPOT and are left out of those figures
    - send_lag_p99_s: over all requests; failures = requests whose status is not ok
    """
    measured = [row for row in rows if not row.warmup]
    ok = [row for row in measured if row.ok]
    summary: dict[str, float | int | None] = {
        "n_requests": len(measured),
        "completed": len(ok),
        "failures": len(measured) - len(ok),
    }
    duration = math.nan
    if ok:
        duration = max(row.done_s for row in ok) - min(row.scheduled_s for row in measured)
    rate = (lambda count: count / duration) if duration > 0 else (lambda count: math.nan)
    summary["duration_s"] = duration
    summary["served_req_s"] = rate(len(ok)) if ok else 0.0
    summary["output_tok_s"] = rate(sum(row.output_tokens for row in ok)) if ok else 0.0
    summary["goodput_req_s"] = rate(sum(slo.met_by(row) for row in ok)) if ok else 0.0
    timed = [row for row in ok if row.first_token_s is not None]
    summary["no_text"] = len(ok) - len(timed)
    samples = {
        "ttft": [row.ttft_s for row in timed],
        "itl": [gap for row in ok for gap in row.itls_s],
        "tpot": [row.tpot_s for row in ok if not math.isnan(row.tpot_s)],
        "e2e": [row.e2e_s for row in ok],
    }
    for name in LATENCY_METRICS:
        summary.update(latency_stats(name, samples[name]))
    summary["send_lag_p99_s"] = percentile([row.send_lag_s for row in measured], 99)
    return summary


def prompt_tokens_tolerance(prompt_len: int) -> int:
    """How far the server's count of a prompt may stray from the workload's before it is reported as
    outside tolerance: 2 tokens or 1 %, whichever is more. A text prompt is made to encode to its length
    with the model's tokenizer (bench.prompts), but decoding is not the inverse of encoding: after its
    rounds a prompt can still come out a token or two short (never long), and a server that adds a BOS
    token to text counts one more."""
    return max(2, math.ceil(0.01 * prompt_len))


def check_prompt_tokens(rows: Sequence[RequestRow]) -> dict[str, float | int]:
    """The server's `usage.prompt_tokens` against each request's `prompt_len`, over the measured ok
    requests whose final chunk carried usage:

    - prompt_tokens_checked: how many had a count; prompt_tokens_mismatched: how many differ at all,
      and prompt_tokens_mismatch_pct of the checked
    - prompt_tokens_outside_tolerance: how many differ by more than prompt_tokens_tolerance
    - prompt_tokens_off_max: the largest difference in tokens (server's minus the workload's, by size)
    Only for workloads whose prompt_len is a token count (WorkloadSpec.exact_prompt_lens)."""
    offs = [
        (row.usage_prompt_tokens - row.prompt_len, row.prompt_len)
        for row in rows
        if row.ok and not row.warmup and row.usage_prompt_tokens is not None
    ]
    mismatched = sum(1 for off, _ in offs if off)
    return {
        "prompt_tokens_checked": len(offs),
        "prompt_tokens_mismatched": mismatched,
        "prompt_tokens_mismatch_pct": 100.0 * mismatched / len(offs) if offs else math.nan,
        "prompt_tokens_outside_tolerance": sum(
            1 for off, length in offs if abs(off) > prompt_tokens_tolerance(length)
        ),
        "prompt_tokens_off_max": max((off for off, _ in offs), key=abs, default=0),
    }


REJECTION_STATUSES = frozenset({"http_429", "http_503"})


def is_rejection(row: RequestRow) -> bool:
    """Turned away by the server's admission control (429/503: "retry later"), not broken: a server
    that sheds load past its capacity instead of queueing without bound does so by design, and a
    sweep's levels above capacity are expected to see it."""
    return row.status in REJECTION_STATUSES


def describe_failures(rows: Sequence[RequestRow]) -> list[str]:
    """One line per error kind among failed rows, with a count and the first error text, so a failed
    level says what failed (`short x2: got 120 of 200 tokens`)."""
    first: dict[str, str] = {}
    counts: dict[str, int] = {}
    for row in rows:
        if not row.ok:
            counts[row.status] = counts.get(row.status, 0) + 1
            first.setdefault(row.status, row.error)
    return [f"{kind} x{count}: {first[kind][:200]}" for kind, count in counts.items()]


def latency_stats(name: str, values: Sequence[float]) -> dict[str, float]:
    """`{name}_mean_s`, `{name}_p50_s`, `{name}_p90_s`, `{name}_p99_s` (NaN when there are no values)."""
    stats = {f"{name}_mean_s": float(np.mean(values)) if len(values) else math.nan}
    for percent in (50, 90, 99):
        stats[f"{name}_p{percent}_s"] = percentile(values, percent)
    return stats


def probe_figures(single: Sequence[RequestRow], prefill: Sequence[RequestRow]) -> dict[str, float]:
    """The offline probes' figures (`bench offline`), from the rows of each probe's requests.

    - single_ttft_s, single_tpot_s: the one-sequence probe's TTFT and TPOT, i.e. its wall time per
      token after the first (the probe is one request alone, so this is the decode step at batch 1)
    - prefill_tok_s = prompt tokens of the prefill probe's ok requests / its duration_s, the
      requests all added at once with max_tokens 1
    A probe that did not run (no rows) or failed gives NaN.
    """
    figures: dict[str, float] = {}
    if single:
        ok = [row for row in single if row.ok]
        figures["single_ttft_s"] = ok[0].ttft_s if ok else math.nan
        figures["single_tpot_s"] = ok[0].tpot_s if ok else math.nan
    if prefill:
        duration = summarize(prefill)["duration_s"]
        tokens = sum(row.prompt_len for row in prefill if row.ok)
        figures["prefill_tok_s"] = tokens / duration if duration and duration > 0 else math.nan
    return figures


HIGHER_IS_BETTER = frozenset(
    {
        "served_req_s",
        "output_tok_s",
        "goodput_req_s",
        "capacity_req_s",
        "prefill_tok_s",
        "prefix_cache_hit_rate",
    }
)
LOWER_IS_BETTER = frozenset(
    {f"{name}_{stat}_s" for name in LATENCY_METRICS for stat in STAT_NAMES}
    | {
        "send_lag_p99_s",
        "failures",
        "client_loop_lag_p99_s",
        "client_loop_stall_s",
        "single_ttft_s",
        "single_tpot_s",
    }
)
# Offline step timing (`bench offline`): `step_ms`, the mean wall time of one step, and the engine's
# phases, `step_<phase>_ms` (engine.step_timing): lower is better, whatever phases the engine names.
STEP_TIMING = re.compile(r"^step(_[a-z]+)?_ms$")
_SPREAD = re.compile(r"_(min|max)(_|$)")


def known_figure(value: object) -> bool:
    """A figure a summary holds: a number, not NaN (a figure never measured is left out or stored as
    NaN). The one test of it for folding trials, budgets, comparisons and the offline lines."""
    return isinstance(value, numbers.Real) and not math.isnan(value)


def metric_direction(key: str) -> Literal["higher", "lower"] | None:
    """'higher' or 'lower' for a summary key that is better that way, None for others.

    Spread columns beside a median (`ttft_p50_s_min`, `..._max`) and identity fields (rate,
    concurrency) are None: they are not compared.
    """
    if _SPREAD.search(key):
        return None
    if key in HIGHER_IS_BETTER:
        return "higher"
    if key in LOWER_IS_BETTER or STEP_TIMING.match(key):
        return "lower"
    return None
