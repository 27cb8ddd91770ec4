"""setup.sh and test.sh: a run's environment and the tests' never mix. On a GPU box `bash run_stages.sh` builds
.venv from requirements.txt (CUDA torch, vLLM); `bash test.sh` builds .venv-test from requirements-cpu.txt. A CPU
install over a GPU one would pass pip's check (torch 2.13.0+cpu satisfies torch==2.13.0) and leave the box running
the toy preset, so an environment of the other kind is refused, never installed over."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

REQUIREMENTS_GPU_STAMP = ".installed-gpu-0123456789abcdef"


def clone_with_gpu_venv(tmp_path):
    """A copy of the repository's tracked files whose .venv is a GPU environment as setup.sh stamps it, with a
    `python` that records any call (a pip install into it would be one) and fails."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    clone = tmp_path / "clone"
    for f in files:
        (clone / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, clone / f)
    venv = clone / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / REQUIREMENTS_GPU_STAMP).touch()
    calls = tmp_path / "gpu_python_calls.txt"
    (venv / "bin" / "python").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexit 1\n")
    (venv / "bin" / "python").chmod(0o755)
    return clone, calls


def without_test_venv():
    return {k: v for k, v in os.environ.items() if k not in ("MU_GRPO_VENV", "MU_GRPO_DEVICE")}


@pytest.mark.slow
def test_the_test_command_leaves_a_gpu_environment_alone(tmp_path):
    # test.sh sets up and uses .venv-test (here: this test's own environment, already set up), and never touches
    # the run's .venv (before: `setup.sh cpu` removed its GPU stamp and pip-installed torch 2.13.0+cpu into it)
    clone, calls = clone_with_gpu_venv(tmp_path)
    os.symlink(sys.prefix, clone / ".venv-test")
    proc = subprocess.run(["bash", "test.sh", "--collect-only", "-q", "tests/test_loss.py"], cwd=clone,
                          capture_output=True, text=True, env=without_test_venv(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "test_loss.py" in proc.stdout
    assert not calls.exists(), calls.read_text()
    assert sorted(p.name for p in (clone / ".venv").iterdir()) == sorted(["bin", REQUIREMENTS_GPU_STAMP])


@pytest.mark.slow
def test_a_cpu_setup_refuses_a_gpu_environment_in_one_line(tmp_path):
    # what run_stages.sh would do on a machine that asks for the CPU build (MU_GRPO_DEVICE=cpu) over a GPU .venv
    clone, calls = clone_with_gpu_venv(tmp_path)
    proc = subprocess.run(["bash", "setup.sh", "cpu"], cwd=clone, capture_output=True, text=True,
                          env=without_test_venv(), timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("setup.sh: .venv holds the gpu requirements, not the cpu ones") and "rm -rf .venv" in proc.stderr
    assert not calls.exists()
    assert (clone / ".venv" / REQUIREMENTS_GPU_STAMP).exists()


def probe_wheel(directory):
    """A one-module wheel, written by hand (no build tools, no index): what the small requirements file installs."""
    import zipfile
    directory.mkdir()
    files = {"mu_grpo_probe/__init__.py": "ANSWER = 42\n",
             "mu_grpo_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: mu-grpo-probe\nVersion: 1.0\n",
             "mu_grpo_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + "mu_grpo_probe-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(directory / "mu_grpo_probe-1.0-py3-none-any.whl", "w") as wheel:
        for name, text in {**files, "mu_grpo_probe-1.0.dist-info/RECORD": record}.items():
            wheel.writestr(name, text)


def probe_repository(tmp_path):
    """A directory with setup.sh and a requirements file of the probe wheel alone: an install of seconds."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy2(ROOT / "setup.sh", repo / "setup.sh")
    (repo / "requirements-cpu.txt").write_text("mu-grpo-probe==1.0\n")
    return repo


@pytest.mark.slow
def test_two_installers_at_once_into_one_empty_venv_make_one_working_environment(tmp_path):
    # several nodes start run_stages.sh, and so setup.sh, into one .venv on a shared filesystem at once: one installs,
    # the other waits for its stamp (before: both ran `python -m venv` and pip into the same site-packages)
    repo = probe_repository(tmp_path)
    probe_wheel(tmp_path / "wheels")
    env = {**without_test_venv(), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "wheels"),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    installers = [subprocess.Popen(["bash", "setup.sh", "cpu"], cwd=repo, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in installers]
    assert [p.returncode for p in installers] == [0, 0], outs
    said = "".join(out + err for out, err in outs)
    assert said.count("setup.sh: installing requirements-cpu.txt into .venv") == 1, said
    assert "another setup.sh is installing into .venv" in said, said
    stamps = [p.name for p in (repo / ".venv").glob(".installed-*")]
    assert len(stamps) == 1 and stamps[0].startswith(".installed-cpu-")
    python = repo / ".venv" / "bin" / "python"
    check = subprocess.run([python, "-c", "import mu_grpo_probe; print(mu_grpo_probe.ANSWER)"], capture_output=True,
                           text=True, env=env)
    assert check.stdout.strip() == "42", check.stderr
    assert subprocess.run([python, "-m", "pip", "check"], capture_output=True, env=env).returncode == 0


@pytest.mark.slow
def test_a_venv_without_lock_support_says_so(tmp_path):
    from test_loop import lockless_flock
    repo = probe_repository(tmp_path)
    proc = subprocess.run(["bash", "setup.sh", "cpu"], cwd=repo, capture_output=True, text=True, timeout=60,
                          env={**without_test_venv(), "PATH": lockless_flock(tmp_path)})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("setup.sh: cannot lock .venv/.setup.lock (flock: 8: No locks available)")
    assert not (repo / ".venv" / "bin").exists()
