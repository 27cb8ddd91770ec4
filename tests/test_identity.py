"""optimize.py against the commit before its policy code moved to model.py (9e5ff72): the same rollouts must
give bit-identical weights (torch.equal) and identical metrics rows, timing and memory measurements aside,
one process over two stages (the second continuing the first's train state) and under torchrun (2 gloo
ranks) with NAV, M2PO, TIS and KL all on. The reference code is taken from git (`git archive`); without the
repository's history the test is skipped."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, read_lines
from test_optimize import PROBLEMS, _weights, write_stage

REFERENCE = "9e5ff7204f41c4b356ade38ef457b442203e54f6"   # the last commit with the policy code in optimize.py
MEASURED = ("time", "seconds", "tokens_per_s")           # wall-clock; memory/* are allocator measurements

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def reference_checkout(tmp_path_factory):
    has = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{REFERENCE}^{{commit}}"], capture_output=True)
    if has.returncode != 0:
        pytest.skip(f"commit {REFERENCE[:7]} is not in this clone (shallow?): nothing to compare with")
    out = tmp_path_factory.mktemp("reference")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", REFERENCE], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


def run(checkout, *args, ranks=1):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] \
        if ranks > 1 else [sys.executable]
    proc = subprocess.run([*launcher, "optimize.py", *map(str, args)], cwd=checkout, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def assert_identical(ours, theirs):
    w1, w2 = _weights(ours / "policy"), _weights(theirs / "policy")
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    m1, m2 = read_lines(ours / "metrics.jsonl"), read_lines(theirs / "metrics.jsonl")
    assert len(m1) == len(m2)
    for a, b in zip(m1, m2):          # every field the reference wrote, equal (new fields may be added)
        assert {k: a.get(k) for k in b if k not in MEASURED and not k.startswith("memory/")} == \
               {k: v for k, v in b.items() if k not in MEASURED and not k.startswith("memory/")}


def test_same_weights_and_metrics_as_before_the_move(toy, reference_checkout, tmp_path):
    write_stage(tmp_path / "rollouts_0", toy / "model", PROBLEMS)
    write_stage(tmp_path / "rollouts_1", toy / "model", PROBLEMS[::-1])
    for name, checkout in (("ours", ROOT), ("theirs", reference_checkout)):
        d = tmp_path / name
        for s in (0, 1):
            shutil.copytree(tmp_path / f"rollouts_{s}", d / f"stage_{s}")
        shutil.copytree(tmp_path / "rollouts_0", d / "replay_stage")
        common = ["--prompts_per_update=2", "--lr=1e-3", "--micro_batch_tokens=40"]
        run(checkout, f"--stage_dir={d / 'stage_0'}", "--updates_per_stage=2", *common, "--nav_delta=0.5",
            "--checkpoint_every=1", f"--ref_policy={toy / 'model'}")        # KL logged (β = 0)
        run(checkout, f"--stage_dir={d / 'stage_1'}", "--updates_per_stage=2", *common, "--nav_delta=0.5",
            f"--init_state={d / 'stage_0' / 'train_state'}", "--warmup_updates=3")
        run(checkout, f"--stage_dir={d / 'replay_stage'}", f"--out={d / 'replay' / 'policy'}", "--updates_per_stage=2",
            *common, "--nav_delta=0.9", "--nav_scope=S", "--m2po_tau=0.01", "--tis_cap=2", "--kl_coef=0.1",
            f"--ref_policy={toy / 'model'}", ranks=2)
    for part in ("stage_0", "stage_1", "replay"):
        assert_identical(tmp_path / "ours" / part, tmp_path / "theirs" / part)
    metrics = read_lines(tmp_path / "ours" / "replay" / "metrics.jsonl")   # the options were in force
    assert max(m["m2po/masked_frac"] for m in metrics) > 0 and metrics[0]["kl/in_loss"] == 1
    assert json.loads((tmp_path / "ours" / "stage_1" / "train_state" / "progress.json").read_text())["global_update"] == 4
