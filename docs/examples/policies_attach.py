"""The policies, switched on in attach: end the job on a hang (torchrun restarts it), and drain a node
whose rank stays a straggler.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node 2 --max-restarts 3 \\
        docs/examples/policies_attach.py
"""

# --8<-- [start:attach]
import json
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import stragglerwatch

dist.init_process_group("gloo")
model = DistributedDataParallel(torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def page_the_operator(verdict: dict) -> None:
    """Called once per episode on rank 0, on a thread of stragglerwatch's, with the verdict."""
    if verdict["exclude"]:  # a signal of its node explains it (a slower GPU clock, CPU contention, ...)
        print("drain", verdict["host"], [e["text"] for e in verdict["host_evidence"]])
    else:  # nothing of its node does: look at the rank's work, not at the node
        print("rank", verdict["rank"], verdict["cause"], verdict["not_excluded"], json.dumps(verdict["hints"]))


watch = stragglerwatch.attach(
    model,
    optimizer=optimizer,
    on_hang="abort",                              # a hang ends every rank with status 75 ...
    on_straggler=["exclude", page_the_operator],  # ... a lasting straggler's host goes into excluded-hosts.txt
)


def save_checkpoint(signum, frame):               # still runs when the hang policy ends the rank
    torch.save(model.module.state_dict(), "checkpoint.pt")
    sys.exit(0)                                   # the policy turns this 0 into 75: torchrun restarts


signal.signal(signal.SIGTERM, save_checkpoint)
# --8<-- [end:attach]

for _ in range(20):
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
watch.close()
assert watch.stats()["actions"] == {}             # a healthy job: no action
dist.destroy_process_group()
