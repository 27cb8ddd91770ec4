"""losses.sh: the LOSS presets as optimize.py flags, with NAV's δ taken from one variable (NAV_DELTA)."""
import os
import subprocess

import pytest

from conftest import ROOT

NAV_PRESETS = ["mu-grpo", "nav-none", "nav-T", "nav-S", "nav-seq", "relaxed-low", "relaxed-high"]
NO_NAV_PRESETS = ["grpo", "dapo", "m2po", "relaxed-no-nav", "offpolicy-grpo"]


def loss_args(name, **env):
    proc = subprocess.run(["bash", "-c", f'source losses.sh && loss_args {name} && echo "$LOSS_ARGS"'], cwd=ROOT,
                          capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "NAV_DELTA"} | env)
    return proc.returncode, proc.stdout.split(), proc.stderr


@pytest.mark.parametrize("name", NAV_PRESETS)
def test_every_nav_preset_takes_its_delta_from_NAV_DELTA(name):
    assert "--nav_delta=1e-4" in loss_args(name)[1]                   # the paper's default
    code, flags, _ = loss_args(name, NAV_DELTA="0.1")
    assert code == 0 and "--nav_delta=0.1" in flags and not any(f == "--nav_delta=1e-4" for f in flags)


@pytest.mark.parametrize("name", NO_NAV_PRESETS)
def test_presets_without_nav_ignore_NAV_DELTA(name):
    assert "--nav_delta=none" in loss_args(name, NAV_DELTA="0.1")[1]


def test_a_bad_NAV_DELTA_or_preset_is_refused_naming_what_is_allowed():
    code, _, err = loss_args("mu-grpo", NAV_DELTA="1e-4x")
    assert code == 2 and "NAV_DELTA must be a positive number, got '1e-4x'" in err
    code, _, err = loss_args("nav-X")
    assert code == 2 and "LOSS must be one of mu-grpo grpo" in err


def test_the_one_sided_presets_are_mu_grpo_with_one_side_of_grpos_clip_back():
    mu_grpo = loss_args("mu-grpo")[1]
    assert loss_args("relaxed-low")[1] == [f.replace("--clip_high=5", "--clip_high=1.2") for f in mu_grpo]
    assert loss_args("relaxed-high")[1] == [f.replace("--clip_low=0", "--clip_low=0.8") for f in mu_grpo]
