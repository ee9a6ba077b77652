"""The offline case: the target's step-level engine driven in process (`bench offline`), no HTTP.

It runs in a child process before the target's server starts (a server holds ~90% of GPU memory),
once per sampling mode the profile runs (the workload's temperature and top_p reach the target's
engine), all of the profile's requests at once, then the two probes; `--trials` rounds through
pytest-benchmark, the figures into the summary's `offline` section, budgets (`offline_*`) against
the reference. A running server (`--server-url`, `--server-info`) holds the GPU: the case skips.
"""

from __future__ import annotations

import pytest

from bench.budgets import check_offline
from bench.launch import vllm_unavailable_reason
from bench.offline import OfflineConfig, OfflineError, failed_entries, run_offline
from bench.trials import GREEDY, fold_offline

pytestmark = pytest.mark.perf


def test_offline(benchmark, target, mode, workload, profile, perf, recorder, model_folder):
    if perf.server_url or perf.server_infos:
        pytest.skip(
            "offline runs start the target in a process of their own, and the server given by "
            "--server-url/--server-info holds the GPU: run `python -m bench offline` before starting it"
        )
    if target == "vllm" and (reason := vllm_unavailable_reason()):
        pytest.skip(reason)
    recorder.stop_servers()  # the GPU to this target alone (--target both: vLLM's server is still up)
    config = OfflineConfig(target, model_folder(), perf.dtype, workload=workload, load=profile.offline)
    sections = []
    worker: dict = {}
    log = perf.out / f"{target}-offline{'' if mode == GREEDY else f'-{mode}'}.log"

    def trial() -> None:
        try:
            run = run_offline(config, log_path=log)
        except OfflineError as exc:
            pytest.fail(str(exc), pytrace=False)
        sections.append(run.section)
        worker.update(run.worker)

    benchmark.pedantic(trial, rounds=perf.trials, iterations=1)
    record = recorder.record(target, mode)
    record.offline_trials = sections
    record.header["offline_target"] = worker.get("target")
    if record.header.get("version") is None:
        record.header["version"] = (worker.get("target") or {}).get("version")
    folded = fold_offline(sections)
    benchmark.extra_info.update(target=target, sampling=mode, case="offline", offline=folded)
    failed = sorted({key for section in sections for key in failed_entries(section)})
    record.notes.extend(f"failed requests, offline {key}" for key in failed)
    assert not failed, f"requests failed offline in {failed}: see {log}"
    recorder.check(
        target,
        mode,
        lambda reference, budgets: check_offline(folded, reference, budgets),
        section="offline",
    )
