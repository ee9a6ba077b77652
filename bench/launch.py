"""Start and stop the OpenAI-compatible server under test as a subprocess: this project's or vLLM's.

The perf tier starts one server per target, waits for /health (vLLM may take minutes), measures, and
always stops it, the whole process group, on failure too. vLLM is found as an ordinary install or, for
a staged copy, through PERF_VLLM_ENV: a shell file sourced before starting it (it sets PYTHONPATH and
whatever else the staged site needs).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench import slowdown

VLLM_ENV_VARIABLE = "PERF_VLLM_ENV"
# The context both targets are started with: seed-mix prompts reach 4,096 tokens, plus up to 256 generated.
MAX_MODEL_LEN = 4352


SECRET_FLAGS = ("--api-key",)  # their values never reach a summary or a server description


def redact_args(args: list[str]) -> list[str]:
    """`args` with the value of each secret flag (`--api-key KEY` or `--api-key=KEY`) replaced by ***."""
    redacted: list[str] = []
    for arg in args:
        flag, equals, _ = arg.partition("=")
        if redacted and redacted[-1] in SECRET_FLAGS:
            redacted.append("***")
        elif equals and flag in SECRET_FLAGS:
            redacted.append(f"{flag}=***")
        else:
            redacted.append(arg)
    return redacted


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerSpec:
    """How to start one target. `args` are the target's own flags, recorded in the summary."""

    target: str  # "engine" or "vllm"
    model_dir: str
    port: int
    args: list[str] = field(default_factory=list)
    env_file: str | None = None  # sourced before a vLLM start
    env: dict[str, str] = field(default_factory=dict)  # set in the server's environment
    cwd: str | None = None  # where it runs: `bench ab` starts each side from its own git worktree
    # The module the engine's server runs as: `server`, or one that starts it changed for a
    # measurement (`bench.host_cost`, which takes the model out).
    module: str = "server"

    @classmethod
    def for_target(
        cls,
        target: str,
        model_dir: str,
        dtype: str,
        port: int | None = None,
        max_model_len: int = MAX_MODEL_LEN,
        seed: int = 0,
        prefix_cache: bool = False,
    ) -> ServerSpec:
        """The target as the perf tier starts it: its flags (target_args), a free port unless given,
        and a staged vLLM through $PERF_VLLM_ENV when that is set. `prefix_cache`: the cache left on
        (each target's default), and vLLM's development endpoints on (VLLM_RESET_ENV) so that it
        serves POST /reset_prefix_cache, as this project's server always does."""
        return cls(
            target,
            model_dir,
            port or free_port(),
            target_args(target, dtype, max_model_len, seed, prefix_cache),
            env_file=vllm_env_file() if target == "vllm" else None,
            env=dict(VLLM_RESET_ENV) if prefix_cache and target == "vllm" else {},
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        host = ["--host", "127.0.0.1", "--port", str(self.port)]
        if self.target == "engine":
            return slowdown.wrap(
                [sys.executable, "-m", self.module, "--model", self.model_dir, *host, *self.args], "engine"
            )
        if self.target == "vllm":
            launch = [
                sys.executable,
                "-m",
                "vllm.entrypoints.cli.main",
                "serve",
                self.model_dir,
                *host,
                *self.args,
            ]
            return sourcing(self.env_file, launch)
        raise ValueError(f"unknown target {self.target!r} (engine or vllm)")


def vllm_env_file() -> str | None:
    """The staged vLLM's env file ($PERF_VLLM_ENV), or None for an ordinary install."""
    return os.environ.get(VLLM_ENV_VARIABLE) or None


def sourcing(env_file: str | None, command: list[str]) -> list[str]:
    """`command` run after sourcing `env_file` (a staged vLLM's PYTHONPATH and the like), if one is given.

    Every process that imports vLLM is started this way: its server, and `bench offline`'s worker."""
    if env_file:
        return ["bash", "-c", 'source "$0" && exec "$@"', env_file, *command]
    return command


# Both targets turn the prefix cache on by default; the perf tier starts them with it off (the seed-mix
# repeats its prompts at every level, so with the cache on every level after the first would be a full
# hit; the stored baselines ran without it), except for its prefix-cache cases.
CACHE_OFF_FLAG = "--no-enable-prefix-caching"
VLLM_RESET_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # vLLM serves POST /reset_prefix_cache only with this


def engine_args(dtype: str, max_model_len: int, seed: int = 0) -> list[str]:
    """As vllm_args: no prefix caching (CACHE_OFF_FLAG)."""
    return [
        CACHE_OFF_FLAG,
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--seed",
        str(seed),
    ]


# Engine flags a server of an older commit may not know, each asking for what such a server does anyway
# (it has no prefix cache): `bench ab` starts the base commit's server with the new commit's flags.
OPTIONAL_ENGINE_FLAGS = (CACHE_OFF_FLAG,)


def server_help(spec: ServerSpec, timeout_s: float = 300.0) -> str:
    """`python -m <module> --help` of the engine server `spec` starts, run where it runs ('' if it
    fails: a server whose help cannot be read is taken to know none of the optional flags)."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", spec.module, "--help"],
            cwd=spec.cwd,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def known_args(args: list[str], help_text: str) -> list[str]:
    """`args` without the OPTIONAL_ENGINE_FLAGS that `help_text` does not list (they take no value)."""
    listed = set(re.findall(r"--[\w-]+", help_text))
    return [arg for arg in args if arg not in OPTIONAL_ENGINE_FLAGS or arg in listed]


def vllm_args(dtype: str, max_model_len: int, seed: int = 0) -> list[str]:
    """The baseline's definition: same dtype and context as the engine, no prefix caching, vLLM's defaults otherwise."""
    return [
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        CACHE_OFF_FLAG,
        "--seed",
        str(seed),
    ]


def target_args(
    target: str, dtype: str, max_model_len: int = MAX_MODEL_LEN, seed: int = 0, prefix_cache: bool = False
) -> list[str]:
    """The flags the perf tier starts `target` with (see engine_args and vllm_args); with
    `prefix_cache`, the same without CACHE_OFF_FLAG."""
    if target == "engine":
        args = engine_args(dtype, max_model_len, seed)
    elif target == "vllm":
        args = vllm_args(dtype, max_model_len, seed)
    else:
        raise ValueError(f"unknown target {target!r} (engine or vllm)")
    return [arg for arg in args if arg != CACHE_OFF_FLAG] if prefix_cache else args


def healthy(base_url: str, timeout_s: float = 2.0) -> bool:
    """Whether the server at `base_url` (…/v1) answers /health with 200."""
    try:
        return httpx.get(base_url.removesuffix("/v1") + "/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def vllm_unavailable_reason() -> str | None:
    """None when vLLM can be started here, else why not."""
    env_file = vllm_env_file()
    if env_file:
        return None if Path(env_file).is_file() else f"{VLLM_ENV_VARIABLE}={env_file} is not a file"
    try:
        import importlib.util

        if importlib.util.find_spec("vllm") is not None:
            return None
    except (ImportError, ValueError):
        pass
    return (
        f"vLLM is not installed: `pip install vllm`, or set {VLLM_ENV_VARIABLE} to a staged site's env file"
    )


def stop_servers_on_sigterm() -> None:
    """Make SIGTERM raise KeyboardInterrupt in this process (the main thread), as Ctrl-C does, so
    that the `finally` blocks and fixture teardowns that stop its servers run; a second SIGTERM
    ends it at once. Why: a server starts in a process session of its own (ServerProcess.start), so
    a parent that SIGTERM ends outright (a CI step's time limit, `timeout(1)`) leaves it running,
    holding ~90% of the GPU's memory, and the next server started on that GPU fails."""

    def interrupt(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, interrupt)


class ServerProcess:
    """A running server; use as a context manager so it is stopped whatever happens."""

    def __init__(self, spec: ServerSpec, log_path: str | Path) -> None:
        self.spec = spec
        self.log_path = Path(log_path)
        self.process: subprocess.Popen[bytes] | None = None
        self.ready_after_s: float | None = None

    def start(self, timeout_s: float) -> ServerProcess:
        """Start in a new process session (so stop() can end the whole group, and a server started
        by `bench serve` outlives the command that started it) and wait for /health. An engine server
        run from another checkout (`spec.cwd`) keeps only the OPTIONAL_ENGINE_FLAGS its --help lists."""
        if self.spec.target == "engine" and self.spec.cwd is not None:
            # Another checkout's server (`bench ab`'s base commit) may predate an optional flag.
            self.spec.args = known_args(self.spec.args, server_help(self.spec))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.spec.env)
        started = time.monotonic()
        self.process = subprocess.Popen(
            self.spec.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=self.spec.cwd,
            start_new_session=True,
        )
        log.close()
        try:
            while time.monotonic() - started < timeout_s:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"{self.spec.target} server exited with {self.process.returncode} before it was ready:\n{self.log_tail()}"
                    )
                if healthy(self.spec.base_url):
                    self.ready_after_s = time.monotonic() - started
                    return self
                time.sleep(0.5)
        except KeyboardInterrupt:
            # Ctrl-C, or SIGTERM (stop_servers_on_sigterm), while it starts: no one holds it yet
            self.stop()
            raise
        self.stop()
        raise TimeoutError(
            f"{self.spec.target} server not healthy after {timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM to the whole process group, SIGKILL after grace_s; returns the exit code."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            return self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait()
        except ProcessLookupError:
            return self.process.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def describe(self) -> dict[str, object]:
        """What a measurement against this server must record about it (written by `bench serve`)."""
        return {
            "target": self.spec.target,
            "model_dir": self.spec.model_dir,
            "base_url": self.spec.base_url,
            "args": redact_args(self.spec.args),
            "pid": self.process.pid if self.process else None,
            "ready_after_s": self.ready_after_s,
            "log": str(self.log_path),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _running(pid: int) -> bool:
    """Whether pid is a live process (not gone, not a zombie waiting for its parent to reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # Linux: a zombie's state, the field after the name in parentheses, is Z
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def stop_described_server(info: dict[str, object], grace_s: float = 30.0) -> bool:
    """Stop a server `bench serve` left running, from its description: SIGTERM to its process group
    (the server drains), SIGKILL to the group after grace_s, as ServerProcess.stop does for a server
    this process holds. Returns whether it was still running."""
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        raise ValueError(f"the server description has no pid: {pid!r}")
    if not _running(pid):
        return False
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace_s
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _running(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    return True


def load_server_info(path: str | Path) -> dict[str, object]:
    """A description written by `bench serve`; raises ValueError saying what is wrong with it."""
    try:
        info = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the server description {path}: {exc}") from exc
    missing = [key for key in ("target", "base_url", "args") if key not in info]
    if not isinstance(info, dict) or missing:
        raise ValueError(
            f"{path} is not a description written by `python -m bench serve` (missing {missing})"
        )
    return info
