"""What the figures were measured on: GPU, driver, CPU model, cores, host, boot, library versions.

pytest-benchmark records none of the GPU facts, and the perf tier judges a stored engine reference
only on the machine that measured it (`same_machine`), so the description is made here once, from
nvidia-smi and /proc (no torch import).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any


def _nvidia_smi(query: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.stdout.strip().splitlines()
    return first[0].strip() if out.returncode == 0 and first else None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_slug(gpu_name: str | None) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': lowercased, every run of non-alphanumerics one '-'; no GPU -> 'cpu'."""
    if not gpu_name:
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")


def boot_id() -> str | None:
    """The kernel's id of this boot (Linux), or None: a fresh VM, or one rebooted, has a new one."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def checkout_engine_version() -> str:
    """This checkout's engine version, whether or not it is pip-installed: the installed package's
    metadata (scripts/install.sh installs it editable), read without importing the engine, whose
    torch and transformers cost ~3 s a process; else the package's own, imported (a checkout run from
    its folder, as on the GPU machine). For the test tiers, which describe the engine they measure."""
    installed = _version("paged-engine")
    if installed is not None:
        return installed
    import engine

    return engine.__version__


def describe_machine(engine_version: str | None = None) -> dict[str, Any]:
    """engine_version: the caller's (checkout_engine_version), when the engine is not an installed
    package (bench's measurements never import it)."""
    gpu = _nvidia_smi("name")
    return {
        "gpu": gpu,
        "gpu_slug": gpu_slug(gpu),
        "gpu_driver": _nvidia_smi("driver_version"),
        "gpu_memory": _nvidia_smi("memory.total"),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "hostname": socket.gethostname(),
        "boot_id": boot_id(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "engine": engine_version or _version("paged-engine"),
        "vllm": _version("vllm"),
    }


def same_machine(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Same GPU, CPU model, core count, host name and boot; unknown (missing) descriptions or boot ids
    count as different. The boot id is what tells two lent VMs apart when they share a generic host
    name ("vm"), CPU model and core count: a fresh CI machine never matches a stored reference."""
    if not a or not b or not a.get("boot_id"):
        return False
    return all(a.get(key) == b.get(key) for key in ("gpu", "cpu_model", "cpu_count", "hostname", "boot_id"))
