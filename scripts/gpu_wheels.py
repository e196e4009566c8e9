"""The wheels that travel to the GPU machine, and installing them there.

The GPU machine this project gets has its own python3 3.12 and CUDA torch but no network
and none of pyzmq, msgspec, hydra-core, omegaconf or antlr4; only the working tree and an
ignored folder of wheels (`.whl/`) travel. scripts/gpu_check.sh calls this file:

    needs                 requirements to resolve here: drmas's dependencies that the image's
                          documentation does not name, and the test runner
    carry REPORT          name==version of each wheel to carry: pip's resolution REPORT minus
                          what scripts/gpu_image.txt says the image has, plus HEDGE
    check DIR             one version per package, all for cp312 manylinux x86_64, under the
                          size limit, and every requirement met by a carried wheel or the image
    install DIR SITE      on the GPU machine: pip, dry-running against the real image, picks
                          the carried wheels it lacks; they go into SITE (--target) only
    versions              what the run uses (torch, CUDA, GPUs, every requirement)
    isolated SITE_PACKAGES MODULE ARGS...   run MODULE with SITE_PACKAGES but without the
                          installed drmas (its editable finder and metadata), as on the GPU
                          machine where drmas is only on PYTHONPATH (started with python -S)

Only the standard library, plus `packaging` (in the image through transformers, and in .venv).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from urllib.parse import unquote

import tomllib

REPO = Path(__file__).resolve().parents[1]
IMAGE = REPO / "scripts" / "gpu_image.txt"
LIMIT_MIB = 60
DOCUMENTED = {"torch", "transformers", "peft", "safetensors", "msgpack", "scipy", "matplotlib"}
"""What the image's documentation names; the rest of drmas's dependencies are resolved here."""
TEST_RUNNER = ("pytest", "pytest-timeout", "bm25s")
"""From pyproject's dev extra: tests/gpu runs under pytest with per-check timeouts, and the
search check serves bm25 over HTTP (`drmas retriever`, the search extra's bm25s)."""
HEDGE = {"rich", "markdown-it-py", "mdurl", "pygments", "psutil"}
"""In the image only as dependencies of its packages (typer, peft), so not certain: carried
(about 2 MiB); pip there installs them only where the image lacks them."""
LEFT_OUT = {"pyarrow": "read only by `drmas data` and parquet task files, which no GPU check uses"}
"""Not carried, with why: pyarrow's cp312 wheel alone is over half the 60 MiB."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
"""The GPU machine's environment markers, for requirements read here."""


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def pyproject_requirements() -> list[str]:
    """drmas's runtime dependencies and the test runner (pyproject.toml's words)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    dev = project["optional-dependencies"]["dev"]
    runner = [r for r in dev if _req_name(r) in TEST_RUNNER]
    return [*project["dependencies"], *runner]


def _req_name(requirement: str) -> str:
    from packaging.requirements import Requirement

    return canonical(Requirement(requirement).name)


def image_pins() -> dict[str, str]:
    """scripts/gpu_image.txt: name -> pinned version ("" when the line has none)."""
    out = {}
    for line in IMAGE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonical(name)] = version
    return out


def needs() -> None:
    """Requirement lines for pip's resolution here (and constraints: the image's pins)."""
    for r in pyproject_requirements():
        name = _req_name(r)
        if name not in DOCUMENTED and name not in LEFT_OUT:
            print(r)


def carry(report: Path) -> None:
    image = image_pins()
    for item in json.loads(report.read_text())["install"]:
        name, version = canonical(item["metadata"]["name"]), item["metadata"]["version"]
        if name not in LEFT_OUT and (name not in image or name in HEDGE):
            print(f"{name}=={version}")


def _wheels(folder: Path) -> dict[str, Path]:
    """Carried wheels by canonical name; two versions of one package is an error."""
    from packaging.utils import parse_wheel_filename

    out: dict[str, Path] = {}
    for path in sorted(folder.glob("*.whl")):
        name = canonical(parse_wheel_filename(path.name)[0])
        if name in out:
            sys.exit(f"{folder}: two wheels of {name} ({out[name].name}, {path.name}): keep one")
        out[name] = path
    return out


def _requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [line[len("Requires-Dist:") :].strip() for line in text.splitlines()
            if line.startswith("Requires-Dist:")]  # fmt: skip


def check(folder: Path) -> None:
    """Exits 1 naming each problem: the set must install on the GPU machine as it is."""
    from packaging.requirements import Requirement
    from packaging.tags import compatible_tags, cpython_tags
    from packaging.utils import parse_wheel_filename

    wheels = _wheels(folder)
    if not wheels:
        sys.exit(f"{folder} holds no wheels: run bash scripts/gpu_check.sh --prepare")
    supported = {*cpython_tags((3, 12), ["cp312", "abi3", "none"], PLATFORMS),
                 *compatible_tags((3, 12), "cp312", PLATFORMS)}  # fmt: skip
    image = image_pins()
    problems = []
    for path in wheels.values():
        if not set(parse_wheel_filename(path.name)[3]) & supported:
            problems.append(f"{path.name} is not for cp312 manylinux x86_64")
    versions = {n: str(parse_wheel_filename(p.name)[1]) for n, p in wheels.items()}
    wanted = [(r, "drmas") for r in pyproject_requirements()]
    wanted += [(r, name) for name, p in wheels.items() for r in _requires(p)]
    for text, by in wanted:
        req = Requirement(text)
        name = canonical(req.name)
        if req.marker is not None and not req.marker.evaluate(MARKERS):
            continue
        have = versions.get(name, image.get(name))
        if have is None:
            if name not in LEFT_OUT:
                problems.append(f"{by} requires {text}: neither carried nor in the image")
        elif have and not req.specifier.contains(have, prereleases=True):
            where = "carried" if name in versions else "the image (scripts/gpu_image.txt)"
            problems.append(f"{by} requires {text}, but {where} has {name} {have}")
    total = sum(p.stat().st_size for p in wheels.values()) / 2**20
    if total > LIMIT_MIB:
        problems.append(f"the wheels total {total:.1f} MiB, over the {LIMIT_MIB} MiB limit")
    for p in problems:
        print(f"FAILED wheel set: {p}")
    if problems:
        sys.exit(1)
    left = ", ".join(f"{n} ({why})" for n, why in LEFT_OUT.items())
    print(f"PASSED wheel set: {len(wheels)} wheels, one version each, {total:.1f} MiB "
          f"(limit {LIMIT_MIB}); every requirement met for cp312; left out: {left}")  # fmt: skip


def install(folder: Path, site: Path) -> None:
    """The carried wheels the image lacks, into `site`; pip resolves against the image."""
    site.mkdir(parents=True, exist_ok=True)
    wheels = _wheels(folder)
    reqs = [r for r in pyproject_requirements() if _req_name(r) not in LEFT_OUT]
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    if subprocess.run([*pip, "--version"], capture_output=True).returncode != 0:
        _unzip_missing(wheels, site)
        return
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        plan = subprocess.run(
            [*pip, "install", "--dry-run", "--quiet", "--no-index", "--find-links", str(folder),
             "--report", str(report), *reqs],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if plan.returncode != 0:
            sys.exit(
                "pip cannot meet drmas's requirements from this image plus the carried "
                f"wheels:\n{plan.stdout}{plan.stderr}\nadd the missing package to "
                "scripts/gpu_wheels.py (HEDGE) and run --prepare again"
            )
        chosen = [
            _local(i["download_info"]["url"]) for i in json.loads(report.read_text())["install"]
        ]
    if chosen:
        subprocess.run(
            [*pip, "install", "--quiet", "--no-index", "--no-deps", "--target", str(site),
             *map(str, chosen)],
            check=True, timeout=300,
        )  # fmt: skip
    names = sorted(p.name for p in chosen)
    print(f"installed {len(names)} carried wheel(s) into {site}: {', '.join(names) or 'none'}")
    print(f"the image already had: {', '.join(sorted(set(wheels) - {_name(p) for p in chosen}))}")


def _local(url: str) -> Path:
    if not url.startswith("file://"):
        sys.exit(f"pip chose {url}, which is not a carried wheel: nothing can be fetched here")
    return Path(unquote(url[len("file://") :]))


def _name(path: Path) -> str:
    from packaging.utils import parse_wheel_filename

    return canonical(parse_wheel_filename(path.name)[0])


def _unzip_missing(wheels: dict[str, Path], site: Path) -> None:
    """No pip on this python: a wheel is a zip to unpack into site-packages; only those whose
    distribution is not installed (any version)."""
    from importlib.metadata import PackageNotFoundError, version

    for name, path in wheels.items():
        try:
            print(f"{name}: the image has {version(name)} (no pip: not checked against drmas)")
        except PackageNotFoundError:
            with zipfile.ZipFile(path) as z:
                z.extractall(site)
            print(f"{name}: unpacked {path.name} into {site}")


def versions() -> None:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    print(f"python {sys.version.split()[0]} ({sys.executable})")
    print(f"torch {torch.__version__} cuda {torch.version.cuda} gpus {torch.cuda.device_count()}")
    for i in range(torch.cuda.device_count()):
        total = torch.cuda.get_device_properties(i).total_memory / 2**30
        print(f"  cuda:{i} {torch.cuda.get_device_name(i)} {total:.0f} GiB")
    for r in [*pyproject_requirements(), "vllm", "sglang"]:
        name = _req_name(r)
        try:
            print(f"  {name} {version(name)}")
        except PackageNotFoundError:
            print(f"  {name}: not installed")


def isolated(site_packages: Path, module: str, args: list[str]) -> None:
    """Under python -S: site_packages without drmas's editable finder and dist-info, the
    repository first on sys.path, then MODULE as __main__."""
    import importlib.metadata
    import runpy
    import site

    overlay = Path(tempfile.mkdtemp(prefix="drmas-site-"))
    for entry in site_packages.iterdir():
        if not (entry.name.startswith(("drmas-", "__editable__")) and "drmas" in entry.name):
            (overlay / entry.name).symlink_to(entry)
    tree = Path(tempfile.mkdtemp(prefix="drmas-tree-"))  # the package only: the repository's
    (tree / "drmas").symlink_to(REPO / "drmas")  # drmas.egg-info (ignored) does not travel
    sys.path.insert(0, str(tree))
    site.addsitedir(str(overlay))
    try:
        importlib.metadata.distribution("drmas")
        sys.exit("drmas is still installed in this overlay: the check would prove nothing")
    except importlib.metadata.PackageNotFoundError:
        pass
    import drmas

    if Path(drmas.__file__).resolve().parents[1] != REPO:
        sys.exit(f"drmas imported from {drmas.__file__}, not from {REPO}")
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main() -> None:
    command, *rest = sys.argv[1:] or ["--help"]
    if command == "needs":
        needs()
    elif command == "carry":
        carry(Path(rest[0]))
    elif command == "check":
        check(Path(rest[0]))
    elif command == "install":
        install(Path(rest[0]), Path(rest[1]))
    elif command == "versions":
        versions()
    elif command == "isolated":
        isolated(Path(rest[0]), rest[1], rest[2:])
    else:
        sys.exit((__doc__ or "").split("\n\n")[1])


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
