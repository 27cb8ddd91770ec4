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
