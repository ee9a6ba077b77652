"""Benchmark: replays a seeded workload against any OpenAI-compatible server over HTTP.

suite (a whole run) -> probe, runner -> workload, client (one request -> RequestRow) -> metrics
(summaries) -> results (files) -> report (HTML) / compare (regressions). `python -m bench` is the CLI.
It imports nothing from `engine` or `server`.
"""
