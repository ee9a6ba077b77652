"""The lock (requirements/cpu.txt) matches pyproject.toml: every dependency of the dev extra, and of
the extras it pulls in, is locked at a version its range admits, and so are the CPU machine's torch and
Triton (requirements/cpu.in). A range changed without `bash scripts/lock.sh` fails here, before a user's
first install meets a version the tests never ran with."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PINNED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "requirements/cpu.txt").read_text().splitlines():
        match = PINNED.match(line)
        if match:
            pins[_name(match.group(1))] = Version(match.group(2))
    return pins


def required() -> list[Requirement]:
    """The project's dependencies and its dev extra's, with the extras dev names expanded."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    requirements, pending, seen = [Requirement(r) for r in project["dependencies"]], ["dev"], set()
    while pending:
        extra = pending.pop()
        seen.add(extra)
        for text in extras[extra]:
            requirement = Requirement(text)
            if _name(requirement.name) == _name(project["name"]):
                pending.extend(sorted(requirement.extras - seen))
            else:
                requirements.append(requirement)
    cpu_in = (REPO / "requirements/cpu.in").read_text().splitlines()
    requirements += [Requirement(line) for line in cpu_in if line.strip() and not line.startswith("#")]
    return [r for r in requirements if r.marker is None or r.marker.evaluate()]


def test_every_dependency_is_locked_at_a_version_its_range_admits():
    pins = locked()
    problems = []
    for requirement in required():
        version = pins.get(_name(requirement.name))
        if version is None:
            problems.append(f"{requirement} is not in the lock")
        elif not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{requirement}: the lock has {version}")
    assert not problems, "run `bash scripts/lock.sh` and commit requirements/cpu.txt:\n" + "\n".join(problems)


def test_the_lock_holds_the_cpu_build_of_torch_and_no_local_path():
    assert locked()["torch"].local == "cpu"
    lines = (REPO / "requirements/cpu.txt").read_text().splitlines()
    assert not [line for line in lines if " @ " in line or line.startswith("-e")]  # e.g. this checkout
