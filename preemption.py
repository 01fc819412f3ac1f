"""A scheduler's pre-emption (SIGTERM, as SLURM sends it) or Ctrl-C (SIGINT): noted by every rank,
acted on after the same step by all (train.train_loop saves it, then stops), never mid-step."""

import signal
import time

import torch
import torch.distributed as dist


ONE_REQUEST_S = 1.0  # copies of one signal: SLURM signals every process, torchrun forwards its copy 0-14 ms later


def note_stop_signals() -> list[int]:
    """SIGTERM and SIGINT (a scheduler's pre-emption, Ctrl-C) are noted, for train_loop to stop
    after the step in progress. Those within ONE_REQUEST_S of the first are one request; a signal
    after that ends the process at once, as the default handler does."""
    received, first = [], None

    def note(signum, _frame):
        nonlocal first
        first = first or time.monotonic()
        if time.monotonic() - first > ONE_REQUEST_S:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        received.append(signum)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, note)
    return received


def agreed_signal(received: list[int], device: torch.device) -> int:
    """The largest signal number any rank received, 0 for none: the ranks, which a signal can
    reach at different moments, stop after the same step."""
    flag = torch.tensor(max(received, default=0), device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())
