"""Server flags recorded in summaries and server descriptions never carry an API key."""

from __future__ import annotations

from bench.launch import redact_args


def test_api_key_values_are_redacted_in_both_spellings() -> None:
    args = ["--dtype", "float32", "--api-key", "sk-secret", "--api-key=sk-other", "--seed", "0"]
    assert redact_args(args) == ["--dtype", "float32", "--api-key", "***", "--api-key=***", "--seed", "0"]
    assert "sk-secret" not in " ".join(redact_args(args))


def test_args_without_a_key_are_unchanged() -> None:
    assert redact_args(["--max-model-len", "4352"]) == ["--max-model-len", "4352"]
