"""Several nodes, one run (run_stages.sh with NNODES > 1): the same script on every node, node 0 owning the
run-level state, the others following it. The nodes meet in a key-value store (torch's TCPStore: no process group,
since vLLM reuses an initialised default group, vllm/distributed/parallel_state.py init_distributed_environment)
that node 0's `watch` process serves at --store (MASTER_ADDR:MASTER_PORT) for as long as its run_stages.sh
runs:

    python -m mu_grpo.nodes --command=watch ...   every node, beside its run_stages.sh: a heartbeat every second; a node that fails or
                                 stops answering for dead_after_s stops every other node's run within seconds, with a
                                 line naming it (no hang in a collective until a timeout of hours)
    python -m mu_grpo.nodes --command=join  ...   every node, before any compute, one line per failed check: every node joined within
                                 join_timeout_s; they agree on the settings; the run directory is one every node sees
                                 (a file node 0 writes, read by all); the model and data are the same bytes everywhere
    python -m mu_grpo.nodes --command=share --key=K --value=V   prints node 0's V on every node: a decision node 0 takes from the
                                 filesystem (a phase done, the next stage's μ), which another node's NFS cache may
                                 not show yet
    python -m mu_grpo.nodes --command=ready ...   every node, before the join: node 0 says it has built or fetched the model and
                                 data; the others wait for that (started first, they would find nothing there yet)
    torchrun ... -m mu_grpo.nodes --command=collective   every trainer rank of every node, right after the join: one all-reduce
                                 over the trainer's backend and devices within collective_timeout_s (a blocked port or a
                                 wrong interface fails then, in one line)

generate.py and evaluate.py meet at barriers in the same store (Nodes.barrier), and ask on one node what they ask on
several: there from_args gives OneNode, which answers alone. optimize.py's ranks meet in torchrun's own rendezvous at
MASTER_PORT + 1. Keys live as long as node 0's watch process: one run_stages.sh invocation.
"""
import contextlib
import datetime
import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from mu_grpo import common, processes

# ----------------------------------------------------------------------------- hyperparameters
command = ""                    # watch | join | share | ready | collective (see above)

# the nodes and where they meet
nnodes = 1                      # nodes in the run (run_stages.sh NNODES)
node_rank = 0                   # this node's rank, 0..nnodes-1 (NODE_RANK); node 0 serves the store
store = "127.0.0.1:29500"  # node 0's address as every node reaches it, and the store's port there
                                # (run_stages.sh MASTER_ADDR:MASTER_PORT; torchrun's rendezvous uses the next port)

# how long they wait for each other
join_timeout_s = 600.0          # how long the nodes wait for each other at the start (a slower node's set-up)
dead_after_s = 10.0             # seconds without a node's heartbeat before it counts as gone
beat_s = 1.0                    # heartbeat period

# watch
pid = 0                         # watch: the run_stages.sh process to stop (with its children) when a node is gone
errors = ""                     # watch: the file run_stages.sh's stderr is copied to; its last line is what the other
                                # nodes are told when run_stages.sh ends with an error

# join
run_dir = ""                    # join: the run directory, model and data that must be shared
model = ""
data = ""                       # comma list of files or directories
settings = ""                   # join: the run's settings, "KEY=value" lines; every node's must be node 0's

# collective
collective_timeout_s = 60.0     # collective: how long the ranks of every node have to reach each other (torchrun's
                                # rendezvous, then the process group and one all-reduce); a blocked port or a wrong
                                # interface fails here, right after the join, not hours later in the first update

# share, ready
key = ""                        # share: the decision's name (unique within the run_stages.sh invocation)
value = ""                      # share, ready: node 0's value (ignored on the others)
# -----------------------------------------------------------------------------
BARRIER_TIMEOUT_S = 7 * 24 * 3600   # barriers wait for slow phases; a dead node is the watch process's to detect


class Nodes:
    """This node's connection to the run's store (node 0's watch process serves it)."""

    def __init__(self, nnodes, node_rank, store, timeout_s=600.0, serve=False):
        from torch.distributed import TCPStore  # torch (2 s): only a node that meets others (OneNode never does)
        addr, port = store.rsplit(":", 1)
        port = int(port)
        self.n, self.rank, self.where = nnodes, node_rank, store
        try:      # a client retries until the server is up or timeout_s has passed
            self.store = TCPStore(addr, port, is_master=serve, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as e:
            raise SystemExit(f"node {node_rank}: " + (
                f"cannot serve the nodes' store on port {port} ({first_line(e)}); is MASTER_PORT free?" if serve else
                f"no node 0 answered at {self.where} within {timeout_s:.0f} s ({first_line(e)}): is node 0's "
                f"run_stages.sh started, MASTER_ADDR its address from this node, the port open?")) from None

    def gather(self, name, text, timeout_s=BARRIER_TIMEOUT_S):
        """Every node's `text` for `name`, in node order, once every node has given its own."""
        self.store.set(f"{name}/{self.rank}", text)
        keys = [f"{name}/{r}" for r in range(self.n)]
        self.store.wait(keys, datetime.timedelta(seconds=timeout_s))
        return [self.store.get(k).decode() for k in keys]

    def barrier(self, name, timeout_s=BARRIER_TIMEOUT_S):
        """Wait until every node has reached `name`."""
        self.gather(name, "1", timeout_s)

    def share(self, name, text=None, timeout_s=BARRIER_TIMEOUT_S):
        """Node 0's `text` for `name`, on every node."""
        if self.rank == 0:
            self.store.set(f"share/{name}", str(text))
        self.store.wait([f"share/{name}"], datetime.timedelta(seconds=timeout_s))
        return self.store.get(f"share/{name}").decode()

    @contextlib.contextmanager
    def meeting_dir(self, path, name):
        """`path`, a directory every node sees, where every node's engines leave their parts: node 0 clears a
        killed attempt's first (the nodes meet at `name`/cleared before any writes) and removes it at the end."""
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        self.barrier(f"{name}/cleared")
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        if self.rank == 0:
            shutil.rmtree(path)


class OneNode:
    """A run on one node, with Nodes' methods: every answer is this node's own (run_stages.sh's share() on one node
    echoes its value), so that a phase script says what several nodes do without asking how many there are."""
    n, rank, where = 1, 0, None

    def gather(self, name, text, timeout_s=BARRIER_TIMEOUT_S):
        return [text]

    def barrier(self, name, timeout_s=BARRIER_TIMEOUT_S):
        pass

    def share(self, name, text=None, timeout_s=BARRIER_TIMEOUT_S):
        return str(text)      # as Nodes' store gives it back: text

    @contextlib.contextmanager
    def meeting_dir(self, path, name):
        """A temporary directory of this node's own, removed at the end (`path`, `name`: unused)."""
        with tempfile.TemporaryDirectory() as tmp:
            yield Path(tmp)


def first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def from_args(args, timeout_s=600.0):
    """The Nodes of a phase script whose flags carry nnodes, node_rank and store ("addr:port"); OneNode on
    one node."""
    if args.get("nnodes", 1) <= 1:
        return OneNode()
    return Nodes(args["nnodes"], args["node_rank"], args["store"], timeout_s=timeout_s)


# ----------------------------------------------------------------------------- watch


def last_error_line():
    """The last line run_stages.sh wrote to its stderr (--errors, copied there by tee), or where to look."""
    if not errors:
        return "(see that node's output)"
    time.sleep(0.5)           # tee's copy of the last line may trail run_stages.sh's exit by a moment
    try:
        lines = [line.strip() for line in Path(errors).read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    return lines[-1][:300] if lines else "(see that node's output)"


def watch():
    """Serve (node 0) or join the store, then beat every beat_s until run_stages.sh says it is done (SIGUSR1) or
    dies. Stops the run when another node fails or stops answering."""
    # run_stages.sh, taken before the store is reached: a node started before node 0 may end (a missing model, a bad
    # setting) while this process waits to connect, and must still tell node 0 once it is up
    parent = pid or os.getppid()
    # the signals first, before the store (torch's import takes seconds): run_stages.sh may end, well, meanwhile
    finishing = []
    signal.signal(signal.SIGUSR1, lambda *_: finishing.append(True))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))      # run_stages.sh's own exit path
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # a Ctrl-C stops run_stages.sh; this process then says so
    nodes = Nodes(nnodes, node_rank, store, join_timeout_s, serve=node_rank == 0)
    kv = nodes.store
    seen = {r: (-1, time.monotonic()) for r in range(nnodes) if r != node_rank}
    left = set()

    def stop(why, tell=True):
        print(f"[node {node_rank}] {why}: stopping this node's run (rerun run_stages.sh on every node to resume)",
              file=sys.stderr, flush=True)
        try:
            if tell:
                kv.set(f"failed/{node_rank}", f"stopped because {why}")
        except Exception:     # the store is what failed: the others learn it from the missing heartbeat
            pass
        processes.stop_tree(pid or parent)
        os._exit(1)

    # a store call to a host that vanished without closing the connection blocks until the kernel gives up (about
    # 15 minutes: the client sets no keepalive, torch's TCPStore.cpp); this thread stops the run if the loop below
    # has not gone round for dead_after_s
    went_round, ended = [time.monotonic()], threading.Event()

    def guard():
        while not ended.wait(beat_s):
            if (stuck := time.monotonic() - went_round[0]) > dead_after_s + 2 * beat_s:
                stop(f"node 0's store at {nodes.where} has not answered for {stuck:.0f} s: node 0 or the network "
                     f"is gone", tell=False)
    threading.Thread(target=guard, daemon=True).start()

    while True:
        try:
            kv.add(f"beat/{node_rank}", 1)
            if not processes.alive(parent):     # run_stages.sh died without saying it was done
                kv.set(f"failed/{node_rank}", f"its run_stages.sh ended with an error: {last_error_line()}")
                if node_rank == 0:          # the others read why before the store goes
                    time.sleep(3 * beat_s)
                ended.set()
                return 1
            if finishing and node_rank != 0:
                kv.set(f"left/{node_rank}", "1")    # the last call to the store: node 0 may close it as soon as
                ended.set()                            # it reads this, and a call after it would find the store gone
                return 0                               # and stop this node's run, which has ended well
            now = time.monotonic()
            for r in seen:
                if r in left:
                    continue
                if kv.check([f"left/{r}"]):
                    left.add(r)
                    continue
                if kv.check([f"failed/{r}"]):
                    stop(f"node {r} failed: {kv.get(f'failed/{r}').decode()}")
                beats = kv.add(f"beat/{r}", 0)
                if beats != seen[r][0]:
                    seen[r] = (beats, now)
                elif now - seen[r][1] > (dead_after_s if beats > 0 else join_timeout_s):
                    stop(f"node {r} stopped answering ({now - seen[r][1]:.0f} s without a heartbeat)" if beats > 0
                         else f"node {r} did not join within {join_timeout_s:.0f} s")
        except SystemExit:
            raise
        except Exception as e:
            stop(f"node 0's store at {nodes.where} is gone ({first_line(e)}): node 0 failed or stopped answering")
        if finishing and len(left) == nnodes - 1:
            ended.set()
            return 0              # node 0 serves the store until every node has left
        went_round[0] = time.monotonic()
        time.sleep(beat_s)


# ----------------------------------------------------------------------------- join


def fingerprint(path):
    """What must be equal on every node: a file's or directory's bytes, or "missing". sha256 over the files' names
    and sizes and their contents (a file over 64 MiB: its first and last 16 MiB, so that a 15 GB checkpoint is not
    read whole at every start)."""
    p = Path(path)
    if not p.exists():
        return "missing"
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.relative_to(p) if p.is_dir() else f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if size <= 64 << 20:
                h.update(fh.read())
            else:
                h.update(fh.read(16 << 20))
                fh.seek(size - (16 << 20))
                h.update(fh.read())
    return h.hexdigest()[:16]


def differing(mine, theirs):
    """The settings ("KEY=value" lines) that differ, as "KEY (a vs b)"."""
    a, b = (dict(line.split("=", 1) for line in s.splitlines() if "=" in line) for s in (mine, theirs))
    return [f"{k} ({a.get(k, 'unset')!r} here, {b.get(k, 'unset')!r} on node 0)" for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k)]


def read_token(path):
    try:
        os.listdir(path.parent)               # a fresh listing of the directory
        return json.loads(path.read_text()).get("token")
    except (OSError, ValueError):
        return None


def checks(nodes, shared, mine, node0):
    """This node's failed checks, one line each: the run directory (a file node 0 writes, read here), the model's and
    data's bytes and the settings against node 0's."""
    problems = []
    if node_rank == 0:   # the run directory: a file this node writes, every other node must read
        token = uuid.uuid4().hex
        (Path(run_dir) / ".nodes").mkdir(parents=True, exist_ok=True)
        common.atomic_write_json(Path(run_dir) / ".nodes" / "token.json", {"token": token})
    token = nodes.share("join/token", token if node_rank == 0 else None, join_timeout_s)
    path, deadline = Path(run_dir) / ".nodes" / "token.json", time.monotonic() + 10
    while (seen := read_token(path)) != token and time.monotonic() < deadline:   # an NFS cache's seconds of lag
        time.sleep(0.5)
    if seen != token:
        problems.append(f"the run directory {run_dir} is not the one node 0 writes to (its file {path} is "
                        f"{'missing' if seen is None else 'another run'} here): RUN must be on a filesystem every node "
                        f"sees, at the same path")
    for (name, _), here, there in zip(shared, mine["bytes"], node0["bytes"]):
        if here == "missing":
            problems.append(f"{name} does not exist here (model and data must be on a filesystem every node sees)")
        elif here != there:
            problems.append(f"{name} differs from node 0's (other bytes at the same path)")
    if diff := differing(settings, node0["settings"]):
        problems.append(f"settings differ from node 0's: {', '.join(diff)}")
    return problems


def join():
    """The checks before any compute, one line each; exits 1 on any failure (on every node)."""
    t0 = time.monotonic()
    nodes = Nodes(nnodes, node_rank, store, join_timeout_s)
    shared = [(f"MODEL {model}", model)] + [(f"data {d}", d) for d in data.split(",") if d]    # compared in this order
    mine = {"host": socket.gethostname(), "settings": settings, "bytes": [fingerprint(p) for _, p in shared]}
    try:
        everyone = [json.loads(t) for t in nodes.gather("join/who", json.dumps(mine), join_timeout_s)]
    except Exception as e:
        try:
            missing = "node(s) " + ", ".join(str(r) for r in range(nnodes) if not nodes.store.check([f"join/who/{r}"]))
        except Exception:             # the store itself is gone: the error above says so
            missing = "some nodes"
        raise SystemExit(f"node {node_rank}: {missing} did not join within {join_timeout_s:.0f} s ({first_line(e)}): "
                         f"start run_stages.sh on all {nnodes} nodes with NNODES={nnodes} and NODE_RANK "
                         f"0..{nnodes - 1}, or see a node's output for the error that ended it before the "
                         f"join") from None
    try:
        problems = checks(nodes, shared, mine, everyone[0])
    except Exception as e:           # said like any failed check, so that no node waits for this one's verdict
        problems = [f"the checks failed: {type(e).__name__}: {first_line(e)}"]
    verdicts = [json.loads(t) for t in nodes.gather("join/verdict", json.dumps(problems), join_timeout_s)]
    if any(verdicts):
        for r, v in enumerate(verdicts):
            for line in v:
                print(f"refused before any compute: node {r} ({everyone[r]['host']}): {line}", file=sys.stderr)
        raise SystemExit(1)
    if node_rank == 0:
        print(f"{nnodes} nodes joined in {time.monotonic() - t0:.1f} s ({', '.join(e['host'] for e in everyone)}): "
              f"the same settings, model and data; the run directory shared", flush=True)


def ready():
    """Node 0, once it has built or fetched the model and data: says so, with --value (whether MODEL is a directory
    there), printed on every node. Every other node waits for that (up to join_timeout_s) before it resolves or hashes
    them: started first, it would find nothing at their paths, and take a directory not built yet for a hub name."""
    deadline = time.monotonic() + join_timeout_s
    nodes = Nodes(nnodes, node_rank, store, join_timeout_s)
    try:
        print(nodes.share("data/ready", value, max(deadline - time.monotonic(), 1.0)))
    except Exception as e:
        raise SystemExit(f"node {node_rank}: node 0 did not say within {join_timeout_s:.0f} s that the model and data "
                         f"are ready ({first_line(e)}); node 0 builds or fetches them before the nodes join: see its "
                         f"output") from None


# ----------------------------------------------------------------------------- collective


def collective():
    """One torchrun rank, right after the join: every rank of every node meets the others in the process group the
    trainer will use (optimize.py's backend and device: NCCL on cuda:LOCAL_RANK, gloo on the CPU) and all-reduces
    one number, within collective_timeout_s. A blocked port or a wrong interface then fails in seconds with one line,
    not hours later in the first update, with every node alive and waiting."""
    import torch  # torch: only the collective check's ranks
    import torch.distributed as dist
    rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")    # as optimize.py
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    t0 = time.monotonic()
    try:     # as model.start_process_group: with the rank's device NCCL forms its communicator in this call
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=collective_timeout_s),
                                device_id=device if device.type == "cuda" else None)
        total = torch.ones(1, device=device)
        dist.all_reduce(total)
    except Exception as e:
        interface = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
        ports = "NCCL's own ports between the nodes" if backend == "nccl" else "the ports gloo opens between the nodes"
        raise SystemExit(
            f"node {node_rank} rank {rank}: the trainers' {backend} process group across {nnodes} nodes "
            f"({world} ranks) failed after {time.monotonic() - t0:.0f} s ({type(e).__name__}: {first_line(e)}): "
            f"likely the wrong interface ({interface}={os.environ.get(interface, 'unset')}: the network the nodes "
            f"reach each other on) or a blocked port ({ports}; README, Several nodes)") from None
    if total.item() != world:
        raise SystemExit(f"node {node_rank} rank {rank}: the {backend} all-reduce of one per rank gave "
                         f"{total.item():g}, not {world}")
    dist.destroy_process_group()
    if rank == 0:
        print(f"{world} trainer ranks on {nnodes} nodes reached each other over {backend} in "
              f"{time.monotonic() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    common.apply_overrides(globals(), sys.argv[1:])
    common.check_choice("command", command, ("watch", "join", "share", "ready", "collective"))
    if not 0 <= node_rank < nnodes:
        sys.exit(f"--node_rank must be in 0..{nnodes - 1} (--nnodes={nnodes}), got {node_rank}")
    if command == "watch":
        code = watch()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)    # not through the interpreter's teardown, where the store's server may wait on its clients
    elif command == "join":
        join()
    elif command == "ready":
        ready()
    elif command == "collective":
        collective()
    else:
        print(Nodes(nnodes, node_rank, store, join_timeout_s).share(key, value))
