"""Several nodes (mu_grpo/nodes.py): the store the nodes meet in, the checks before any compute, the watch that stops every
node when one is gone; the trainer's per-rank log-prob parts; the engines' environment. The whole loop on two
localhost "nodes" is in test_loop.py (beside the one-node run it must equal)."""
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

from conftest import ROOT

from mu_grpo import engine  # noqa: E402
from mu_grpo import nodes  # noqa: E402
from mu_grpo import rollouts  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_share_gather_and_meet_at_a_barrier():
    where = f"127.0.0.1:{free_port()}"
    node0 = nodes.Nodes(2, 0, where, timeout_s=20, serve=True)
    seen = {}

    def node1():
        other = nodes.Nodes(2, 1, where, timeout_s=20)
        seen["share"] = other.share("mu", "its own value, ignored")
        seen["gather"] = other.gather("hosts", "b")
        other.barrier("end")
        seen["after"] = True
    thread = threading.Thread(target=node1)
    thread.start()
    assert node0.share("mu", 64) == "64"
    assert node0.gather("hosts", "a") == ["a", "b"]
    node0.barrier("end")
    thread.join(20)
    assert seen == {"share": "64", "gather": ["a", "b"], "after": True}


def test_a_node_without_node_0_says_where_it_looked():
    where = f"127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit, match=f"node 1: no node 0 answered at {where} within 1 s"):
        nodes.Nodes(2, 1, where, timeout_s=1)


def test_one_node_answers_every_question_itself(tmp_path):
    # generate.py and evaluate.py ask the same questions on one node as on several; on one, each answer is the value
    # given (run_stages.sh's share() echoes it), as text, as the store gives it back
    one = nodes.from_args({"nnodes": 1, "node_rank": 0, "store": ""})
    assert isinstance(one, nodes.OneNode) and (one.n, one.rank) == (1, 0)
    assert one.share("generate_0/complete", True) == "True" and one.share("mu", 64) == "64"
    assert one.share("generate_0/complete", False) == "False"
    assert one.gather("hosts", "a") == ["a"]
    assert one.barrier("generate_0/written") is None
    # the engines' parts meet in a directory of this node's own, not at the path several nodes would share
    with one.meeting_dir(tmp_path / "shared", "eval_0") as where:
        assert where.is_dir() and not (tmp_path / "shared").exists()
        (where / "part_0.json").write_text("[]")
    assert not where.exists()


def test_a_store_of_one_node_gives_the_answers_one_node_gives(tmp_path):
    store = nodes.Nodes(1, 0, f"127.0.0.1:{free_port()}", timeout_s=20, serve=True)
    answers = [(node.n, node.rank, node.share("complete", True), node.share("mu", 64), node.gather("hosts", "a"),
                node.barrier("end")) for node in (store, nodes.OneNode())]
    assert answers[0] == answers[1] == (1, 0, "True", "64", ["a"], None)
    # several nodes' meeting directory: node 0 clears a killed attempt's parts before any node writes, and removes it
    shared = tmp_path / ".nodes" / "eval_stage_0"
    shared.mkdir(parents=True)
    (shared / "part_1.json").write_text("[]")
    with store.meeting_dir(shared, "eval_0") as where:
        assert where == shared and list(where.iterdir()) == []
        (where / "part_0.json").write_text("[]")
    assert not shared.exists()


def join(rank, where, run_dir, model, settings):
    return subprocess.Popen([sys.executable, "-m", "mu_grpo.nodes", "--command=join", "--nnodes=2", f"--node_rank={rank}",
                             f"--store={where}", "--join_timeout_s=60", f"--run_dir={run_dir}",
                             f"--model={model}", f"--data={model / 'train.jsonl'}", f"--settings={settings}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def make_model(path, weights):
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"hidden_size": 8}')
    (path / "model.safetensors").write_bytes(weights)
    (path / "train.jsonl").write_text('{"problem": "1 + 1", "answer": "2"}\n')
    return path


@pytest.mark.slow     # mu_grpo/nodes.py's own processes (each imports torch for its store)
def test_join_accepts_nodes_that_agree_and_refuses_one_line_per_difference(tmp_path):
    where = f"127.0.0.1:{free_port()}"
    store = nodes.Nodes(2, 0, where, timeout_s=60, serve=True)     # node 0's watch process serves it in a run
    run, model = tmp_path / "run", make_model(tmp_path / "model", b"\x01" * 100)
    settings = "LOSS=mu-grpo\nUPDATES_PER_STAGE=64\n"
    procs = [join(r, where, run, model, settings) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "2 nodes joined" in outs[0][0] and "the run directory shared" in outs[0][0]
    del store

    # node 1: another run directory (one node 0 does not write), other weights at the same path name, other settings
    where = f"127.0.0.1:{free_port()}"
    store = nodes.Nodes(2, 0, where, timeout_s=60, serve=True)
    other_model = make_model(tmp_path / "elsewhere" / "model", b"\x02" * 100)
    procs = [join(0, where, run, model, settings),
             join(1, where, tmp_path / "unseen", other_model, settings.replace("UPDATES_PER_STAGE=64", "UPDATES_PER_STAGE=32"))]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [1, 1], outs[1][1][-3000:]
    for _, err in outs:                      # every node says every node's failures, one line each
        lines = [line for line in err.splitlines() if line.startswith("refused before any compute")]
        assert len(lines) == 3, err
        assert all(line.startswith("refused before any compute: node 1 ") for line in lines)
        assert f"the run directory {tmp_path / 'unseen'} is not the one node 0 writes to" in err
        assert f"MODEL {other_model} differs from node 0's" in err
        assert "settings differ from node 0's: UPDATES_PER_STAGE ('32' here, '64' on node 0)" in err
    assert not (tmp_path / "unseen" / ".nodes").exists()
    del store


def test_the_fingerprint_is_the_bytes_not_the_path(tmp_path):
    a, b = make_model(tmp_path / "a", b"\x01" * 10), make_model(tmp_path / "b", b"\x01" * 10)
    assert nodes.fingerprint(a) == nodes.fingerprint(b) != nodes.fingerprint(a / "config.json")
    (b / "model.safetensors").write_bytes(b"\x01" * 9 + b"\x02")
    assert nodes.fingerprint(a) != nodes.fingerprint(b)
    assert nodes.fingerprint(tmp_path / "none") == "missing"


def fake_run(rank, where, tail, dead_after_s=2, errors=""):
    """A stand-in for run_stages.sh on one node: its watch process beside a shell that does `tail`."""
    watch = (f"{sys.executable} -m mu_grpo.nodes --command=watch --nnodes=2 --node_rank={rank} --store={where} "
             f"--dead_after_s={dead_after_s} --join_timeout_s=60 --pid=$$ --errors={errors}")
    return subprocess.Popen(["bash", "-c", f"{watch} & w=$!; {tail}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_until_both_beat(where, timeout=120):
    """Until both nodes' watches beat in node 0's store (python and torch imported, connected: seconds, more under
    load), read by a client of the store's own."""
    from torch.distributed import TCPStore
    host, port = where.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            store = TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=5))
            break
        except Exception:
            assert time.monotonic() < deadline, "node 0's store never came up"
            time.sleep(0.2)
    while not (store.add("beat/0", 0) > 0 and store.add("beat/1", 0) > 0):    # node 0 reads beat/1 by adding 0
        assert time.monotonic() < deadline, "the watches never both beat"
        time.sleep(0.1)


@pytest.mark.slow     # mu_grpo/nodes.py's own processes (each imports torch for its store)
def test_nodes_that_end_well_leave_together():
    where = f"127.0.0.1:{free_port()}"
    runs = [fake_run(r, where, "sleep 4; kill -USR1 $w; wait $w") for r in (0, 1)]
    outs = [p.communicate(timeout=60) for p in runs]
    assert [p.returncode for p in runs] == [0, 0], outs


@pytest.mark.slow     # mu_grpo/nodes.py's own processes (each imports torch for its store)
@pytest.mark.parametrize("how,reason", [("killed", "node 1 stopped answering"),
                                        ("failed", "node 1 failed: its run_stages.sh ended with an error")])
def test_a_node_that_is_gone_stops_the_other_within_seconds(how, reason, tmp_path):
    where, fail = f"127.0.0.1:{free_port()}", tmp_path / "fail"
    node0 = fake_run(0, where, "sleep 600 & wait")       # a phase that would wait for node 1 for ever
    node1 = fake_run(1, where, "sleep 600" if how == "killed" else
                     f'while [ ! -e "{fail}" ]; do sleep 0.1; done; exit 1')
    wait_until_both_beat(where)                            # both watching (python and torch imported)
    t0 = time.monotonic()
    if how == "killed":
        os.killpg(node1.pid, signal.SIGKILL)              # the node, all of it, at once
    else:
        fail.touch()                                       # its run_stages.sh ends with an error
    out, err = node0.communicate(timeout=60)
    took = time.monotonic() - t0
    node1.communicate(timeout=60)
    assert node0.returncode != 0 and reason in err, err
    assert "[node 0]" in err and "rerun run_stages.sh on every node to resume" in err
    assert took < 2 + 5 + 5       # dead_after_s, the grace before SIGKILL, a few beats (killed: no heartbeat for 2 s)


@pytest.mark.slow     # mu_grpo/nodes.py's own processes (each imports torch for its store)
def test_a_node_that_ends_before_node_0_is_up_is_reported_with_its_own_error_line(tmp_path):
    # node 1 starts first and fails at once (as run_stages.sh did on a model path node 0 had not built yet); its watch
    # is still waiting for node 0's store then. Once node 0 is up, node 1's watch tells it, with node 1's own last
    # error line, and node 0 stops (before: the watch took its parent after connecting, found it already gone, beat
    # on for ever, and node 0 waited JOIN_TIMEOUT, then blamed the user for not starting every node)
    where, errors = f"127.0.0.1:{free_port()}", tmp_path / "stderr.log"
    error = "node 1: MODEL data/toy/model is not on this node"
    node1 = fake_run(1, where, f"echo '{error}' | tee {errors} >&2; exit 1", errors=errors)
    node1.wait(timeout=60)                                    # its shell has ended; its watch waits for node 0
    node0 = fake_run(0, where, "sleep 600 & wait")
    try:
        _, err = node0.communicate(timeout=60)
    finally:
        for run in (node0, node1):
            try:
                os.killpg(run.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert node0.returncode != 0, err
    assert f"[node 0] node 1 failed: its run_stages.sh ended with an error: {error}: stopping" in err, err


@pytest.mark.slow     # mu_grpo/nodes.py's own processes (each imports torch for its store)
def test_other_nodes_wait_for_node_0_to_say_the_model_and_data_are_ready():
    where = f"127.0.0.1:{free_port()}"
    store = nodes.Nodes(2, 0, where, timeout_s=60, serve=True)     # node 0's watch process serves it in a run
    ready = lambda rank, timeout_s, value: subprocess.Popen(  # noqa: E731
        [sys.executable, "-m", "mu_grpo.nodes", "--command=ready", "--nnodes=2", f"--node_rank={rank}", f"--store={where}",
         f"--join_timeout_s={timeout_s}", f"--value={value}"], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    node1 = ready(1, 2, 0)                    # node 0 never says so: node 1 gives up after join_timeout_s, in one line
    _, err = node1.communicate(timeout=60)
    ours = [line for line in err.splitlines() if not line.startswith("[W")]    # not torch's socket warnings
    assert node1.returncode == 1 and len(ours) == 1 and ours[0].startswith(
        "node 1: node 0 did not say within 2 s that the model and data are ready"), err
    node1 = ready(1, 60, 0)                   # MODEL is no directory here (node 0 has not built it yet)
    time.sleep(2)
    assert node1.poll() is None               # waiting for node 0, however long it takes to build or fetch them
    node0 = ready(0, 60, 1)                   # node 0 has built it: MODEL is a directory, not a hub name
    outs = [p.communicate(timeout=60) for p in (node0, node1)]
    assert [node0.returncode, node1.returncode] == [0, 0], outs
    assert outs[0][0] == outs[1][0] == "1\n"
    del store


def collective(rank, port, more_env=None, timeout_s=20):
    """One trainer rank of the check run_stages.sh runs right after the join (under torchrun there), here a process
    with torchrun's variables: world 2, one rank per "node"."""
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(more_env or {})}
    return subprocess.Popen([sys.executable, "-m", "mu_grpo.nodes", "--command=collective", "--nnodes=2", f"--node_rank={rank}",
                             f"--collective_timeout_s={timeout_s}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow     # mu_grpo/nodes.py's own processes (each imports torch for its store)
def test_the_trainers_network_is_checked_in_seconds_with_one_line_naming_the_likely_cause():
    port = free_port()
    ranks = [collective(r, port) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outs
    assert "2 trainer ranks on 2 nodes reached each other over gloo" in outs[0][0]

    # a wrong interface: gloo finds no address on it, every rank says so at once
    port = free_port()
    ranks = [collective(r, port, {"GLOO_SOCKET_IFNAME": "no-such-if0"}) for r in (0, 1)]
    for rank, (out, err) in zip((0, 1), [p.communicate(timeout=120) for p in ranks]):
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"node {rank} rank {rank}: the trainers' gloo process group across 2 nodes (2 ranks) "
                              f"failed after"), err
        assert "likely the wrong interface (GLOO_SOCKET_IFNAME=no-such-if0" in err and "or a blocked port" in err

    # the other node's rank never arrives (a port blocked between the nodes): rank 0 gives up after the timeout
    rank0 = collective(0, free_port(), timeout_s=3)
    _, err = rank0.communicate(timeout=120)
    assert rank0.returncode == 1 and "node 0 rank 0: the trainers' gloo process group" in err, err


def test_the_process_group_is_bound_to_the_ranks_device(monkeypatch):
    # torch's barrier() takes the device passed to init_process_group; without one, global rank mod local GPU count
    # (torch/distributed/distributed_c10d.py barrier): cuda:2 for global rank 2 on a second node whose ranks use
    # cuda:0 and cuda:1. GPU-only in effect; here the call optimize.py makes through model.start_process_group
    import torch
    from mu_grpo import trainer_model as M
    calls = []
    monkeypatch.setattr(M.dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(M, "barrier", lambda: None)
    M.start_process_group(torch.device("cuda", 1))
    M.start_process_group(torch.device("cpu"))
    assert [(backend, kw["device_id"]) for backend, kw in calls] == [("nccl", torch.device("cuda", 1)), ("gloo", None)]


@pytest.mark.slow     # mu_grpo/nodes.py's own processes (each imports torch for its store)
def test_a_frozen_node_0_stops_the_others_though_its_connection_stays_open():
    # SIGSTOP: node 0's store neither answers nor closes its connections (a host gone off the network), so node 1's
    # store calls block; its watch's guard stops it after dead_after_s
    where = f"127.0.0.1:{free_port()}"
    node0 = fake_run(0, where, "sleep 600 & wait")
    node1 = fake_run(1, where, "sleep 600 & wait")
    wait_until_both_beat(where)
    os.killpg(node0.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        _, err = node1.communicate(timeout=60)
    finally:
        os.killpg(node0.pid, signal.SIGKILL)
        node0.communicate(timeout=60)
    assert node1.returncode != 0 and f"node 0's store at {where} has not answered for" in err, err
    assert time.monotonic() - t0 < 2 + 2 + 5 + 5      # dead_after_s, two beats, the grace, start-up slack


def test_rank_parts_merge_into_the_column_by_hand(tmp_path):
    # three responses of 2, 1 and 2 tokens; rank 0 computed responses 0 and 2, rank 1 response 1
    stage = types.SimpleNamespace(n=3, response_len=np.array([2, 1, 2]), token_offset=np.array([0, 2, 3, 5]))
    path = tmp_path / "old-x-T1.0.f32"
    column = rollouts.TokenColumn(path, 5, create=True)
    parts = [rollouts.write_column_part(path, 0, 0, [0, 2], [np.array([-1.0, -2.0]), np.array([-4.0, -5.0])]),
             rollouts.write_column_part(path, 1, 0, [1], [np.array([-3.0])])]
    assert column.missing(stage).tolist() == [True, True, True]
    assert sorted(column.parts()) == sorted(parts)
    assert column.merge_parts(stage, parts) == 3
    assert column.values.tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert not column.missing(stage).any() and column.parts() == []
    bad = rollouts.write_column_part(path, 1, 1, [1], [np.array([-3.0, -3.5])])   # 2 values for a 1-token response
    with pytest.raises(rollouts.RolloutError, match=f"{bad.name}: 2 values for responses of 1 tokens"):
        column.merge_parts(stage, [bad])


def test_engines_start_without_torchruns_variables(monkeypatch):
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
                        "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(name, value)
    env = engine.engine_environment()
    assert not set(engine.TORCHRUN_VARIABLES) & set(env)
    assert env["PATH"] == os.environ["PATH"]
    json.dumps(env)


def test_the_slurm_launcher_starts_run_stages_on_every_node_with_its_rank(tmp_path):
    # srun and scontrol stand-ins: the script's work is the environment and command each node's task gets
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\n[[ $* == 'show hostnames gpu[07-08]' ]] && printf 'gpu07\\ngpu08\\n'\n")
    (bin_dir / "srun").write_text("#!/bin/bash\necho \"srun $*\"\nfor id in 0 1; do SLURM_NODEID=$id bash -c "
                                  "'echo \"task $SLURM_NODEID: NNODES=$NNODES MASTER_ADDR=$MASTER_ADDR "
                                  "MASTER_PORT=$MASTER_PORT\"'; done\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456", "SLURM_SUBMIT_DIR": str(ROOT)}
    env.pop("MASTER_ADDR", None), env.pop("MASTER_PORT", None)
    out = subprocess.run(["bash", "slurm/run_stages.sbatch"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    # the box's GPUs per node (it asked for 8 on a 4-GPU box: Slurm refuses such a job)
    assert "\n#SBATCH --gpus-per-node=4\n" in (ROOT / "slurm" / "run_stages.sbatch").read_text()
    port = 20000 + 123456 % 12000
    assert f"node 0 at gpu07:{port}" in out.stdout
    assert "--nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c NODE_RANK=$SLURM_NODEID exec bash " \
           "run_stages.sh" in out.stdout
    for r in (0, 1):
        assert f"task {r}: NNODES=2 MASTER_ADDR=gpu07 MASTER_PORT={port}" in out.stdout
