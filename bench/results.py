"""Result files: writing a run folder (requests.csv, run.json) and reading any result back.

`load_result` accepts a run folder, its run.json (of `bench run` or `bench offline`), or the perf
tier's summary JSON and returns one `Result` shape (levels keyed by mode and rate or concurrency, the
offline section by its mode key), which report and compare consume.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from bench.metrics import RequestRow

REQUESTS_CSV = "requests.csv"
RUN_JSON = "run.json"


@dataclass
class Result:
    """One target's figures. Each level has `mode` ("open" or "closed"), `rate` or `concurrency`,
    and flat metric keys (bench.metrics). `offline` is the `bench offline` section (mode key such as
    `all`, `closed-8`, `probes` -> flat figures). `meta` is the rest of run.json or the summary JSON."""

    target: str
    path: str
    levels: list[dict[str, Any]]
    capacity_req_s: float | None = None
    capacity_still_rising: bool | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    offline: dict[str, dict[str, Any]] = field(default_factory=dict)


def level_key(level: dict[str, Any]) -> tuple[str, float]:
    """Levels are matched by (mode, rate) in open loop and (mode, concurrency) in closed loop."""
    mode = level.get("mode", "open")
    return (mode, float(level["rate"] if mode == "open" else level["concurrency"]))


def json_safe(value: Any) -> Any:
    """NaN and infinities become null, so run.json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_run(out_dir: str | Path, run: dict[str, Any], rows: Sequence[RequestRow]) -> Path:
    """Write `run` as run.json and `rows` as requests.csv under `out_dir` (created); returns the folder."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RUN_JSON).write_text(json.dumps(json_safe(run), indent=2) + "\n")
    write_rows(folder / REQUESTS_CSV, rows)
    return folder


def write_rows(path: Path, rows: Sequence[RequestRow]) -> None:
    names = [f.name for f in fields(RequestRow) if f.name != "itls_s"]
    names += ["ttft_s", "e2e_s", "tpot_s", "send_lag_s", "itl_mean_s", "itl_max_s", "itls_s"]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=names)
        writer.writeheader()
        for row in rows:
            record = row.to_record()
            writer.writerow({k: "" if _blank(record[k]) else record[k] for k in names})


def read_rows(path: str | Path) -> list[RequestRow]:
    """requests.csv (or a folder holding it) back into rows."""
    path = Path(path)
    if path.is_dir():
        path = path / REQUESTS_CSV
    with path.open(newline="") as handle:
        return [RequestRow.from_record(_numbers(record)) for record in csv.DictReader(handle)]


def _blank(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _numbers(record: dict[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, text in record.items():
        if key in ("target", "mode", "status", "error", "itls_s", "warmup") or text == "":
            out[key] = text
        else:
            out[key] = float(text)
    return out


def load_result(path: str | Path) -> Result:
    """A run folder, a run.json, or a perf-tier summary JSON, as a `Result`."""
    path = Path(path)
    file = path / RUN_JSON if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"{path}: not a run folder, run.json or summary JSON")
    data = json.loads(file.read_text())
    if "levels" in data:  # our run.json
        return Result(
            target=data.get("target") or file.parent.name,
            path=str(path),
            levels=[_nan_for_null(level) for level in data["levels"]],
            capacity_req_s=data.get("capacity_req_s"),
            capacity_still_rising=data.get("capacity_still_rising"),
            meta={k: v for k, v in data.items() if k not in ("levels", "offline")},
            offline=_offline(data),
        )
    if "open_loop" in data or "closed_loop" in data or "offline" in data:  # the perf tier's summary
        levels = [{"mode": "open", **level} for level in data.get("open_loop") or []]
        levels += [{"mode": "closed", **level} for level in data.get("closed_loop") or []]
        return Result(
            target=str(data.get("target") or file.stem),
            path=str(path),
            levels=[_nan_for_null(level) for level in levels],
            capacity_req_s=data.get("capacity_req_s"),
            capacity_still_rising=data.get("capacity_still_rising"),
            meta={k: v for k, v in data.items() if k not in ("open_loop", "closed_loop", "offline")},
            offline=_offline(data),
        )
    raise ValueError(
        f"{file}: neither a run.json (no 'levels') nor a summary JSON (no 'open_loop'/'closed_loop')"
    )


def _offline(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {key: _nan_for_null(entry) for key, entry in (data.get("offline") or {}).items()}


def _nan_for_null(level: dict[str, Any]) -> dict[str, Any]:
    keep = ("rate", "concurrency", "offered_req_s", "mode")
    return {k: (math.nan if v is None and k not in keep else v) for k, v in level.items()}
