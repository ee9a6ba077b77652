"""Benchmark: replays a seeded workload against any OpenAI-compatible server over HTTP.

workload -> runner -> client (one request -> RequestRow) -> metrics (summaries) -> results (files)
-> report (HTML) / compare (regressions). It imports nothing from `engine` or `server`.
"""
