"""model.py, in process: what the resident trainer keeps while the engine is awake, and the message of a process
group that cannot start."""
import torch

import model as M


def test_released_gradients_are_gone_not_zeroed():
    # the resident trainer frees its fp32 gradients before the engine wakes; zero_grad() without set_to_none would
    # keep 4 bytes per parameter allocated
    net = torch.nn.Linear(16, 8)
    optimizer = torch.optim.AdamW(net.parameters())
    net(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    assert sum(p.grad.numel() for p in net.parameters()) == 16 * 8 + 8
    assert M.release_gradients(optimizer) == 0
    assert all(p.grad is None for p in net.parameters())
    assert len(optimizer.state) == 2                            # AdamW's moments stay: they are the resident state


def test_a_process_group_that_cannot_start_names_shm_and_docker():
    error = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1234, unhandled system error\nlast error: shm")
    message = M.process_group_hint("nccl", error, 64 * 2**20)
    assert "\n" not in message
    assert message.startswith("the nccl process group could not start (RuntimeError: NCCL error in: "
                              "ProcessGroupNCCL.cpp:1234, unhandled system error)")
    assert "/dev/shm has 64 MiB free" in message and "--ipc=host" in message and "--shm-size" in message
    assert "no /dev/shm" in M.process_group_hint("nccl", error, None)
