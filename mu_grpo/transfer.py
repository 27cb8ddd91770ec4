"""Resident mode's policy hand-off through vLLM's weight-transfer API (HANDOFF=transfer, the default; docs/resident.md).

vLLM 0.32's protocol (vllm/distributed/weight_transfer/base.py, vllm/entrypoints/rl/offline.py), as it runs here:

    every trainer rank (optimize.py --resident)              each engine process (generate.py --resident)
    trainer_init(init_info, client=, source=)                LLM(weight_transfer_config={"backend": ...})
      rank 0: client.init_weight_transfer_engine   ──→      llm.init_weight_transfer_engine    (once per run)
    send_weights(), after every stage:
      rank 0: client.start_weight_update           ──→      wake the weights (GPU), llm.start_weight_update
      every rank: gather each parameter (FSDP's full_tensor, a collective), cast it to the policy's dtype, copy it
      into this rank's bounded buffer; once full:
      rank 0: client.update_weights(chunk)         ──→      llm.update_weights: read the buffer of the rank beside
                                                            it, load the tensors (vLLM's layerwise reload)
      rank 0: client.finish_weight_update          ──→      llm.finish_weight_update (process_weights_after_loading)
    then rank 0 writes the hand-off flag (mu_grpo/handoff.py) with the weights' hashes; the engine wakes its KV cache,
    checks that it holds exactly those weights (engine.verify_weights) and generates.

The transport (the "backend") is the only part that differs by machine:
- GPU: vLLM's own `ipc` (vllm/distributed/weight_transfer/ipc_engine.py), packed: each rank's GPU holds one
  bounded buffer (max(1 GiB, the largest tensor); vLLM's default 1 GiB is less than Qwen2.5-7B's 1.09 GB bf16
  embedding, which packed_tensor.py `packed_ipc_producer` refuses), shared with the engine on the same GPU through a
  CUDA IPC handle keyed by the GPU's UUID; no second full copy of the policy exists on any GPU.
- CPU: ours, `mu-grpo-shm` (below), registered through vLLM's two factories (factory.py `register_engine`): the
  same packing into one bounded buffer per rank, a file in /dev/shm that the engines map.
The control plane between rank 0 and the engine processes (vLLM ships clients for Ray actors and HTTP servers, not
for an LLM in another local process) is EngineClient ↔ EngineServer: the four calls over a Unix socket per engine
(in a 0700 directory of this user's), each answered once the engine has run it; an engine whose call failed is
named and the run stops (a failed update leaves the engine's weights partly written: it is not used again).
"""
import dataclasses
import os
import select
import socket
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine,
                                                   WeightSource, WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from mu_grpo import checkpoint, common, handoff
from mu_grpo import trainer_model as M

CPU_BACKEND = "mu-grpo-shm"
MIN_BUFFER_BYTES = 1 << 30      # the ranks' buffer: this or the largest tensor, whichever is larger
ENGINE_INDEX = "MU_GRPO_ENGINE_INDEX"   # the engine process's index among the run's engines (generate.py sets it)


def backend(device_type):
    """The weight-transfer backend of a machine: vLLM's CUDA IPC on GPUs, our shared-memory files on CPUs."""
    return "ipc" if device_type == "cuda" else CPU_BACKEND


# ----------------------------------------------------------------------------- the trainer's weights


class PolicySource(WeightSource):
    """The policy as the engines load it, one tensor at a time (checkpoint.policy_tensors: checkpoint names, its
    dtype, LoRA merged, a tied output head left out), on every rank (a sharded parameter's gather is a collective, so
    every rank iterates in the same order). Rank 0 also records what the engines must then hold: common.tensor_hash
    of each tensor in the engines' dtype (exactly what checkpoint.save_policy records), hashed on its device as it
    passes, and the non-finite tensors, refused once the pass is over."""

    def __init__(self, model, dtype, record):
        self.model, self.dtype, self.record = model, dtype, record
        self.hashes, self.nonfinite = {}, []

    def metadata(self):
        return [ParamMeta(name, self.dtype, shape) for name, shape in checkpoint.policy_shapes(self.model)]

    def __iter__(self):
        held = getattr(torch, common.engine_dtype())
        self.hashes, self.saved_hashes, finite = {}, {}, {}
        for name, tensor in checkpoint.policy_tensors(self.model, self.dtype):
            if self.record:
                self.saved_hashes[name], self.hashes[name] = checkpoint.hashes_of(tensor, held)
                finite[name] = torch.isfinite(tensor).all()
            yield name, tensor
        self.nonfinite = [k for k, ok in zip(finite, torch.stack(list(finite.values())).tolist()) if not ok] \
            if finite else []

    def engine_weights(self):
        """The record the engines check after the hand-off (policy_id.json's engine_weights) and the weights'
        fingerprint (checkpoint.weights_digest: what save_policy would record for them). Rank 0 only."""
        if self.nonfinite:
            raise SystemExit(f"refusing to hand over non-finite weights ({self.nonfinite[:3]}...)")
        hashes = {k: f"{v:016x}" for k, v in sorted(self.hashes.items())}
        record = {"dtype": common.engine_dtype(), "hash": common.TENSOR_HASH, "hashes": hashes}
        return record, checkpoint.weights_digest(self.saved_hashes)


# ----------------------------------------------------------------------------- our CPU transport (mu-grpo-shm)


@dataclasses.dataclass
class ShmTrainerInitInfo(TrainerInitInfo):
    """The trainer's side: where the ranks' buffers are (one file per rank) and how large each is."""
    backend: ClassVar[str] = CPU_BACKEND
    buffers: list = dataclasses.field(default_factory=list)
    buffer_bytes: int = MIN_BUFFER_BYTES


@dataclasses.dataclass
class ShmInitInfo(WeightTransferInitInfo):
    buffers: list = dataclasses.field(default_factory=list)     # rank r's buffer file
    buffer_bytes: int = 0


@dataclasses.dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    names: list
    dtype_names: list
    shapes: list
    offsets: list           # where each tensor's bytes start in the buffer
    tensor_sizes: list      # and how many there are


def _map(path, size):
    """A uint8 tensor over the file (MAP_SHARED: the trainer's writes are what the engines read)."""
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


class ShmTrainer(TrainerWeightTransferEngine[ShmTrainerInitInfo]):
    """Every rank packs the policy's tensors into its own buffer, in chunks; rank 0 ships each chunk's layout to the
    engines and returns once they have loaded it. As vLLM's packed IPC sender does (ipc_engine.py `_send_packed`), a
    barrier before the call (every rank's buffer holds the chunk) and one after it (no rank refills its buffer while
    an engine still reads it)."""
    init_info_cls = ShmTrainerInitInfo

    def __init__(self, *, client, source, is_sender, buffer, buffer_bytes):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.buffer, self.buffer_bytes = buffer, buffer_bytes

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if source is None:
            raise ValueError(f"the {CPU_BACKEND} trainer needs a WeightSource")
        path = Path(init_info.buffers[init_info.rank])
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(init_info.buffer_bytes)
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     buffer=_map(path, init_info.buffer_bytes), buffer_bytes=init_info.buffer_bytes)
        M.barrier()                      # every rank's buffer exists before an engine maps them
        if engine.is_sender:
            engine.client.init_weight_transfer_engine({"buffers": init_info.buffers,
                                                       "buffer_bytes": init_info.buffer_bytes})
        return engine

    def send_weights(self):
        if self.is_sender:
            self.client.start_weight_update()
        chunk, used = [], 0
        for name, tensor in self.source:
            flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
            if flat.numel() > self.buffer_bytes:
                raise ValueError(f"{name} has {flat.numel()} bytes, more than the hand-off buffer's {self.buffer_bytes}")
            if used + flat.numel() > self.buffer_bytes:
                self._ship(chunk)
                chunk, used = [], 0
            self.buffer[used:used + flat.numel()].copy_(flat)
            chunk.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), used, flat.numel()))
            used += flat.numel()
        if chunk:
            self._ship(chunk)
        if self.is_sender:
            self.client.finish_weight_update()
        M.barrier()

    def _ship(self, chunk):
        M.barrier()
        if self.is_sender:
            names, dtypes, shapes, offsets, sizes = (list(x) for x in zip(*chunk))
            self.client.update_weights({"names": names, "dtype_names": dtypes, "shapes": shapes, "offsets": offsets,
                                        "tensor_sizes": sizes})
        M.barrier()

    def shutdown(self):
        self.buffer = None


class ShmEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """The engine's side (in vLLM's worker, vllm/v1/worker/gpu_worker.py `init_weight_transfer_engine` and on, which
    vLLM's CPUWorker inherits): engine e reads the buffer of trainer rank e mod ranks; the tensors go through the
    same layerwise reload as vLLM's IPC engine and as reload_weights from files (model_loader/reload/inplace.py)."""
    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def init_transfer_engine(self, init_info):
        engine = int(os.environ.get(ENGINE_INDEX, "0"))
        self.buffer = _map(init_info.buffers[engine % len(init_info.buffers)], init_info.buffer_bytes)

    def start_weight_update(self):
        # vLLM's reload: in the engine's worker
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info):
        # the base class ends with torch.accelerator.synchronize() (base.py, WeightTransferEngine.update_weights),
        # which a machine without an accelerator refuses; a CPU copy is done when it returns
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info):
        # vLLM: in the engine's worker
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        # cloned: the layerwise reload keeps a layer's tensors until the layer is complete, maybe past this chunk
        # (packed_tensor.py `packed_ipc_consumer` clones for the same reason), and the trainer refills the buffer
        weights = [(name, self.buffer[a:a + n].clone().view(getattr(torch, dtype)).view(shape))
                   for name, dtype, shape, a, n in zip(update_info.names, update_info.dtype_names, update_info.shapes,
                                                       update_info.offsets, update_info.tensor_sizes)]
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)

    def finish_weight_update(self):
        # vLLM's reload: in the engine's worker
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self):
        self.buffer = None


def register():
    """Our backend in vLLM's registries (a name registered twice is an error there, so only once per process)."""
    if CPU_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(CPU_BACKEND, ShmEngine)
    if CPU_BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(CPU_BACKEND, ShmTrainer)


register()


# ----------------------------------------------------------------------------- the control plane


class EngineClient:
    """vLLM's VLLMWeightSyncClient (base.py: four methods) for engines in other local processes: each call goes to
    every engine at once and returns when all have run it. Connects on its first call (only rank 0 calls), waiting
    for the engines' sockets; while it waits on an engine, `check()` (the partner's liveness) runs every second."""

    def __init__(self, run_dir, n_engines, check=lambda: None, connect_timeout_s=600.0):
        self.run_dir, self.n_engines, self.check, self.connect_timeout_s = run_dir, n_engines, check, connect_timeout_s
        self.conns = None

    def _connect(self):
        self.conns, deadline = [], time.monotonic() + self.connect_timeout_s
        for e in range(self.n_engines):
            path = handoff.transfer_socket(self.run_dir, e)
            while True:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect(str(path))
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    sock.close()
                    if time.monotonic() > deadline:
                        raise SystemExit(f"engine {e}: its hand-off socket {path} did not open within "
                                         f"{self.connect_timeout_s:.0f} s: see its log")
                    self.check()
                    time.sleep(0.05)
            self.conns.append(Connection(sock.detach()))

    def _call(self, method, payload=None):
        if self.conns is None:
            self._connect()
        for conn in self.conns:
            conn.send((method, payload))
        for e, conn in enumerate(self.conns):
            while not conn.poll(1.0):
                self.check()
            try:
                status, said = conn.recv()
            except (EOFError, ConnectionError):
                raise SystemExit(f"engine {e}: its process ended during the weight hand-off ({method}): see its log")
            if status != "ok":
                raise SystemExit(f"engine {e}: {method} failed: {said}")

    def init_weight_transfer_engine(self, init_info):
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self):
        self._call("start_weight_update")

    def update_weights(self, update_info):
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version=None):
        self._call("finish_weight_update")

    def close(self):
        for conn in self.conns or ():
            conn.close()
        self.conns = None


class EngineServer:
    """The engine process's end: runs the trainer's calls on its LLM. `poll()` (called while the engine waits for
    the next policy) answers what has arrived; once a weight update has started it serves the update's calls until
    its finish, checking the trainer (`check`) every second. The update's seconds and bytes are kept for the
    timeline. On a GPU the weights are woken before the update starts (vllm/v1/executor/abstract.py `wake_up` with
    tags); the KV cache only once the trainer has released its hand-off memory and the engine has checked the weights
    (engine.wake_kv_cache, after the flag)."""

    def __init__(self, run_dir, engine, llm, where, check=lambda: None):
        self.llm, self.where, self.check = llm, where, check
        self.path = handoff.transfer_socket(run_dir, engine)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.path))
        self.listener.listen(1)
        self.conn, self.updating, self.seconds, self.received = None, False, 0.0, 0

    def poll(self, timeout_s=0.0):
        """Answer what has arrived, waiting up to timeout_s for it (the engine's wait between its checks: a call is
        answered as it arrives, not at the next check)."""
        if self.conn is None:
            if not select.select([self.listener], [], [], timeout_s)[0]:
                return
            sock, _ = self.listener.accept()
            self.conn = Connection(sock.detach())
        while self.conn.poll(1.0 if self.updating else timeout_s) or self.updating:
            if not self.conn.poll(0):
                self.check()
                continue
            try:
                method, payload = self.conn.recv()
            except (EOFError, ConnectionError):       # the trainer closed its end: its run is over, or it died
                self.conn.close()
                self.conn = None
                if self.updating:
                    raise SystemExit(f"{self.where}: the trainer's end of the weight hand-off closed during an update; "
                                     f"its weights are partly written: stopping")
                return
            self._serve(method, payload)

    def _serve(self, method, payload):
        t0 = time.perf_counter()
        try:
            if method == "start_weight_update":
                self.seconds, self.received = 0.0, 0
                if self.llm.llm_engine.is_sleeping():
                    self.llm.wake_up(tags=["weights"])
                self.llm.start_weight_update()
                self.updating = True
            elif method == "update_weights":
                self.llm.update_weights({"update_info": payload})
                self.received += sum(payload.get("tensor_sizes") or [])
            elif method == "finish_weight_update":
                self.llm.finish_weight_update()
                self.updating = False
            elif method == "init_weight_transfer_engine":
                self.llm.init_weight_transfer_engine({"init_info": payload})
            else:
                raise ValueError(f"unknown call {method!r}")
        except Exception as e:
            said = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            self.conn.send(("error", said))
            raise SystemExit(f"{self.where}: the weight hand-off failed in {method} ({said}); its weights may be "
                             f"partly written: stopping") from e
        self.seconds += time.perf_counter() - t0
        self.conn.send(("ok", None))

    def close(self):
        if self.conn is not None:
            self.conn.close()
        self.listener.close()
        self.path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- the trainer's hand-off


class Sender:
    """The trainer's side for the whole run (every rank builds one): its vLLM trainer engine, built at the first
    hand-off (the engines answer between stages), and a send per stage that returns the engines' record."""

    def __init__(self, run_dir, n_engines, device, rank, ranks, check, buffer_bytes=0):
        self.run_dir, self.n_engines, self.device, self.rank, self.ranks = run_dir, n_engines, device, rank, ranks
        self.client = EngineClient(run_dir, n_engines, check)
        self.buffer_bytes, self.engine, self.source = buffer_bytes, None, None
        self.backend = backend(device.type)

    def buffer_size(self, model, dtype):
        largest = max(dtype.itemsize * int(torch.Size(shape).numel()) for _, shape in checkpoint.policy_shapes(model))
        return max(self.buffer_bytes or MIN_BUFFER_BYTES, largest)

    def send(self, model, dtype):
        """Hand the model over, then return the CUDA cache's blocks of the gathers and the buffer (before the engines
        wake their KV cache) on every rank; returns (engine_weights record, fingerprint, seconds, bytes) on rank 0,
        Nones elsewhere."""
        t0 = time.perf_counter()
        # refused before any engine receives a byte (the engines load each chunk as it arrives); the pass below
        # checks again what it sends, in the engines' dtype
        if bad := checkpoint.nonfinite_parameters(model):
            raise SystemExit(f"refusing to hand over non-finite weights ({bad[:3]}...): no engine has received them")
        if self.engine is None:
            self.source = PolicySource(model, dtype, record=self.rank == 0)
            size = self.buffer_size(model, dtype)
            if self.backend == "ipc":
                # vLLM's IPC types: only a sender needs them
                from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
                info = IPCTrainerInitInfo(rank=self.rank, packed=True, packed_buffer_size_bytes=size)
            else:
                buffers = [str(handoff.transfer_buffer(self.run_dir, r)) for r in range(self.ranks)]
                info = ShmTrainerInitInfo(rank=self.rank, buffers=buffers, buffer_bytes=size)
            self.engine = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self.source)
        self.engine.send_weights()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        M.barrier()
        if self.rank != 0:
            return None, None, time.perf_counter() - t0, None
        record, fingerprint = self.source.engine_weights()
        sent = sum(int(torch.Size(m.shape).numel()) * dtype.itemsize for m in self.source.metadata())
        return record, fingerprint, time.perf_counter() - t0, sent

    def close(self):
        if self.engine is not None:
            self.engine.shutdown()
        self.client.close()
        handoff.transfer_buffer(self.run_dir, self.rank).unlink(missing_ok=True)
