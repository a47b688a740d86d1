"""Build the smallest folder of wheels that makes jaxrl installable on a machine without network.

    python scripts/wheelhouse.py --have FREEZE.txt --python-version 3.12 [--extra cuda] -o DIR

FREEZE.txt is the target's ``pip freeze`` (scripts/images/ holds the known ones). The wheelhouse is
every package jaxrl needs (its dependencies plus ``--extra``, markers evaluated for the target's
Python and platform) that the target lacks or has at a version jaxrl's tree does not accept, plus
jaxrl's own wheel. On the target, one command installs it:

    pip install --no-index --no-deps DIR/*.whl

Why this shape: an accelerator host is usually an air-gapped image that already carries the heavy
part (jax with its CUDA plugin, torch, transformers: gigabytes). Downloading the whole set with
image pins carries ~108 MiB and fails offline on test pins and on jaxrl's isolated build; carrying
only the difference is ~30 MiB and installs in seconds, with ``--no-deps`` so pip never reaches for
an index. The resolution is ``uv pip compile`` with the image's freeze as the preferred versions
(uv evaluates markers for the target Python/platform; pip evaluates them for the running
interpreter), the downloads ``pip download --no-deps`` of exact pins, the own wheel
``pip wheel --no-deps --no-build-isolation`` (no network: setuptools comes from this environment).
DIR/wheelhouse.json records what was carried, kept and upgraded.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
SELF = "jaxrl"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*===?\s*([^\s;#]+)")
_DIRECT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*@\s*\S+")
_PLATFORM = re.compile(r"^(x86_64|aarch64)-manylinux_2_(\d+)$")


class WheelhouseError(Exception):
    """One line for the user: what is wrong and what to do."""


def parse_freeze(text: str) -> dict[str, str | None]:
    """``pip freeze`` output -> {canonical name: version}; None for a direct reference
    (``name @ file://...``: installed, version unknown). Comments, blank lines, editable installs
    and jaxrl itself are left out (jaxrl's own wheel is always carried)."""
    have: dict[str, str | None] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", "-e ", "--editable")):
            continue
        if m := _PIN.match(line):
            name, version = canonicalize_name(m[1]), m[2]
        elif m := _DIRECT.match(line):
            name, version = canonicalize_name(m[1]), None
        else:
            raise WheelhouseError(f"--have line {n}: {raw!r} is not 'name==version' or 'name @ url' (pip freeze's forms)")
        if name != SELF:
            have[name] = version
    return have


def target_environment(python_version: str, platform: str) -> dict[str, str]:
    """PEP 508 marker values of the target (Linux, CPython) for ``packaging`` to evaluate."""
    machine = _platform_parts(platform)[0]
    return {"python_version": python_version, "python_full_version": f"{python_version}.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": machine, "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def direct_requirements(pyproject: dict, extras: list[str], env: dict[str, str]) -> list[Requirement]:
    """jaxrl's own requirements (dependencies + ``extras``) whose markers hold on the target."""
    optional = pyproject["project"].get("optional-dependencies", {})
    if unknown := sorted(set(extras) - set(optional)):
        raise WheelhouseError(f"--extra: unknown {', '.join(unknown)}; jaxrl has {', '.join(sorted(optional))}")
    out = []
    for extra in ["", *extras]:
        for text in pyproject["project"]["dependencies"] if not extra else optional[extra]:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({**env, "extra": extra}):
                out.append(req)
    return out


def rejected(have: dict[str, str | None], reqs: list[Requirement]) -> dict[str, str]:
    """Packages the target has at a version one of jaxrl's own specifiers refuses: {name: why}.
    These must be carried; the resolution is checked against this list."""
    out = {}
    for req in reqs:
        name = canonicalize_name(req.name)
        version = have.get(name)
        if version is not None and not req.specifier.contains(version, prereleases=True):
            out[name] = f"target has {version}, jaxrl needs {req.name}{req.specifier}"
    return out


@dataclass
class Plan:
    """What goes into the wheelhouse: ``carry`` {name: version}; ``kept`` the target's packages
    used as they are; ``upgraded`` {name: "old -> new"} the target's packages replaced."""

    carry: dict[str, str]
    kept: list[str]
    upgraded: dict[str, str]


def plan(resolved: dict[str, str], have: dict[str, str | None]) -> Plan:
    """The resolved set minus what the target already has at that version (a direct reference,
    version unknown, counts as had: the image's build is used)."""
    carry, kept, upgraded = {}, [], {}
    for name, version in sorted(resolved.items()):
        if name == SELF:
            continue
        if name in have and have[name] in (version, None):
            kept.append(name)
            continue
        carry[name] = version
        if name in have:
            upgraded[name] = f"{have[name]} -> {version}"
    return Plan(carry, kept, upgraded)


def leave_out(p: Plan, names: list[str]) -> tuple[Plan, list[str]]:
    """``p`` without the carried packages ``names`` (``--skip``), and their canonical names; a
    name it does not carry is refused (a typo would carry the package after all)."""
    skipped = sorted({canonicalize_name(n) for n in names})
    if unknown := [n for n in skipped if n not in p.carry]:
        raise WheelhouseError(f"--skip {', '.join(unknown)}: not in the wheelhouse (it carries {', '.join(p.carry)})")
    return Plan({n: v for n, v in p.carry.items() if n not in skipped}, p.kept, p.upgraded), skipped


def _platform_parts(platform: str) -> tuple[str, int]:
    m = _PLATFORM.match(platform)
    if not m:
        raise WheelhouseError(f"--platform {platform!r}: use ARCH-manylinux_2_GLIBC, e.g. x86_64-manylinux_2_28")
    return m[1], int(m[2])


def pip_platform_tags(platform: str) -> list[str]:
    """``x86_64-manylinux_2_28`` -> every wheel platform tag a glibc 2.28 x86_64 host installs,
    newest first (pip 23's ``--platform`` does not expand manylinux_2_28 to older tags itself)."""
    arch, glibc = _platform_parts(platform)
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 16, -1)]
    return [*tags, f"manylinux2014_{arch}"] + ([f"manylinux2010_{arch}", f"manylinux1_{arch}"] if arch == "x86_64" else [])


def _uv() -> str:
    try:
        from uv import find_uv_bin
    except ImportError:
        found = shutil.which("uv")
        if found is None:
            raise WheelhouseError("uv is not installed: pip install uv (it resolves for the target Python/platform)")
        return found
    return find_uv_bin()


def _run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode:
        errors = [x for x in proc.stderr.splitlines() if x.strip() and "is ignored: it is neither" not in x]
        raise WheelhouseError(f"{what} failed: {' | '.join(errors[-6:])}")
    return proc.stdout


def resolve(have: dict[str, str | None], extras: list[str], python_version: str, platform: str,
            pyproject: Path) -> dict[str, str]:
    """jaxrl's full requirement set for the target, preferring the target's versions (uv keeps a
    pinned version of its output file when the requirements accept it)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "resolved.txt"
        out.write_text("".join(f"{n}=={v}\n" for n, v in have.items() if v is not None))
        cmd = [_uv(), "pip", "compile", str(pyproject), *(a for e in extras for a in ("--extra", e)),
               "--python-version", python_version, "--python-platform", platform, "--only-binary", ":all:",
               "--no-header", "--no-annotate", "--quiet", "-o", str(out)]
        _run(cmd, "uv pip compile")
        pins = parse_freeze(out.read_text())
    return {n: v for n, v in pins.items() if v is not None}


def download(carry: dict[str, str], python_version: str, platform: str, dest: Path) -> None:
    """Exact pins, no dependencies (the set is already complete), wheels only, for the target."""
    if not carry:
        return
    tags = [a for t in pip_platform_tags(platform) for a in ("--platform", t)]
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
          "--python-version", python_version, "--implementation", "cp", *tags, "-d", str(dest),
          *(f"{n}=={v}" for n, v in carry.items())], "pip download")


def build_self(dest: Path) -> Path:
    """jaxrl's wheel from this checkout, without network (setuptools from this environment)."""
    before = set(dest.glob("jaxrl-*.whl"))
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(dest),
          str(ROOT)], "pip wheel (jaxrl; needs setuptools>=69 in this environment)")
    (wheel,) = set(dest.glob("jaxrl-*.whl")) - before
    return wheel


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--have", required=True, type=Path, metavar="FREEZE.txt", help="the target's pip freeze")
    p.add_argument("--python-version", required=True, metavar="X.Y", help="the target's Python, e.g. 3.12")
    p.add_argument("--platform", default="x86_64-manylinux_2_28",
                   help="the target's ARCH-manylinux_2_GLIBC (default x86_64-manylinux_2_28)")
    p.add_argument("--extra", action="append", default=[], help="jaxrl extras to include (repeatable): cuda, tpu ...")
    p.add_argument("--skip", action="append", default=[], metavar="NAME",
                   help="a package to leave out although jaxrl requires it (repeatable), for a carry limit; "
                        "only for packages the target's work never imports (docs/accelerator.md)")
    p.add_argument("-o", "--out", required=True, type=Path, metavar="DIR", help="a new or empty folder")
    a = p.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", a.python_version):
        p.error(f"--python-version {a.python_version!r}: give major.minor, e.g. 3.12")
    requires = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    if not requires.contains(f"{a.python_version}.0"):
        p.error(f"--python-version {a.python_version}: jaxrl requires Python {requires}")
    if not a.have.is_file():
        p.error(f"--have {a.have}: no such file (write it on the target with: pip freeze > FREEZE.txt)")
    if a.out.exists() and any(a.out.iterdir()):
        p.error(f"-o {a.out}: exists and is not empty; name a new folder (a finished wheelhouse is never overwritten)")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    pyproject_path = ROOT / "pyproject.toml"
    try:
        _platform_parts(a.platform)
        have = parse_freeze(a.have.read_text())
        reqs = direct_requirements(tomllib.loads(pyproject_path.read_text()), a.extra,
                                   target_environment(a.python_version, a.platform))
        must = rejected(have, reqs)
        resolved = resolve(have, a.extra, a.python_version, a.platform, pyproject_path)
        p = plan(resolved, have)
        p, skipped = leave_out(p, a.skip)
        if missed := sorted(set(must) - set(p.carry) - set(skipped)):
            raise WheelhouseError(f"resolution kept {', '.join(missed)} that jaxrl rejects: {must[missed[0]]}")
        a.out.mkdir(parents=True, exist_ok=True)
        download(p.carry, a.python_version, a.platform, a.out)
        own = build_self(a.out)
    except (WheelhouseError, InvalidRequirement) as e:
        print(f"wheelhouse: {e}", file=sys.stderr)
        return 1
    wheels = sorted(a.out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    record = {"python_version": a.python_version, "platform": a.platform, "extras": a.extra, "have": str(a.have),
              "wheels": [w.name for w in wheels], "bytes": size, "own_wheel": own.name, **asdict(p),
              "rejected_by_jaxrl": must, "skipped": skipped}
    (a.out / "wheelhouse.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"{len(wheels)} wheels ({len(p.carry)} the target lacks + {own.name}), {size / 2**20:.1f} MiB in {a.out}; "
          f"{len(p.kept)} of the target's packages used as they are"
          + (f"; upgraded: {', '.join(f'{k} {v}' for k, v in p.upgraded.items())}" if p.upgraded else "")
          + (f"; left out (--skip): {', '.join(skipped)}" if skipped else ""))
    print("install on the target (no network):")
    print(f"  pip install --no-index --no-deps {a.out}/*.whl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
