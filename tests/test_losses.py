"""losses.sh: the LOSS presets as what each changes in optimize.py's loss block (μ-GRPO's values: their home), with
NAV's δ from one variable (NAV_DELTA), its list of the presets with NAV (NAV_PRESETS) and the flags it gives read back
by optimize.py's own parser."""
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
def test_every_nav_preset_takes_its_delta_from_NAV_DELTA_and_else_optimize_pys(name):
    assert not any(f.startswith("--nav_delta") for f in loss_args(name)[1])     # empty: optimize.py's nav_delta
    code, flags, _ = loss_args(name, NAV_DELTA="0.1")
    assert code == 0 and flags.count("--nav_delta=0.1") == 1


def test_losses_sh_names_the_presets_with_nav():
    proc = subprocess.run(["bash", "-c", 'source losses.sh && echo "$NAV_PRESETS"'], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    assert sorted(proc.stdout.split()) == sorted(NAV_PRESETS)


@pytest.mark.parametrize("name", NO_NAV_PRESETS)
def test_presets_without_nav_ignore_NAV_DELTA(name):
    assert "--nav_delta=none" in loss_args(name, NAV_DELTA="0.1")[1]


def test_a_bad_NAV_DELTA_or_preset_is_refused_naming_what_is_allowed():
    code, _, err = loss_args("mu-grpo", NAV_DELTA="1e-4x")
    assert code == 2 and "NAV_DELTA must be a positive number, got '1e-4x'" in err
    code, _, err = loss_args("nav-X")
    assert code == 2 and "LOSS must be one of mu-grpo grpo" in err


def test_mu_grpo_is_optimize_pys_block_and_the_one_sided_presets_put_one_side_of_grpos_clip_back():
    assert loss_args("mu-grpo")[1] == []                 # clip [0, 5], NAV δ 1e-4 scope H: optimize.py's defaults
    assert loss_args("relaxed-low")[1] == ["--clip_high=1.2"]
    assert loss_args("relaxed-high")[1] == ["--clip_low=0.8"]
    assert loss_args("grpo")[1] == ["--clip_low=0.8", "--clip_high=1.2", "--nav_delta=none"]