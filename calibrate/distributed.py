"""Data-parallel calibration on ``torch.distributed``: which calibration sequences a process holds, and the
reductions that make every process compute what one process would.

A process of a run under ``torchrun --nproc-per-node N -m stiefkv calibrate …`` (or any launcher that sets
``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``) holds the calibration sequences ``rank, rank + N, …``: strided,
so that the first few sequences, which the profiles use, are spread over the processes too. Every quantity the
calibration needs from the sequences is a sum over them (second moments, squared errors and their
references, next-token KL and its token count, quantization noise, gradients), so each process sums over
its own sequences and an all-reduce adds the rest. Randomness (the refinement's minibatches and held-out
slice) is drawn over the global sequence indices with the same seed in every process, and each process
takes the drawn rows it holds. A single process goes through the same code with reductions that do
nothing, so one process and N processes differ only in the order floating-point sums are added.

The allocation is computed once, on rank 0, and broadcast; only rank 0 writes the progress file and the
checkpoint.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import signal
import sys
from dataclasses import dataclass

import torch

BACKENDS = {"cuda": "nccl", "cpu": "gloo"}
INIT_TIMEOUT = datetime.timedelta(minutes=30)  # a rank that never arrives ends the run instead of hanging


@dataclass(frozen=True)
class Shard:
    """This process's share of ``total`` calibration sequences: global rows ``rank, rank + world, …``."""

    rank: int = 0
    world: int = 1
    total: int = 0

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def held(self, n: int | None = None) -> int:
        """How many of the first ``n`` global sequences (default: all) this process holds."""
        n = self.total if n is None else n
        return len(range(self.rank, n, self.world))

    def local(self, rows: torch.Tensor) -> torch.Tensor:
        """The local indices of the global ``rows`` this process holds (repeats and order kept)."""
        mine = rows[rows % self.world == self.rank]
        return torch.div(mine - self.rank, self.world, rounding_mode="floor")

    def select(self, seqs: torch.Tensor) -> torch.Tensor:
        return seqs[self.rank::self.world]

    # --------------------------------------------------------------------------------------- reductions
    def sum(self, *values: float) -> tuple[float, ...]:
        """``values`` summed over all processes (float64)."""
        if not self.active:
            return tuple(float(v) for v in values)
        t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
        collective("a sum", torch.distributed.all_reduce, t)
        return tuple(t.tolist())

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over all processes, in place (moved to the backend's device and back)."""
        if not self.active:
            return tensor
        t = tensor.to(_comm_device())
        collective("a sum", torch.distributed.all_reduce, t)
        tensor.copy_(t)
        return tensor

    def sum_grads(self, params) -> None:
        """Add the parameters' gradients over all processes (a process with no rows adds zeros)."""
        if not self.active:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.sum_(p.grad)

    def broadcast(self, obj):
        """Rank 0's ``obj`` in every process (pickled)."""
        if not self.active:
            return obj
        box = [obj if self.leader else None]
        collective("rank 0's broadcast", torch.distributed.broadcast_object_list, box, src=0,
                   device=_comm_device())
        return box[0]

    def gather(self, obj) -> list:
        """Every process's ``obj``, in rank order."""
        if not self.active:
            return [obj]
        out = [None] * self.world
        collective("a gather", torch.distributed.all_gather_object, out, obj)
        return out


SINGLE = Shard()


class PeerLost(ConnectionError):
    """A collective failed in this process: another process of the run has most likely stopped (killed,
    out of memory, an error of its own), and the backend saw its connection close."""


def collective(what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, a collective; its failure (gloo: "Connection reset by peer", NCCL: a watchdog
    timeout …: a ``RuntimeError`` with a C++ source location and advice) as one :class:`PeerLost` line that
    names this rank, instead of the backend's traceback in every surviving process."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:
        text = " ".join(str(exc).split()) or type(exc).__name__
        text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # "[…/gloo/transport/tcp/pair.cc:537] Read error …"
        text = text.split(" This is typically caused by")[0]  # gloo's advice (and its emoji)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else "?"
        raise PeerLost(f"{what} across the processes failed on rank {rank} ({text}): another process of the "
                       "run has most likely stopped; its own message (above, or in the launcher's report) "
                       "says why") from exc


def _comm_device() -> torch.device:
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def launched() -> bool:
    """Whether a launcher (torchrun) started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def current(total: int) -> Shard:
    """The shard of ``total`` sequences of this process: the whole set unless a process group is up."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return Shard(0, 1, total)
    world = torch.distributed.get_world_size()
    if world > total:
        raise ValueError(f"{world} processes but only {total} calibration sequences: each process needs at "
                         f"least one; use --num-sequences {world} or more, or fewer processes")
    return Shard(torch.distributed.get_rank(), world, total)


def init_from_env(device: str) -> str:
    """Join the process group a launcher described (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
    …); returns the device this process calibrates on: ``cuda:LOCAL_RANK`` for ``cuda``, the CPU with gloo.

    Nothing happens without a launcher (one process) or when the group is already up.
    """
    if not launched() or torch.distributed.is_initialized():
        return device
    kind = torch.device(device).type
    if kind not in BACKENDS:
        raise ValueError(f"--device {device}: calibration across processes runs on cuda (NCCL) or cpu (gloo)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    rank = os.environ.get("RANK", "?")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device} on rank {rank}, which sees no GPU: give each process a GPU, "
                             "or calibrate with --device cpu")
        if local >= torch.cuda.device_count():
            gpus = torch.cuda.device_count()
            raise ValueError(f"rank {rank} has local rank {local} but its node has {gpus} GPU(s): start at "
                             "most that many processes per node")
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    torch.distributed.init_process_group(BACKENDS[kind], timeout=INIT_TIMEOUT)
    return device


def check_same(shard: Shard, what: str, value: dict) -> None:
    """Refuse a run whose processes disagree on ``value`` (settings, model, data), naming the first keys
    that differ and the ranks."""
    values = [_flat(v) for v in shard.gather(value)]
    for rank, other in enumerate(values):
        differ = sorted(k for k in set(values[0]) | set(other) if values[0].get(k) != other.get(k))
        if differ:
            first = values[0]
            shown = ", ".join(f"{k}={_short(first.get(k))} on rank 0, {_short(other.get(k))} on rank {rank}"
                              for k in differ[:3])
            raise ValueError(f"the processes were started with different {what}: {shown}; start every "
                             "process with the same command")


def _flat(value: dict) -> dict:
    """A dict's nested dicts as dotted keys (``model.kv_weights_dtype``): a difference is named by the entry
    that differs, not shown as the whole model fingerprint (kilobytes of weight samples) twice."""
    flat = {}
    for k, v in value.items():
        if isinstance(v, dict):
            flat |= {f"{k}.{sub}": w for sub, w in _flat(v).items()}
        else:
            flat[k] = v
    return flat


def _short(v, most: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= most else text[:most - 1] + "…"


def interrupt_on_stop() -> None:
    """In a launched process, SIGTERM (and SIGINT) raise ``KeyboardInterrupt`` once, then are ignored: the
    calibration stops as on Ctrl-C in one process, with its one-line message (on rank 0: where the progress
    is kept, and ``--resume``).

    On Ctrl-C torchrun's agent sends each process SIGINT and, a millisecond later, SIGTERM, whose default
    action killed rank 0 before it could say anything; a terminal's own SIGINT comes on top. The first of
    them interrupts, the others would interrupt the reporting of the first."""
    def stop(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def wait_for_all() -> None:
    """Return once every process is done with the collectives (a barrier). Call it only on success; after an
    error the process just exits (a barrier there would wait for processes the launcher is stopping)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        collective("the final barrier", torch.distributed.barrier)


def leave(code: int = 0) -> None:
    """End a process of a launched run once it has written all it had to: flush the output, exit with
    ``code``, and skip the interpreter's teardown. Does nothing outside a process group.

    A gloo process can abort in that teardown ("terminate called without an active exception", SIGABRT)
    although its work is done: on CI (torch 2.13) rank 1 of a 2-process calibration did, after a barrier and
    ``destroy_process_group``, so the launcher failed the run. The group's C++ worker threads can outlive
    ``destroy_process_group`` and be freed while the interpreter shuts down (pytorch/pytorch#179291).
    After :func:`wait_for_all` no collective is left for a destructor to finish; after an error the launcher
    stops the other processes anyway.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
