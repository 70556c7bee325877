"""Sequence-parallel DiT: one H3 job's denoising loop on N ranks, with diffusers' context-parallel plan.

Each rank holds the whole DiT (weights replicated) and runs the same flow-matching loop on the same inputs; inside
every DiT forward the packed sequence is split across the ranks at the first block and gathered back at the output
heads (`MiniMaxH3Transformer3DModel._cp_plan`), and attention exchanges heads for sequence (Ulysses all-to-all), so
each rank holds 1/N of the activations. Every rank ends the loop with the same full latents; only rank 0 decodes and
writes. diffusers does the splitting (`ModelMixin.enable_parallelism(ContextParallelConfig(...))`); this module sets
up the process group, checks what the user asked for, applies the plan to a DiT (dense, quantised `QuantLinear`,
pruned curve model, block-streamed: the plan hooks sit on the blocks' inputs and outputs, whatever the layers
inside). The ranks of `generate --sp N` and of the Sampler's `gpus` are started by one engine,
sequence_parallel_workers.py (a warm launcher forks them); `launch` below is left for bench/gpu_check.py only.

* **Any sequence length.** H3's packed sequence (video + audio + text rows, plus condition rows for fl2va / ref2va)
  is rarely a multiple of N, so Ulysses always runs in diffusers' `ulysses_anything` mode (shards of unequal length).
* **Process group.** NCCL for CUDA tensors, gloo for CPU ones (`cpu:gloo,cuda:nccl` on CUDA: diffusers gathers the
  shard lengths on the CPU). On a CPU machine N gloo ranks run the very code path NCCL takes on CUDA; the two
  places diffusers' CPU path fails are shimmed in `diffusers_adapter.py`. Every socket the group opens listens on
  loopback: rank 0's rendezvous store on a socket bound here (torch's tcp:// rendezvous would listen on every
  interface, unauthenticated), gloo's and NCCL's on the loopback interface unless `H3_SP_INTERFACE` names another.
* **Ring attention** needs an attention backend that returns the log-sum-exp (cuDNN / flash), so it is CUDA only.
* **Devices.** Rank r runs on `cuda:(k + r)` for `--device cuda:k` (so the text encoder can keep `cuda:0` and the
  DiT take the GPUs after it); on the CPU every rank computes on the CPU.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch

MODES = ("ulysses", "ring")


class SequenceParallelError(ValueError):
    """A sequence-parallel request this machine or this DiT cannot run (too many ranks, heads not divisible...)."""


@dataclass(frozen=True)
class Layout:
    """What a sequence-parallel run is: N ranks, the attention exchange, the device of each rank."""

    degree: int
    mode: str = "ulysses"
    base_device: torch.device = torch.device("cpu")

    def device_of(self, rank: int) -> torch.device:
        if self.base_device.type == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", (self.base_device.index or 0) + rank)

    @property
    def backend(self) -> str:
        return "cpu:gloo" if self.base_device.type == "cpu" else "cpu:gloo,cuda:nccl"


def check(degree: int, mode: str, device, heads: int | None = None, what: str = "--sp") -> Layout:
    """The layout of `degree` ranks from `device` on, or a `SequenceParallelError` naming the constraint (and the
    setting, `what`: the CLI's --sp, the Sampler's gpus)."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise SequenceParallelError(f"{what} must be an integer >= 1 (ranks), got {degree!r}")
    if mode not in MODES:
        raise SequenceParallelError(f"sequence-parallel mode must be one of {', '.join(MODES)}, got {mode!r}")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise SequenceParallelError(f"sequence parallelism runs on cpu or cuda devices, not {device}")
    if degree > 1 and device.type == "cuda":
        first = device.index or 0
        count = torch.cuda.device_count()
        if first + degree > count:
            raise SequenceParallelError(
                f"{what} {degree} from cuda:{first} needs cuda:{first}..cuda:{first + degree - 1}, but torch sees "
                f"{count} CUDA device(s); lower {what} or pick an earlier device"
            )
    if degree > 1 and mode == "ring" and device.type != "cuda":
        raise SequenceParallelError(
            "ring attention needs an attention backend that returns the log-sum-exp (cuDNN or flash), which exists "
            "only on CUDA; use --sp-mode ulysses on the CPU"
        )
    if degree > 1 and heads is not None and heads % degree:
        raise SequenceParallelError(
            f"{what} {degree}: the DiT's {heads} attention heads do not divide into {degree} ranks "
            f"(Ulysses gives each rank heads / N); use a divisor of {heads}"
        )
    return Layout(degree=degree, mode=mode, base_device=device)


def dit_heads(path) -> int:
    """The attention heads of the DiT at `path` (a file or diffusers folder), from its header and config only."""
    from .weights import components, detect

    return int(components.resolve_config(detect(os.fspath(path)))["num_attention_heads"])


# --- inside a rank -------------------------------------------------------------------------------------------------


LOOPBACK = "127.0.0.1"
#: The network interface the ranks' gloo and NCCL sockets use: loopback unless the operator names one here. Every
#: rank of this pack runs on one machine, so nothing needs another interface; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
#: inherited from the environment (often set machine-wide in images) are replaced, not taken as that choice.
INTERFACE_ENV = "H3_SP_INTERFACE"


def free_port() -> int:
    """A loopback TCP port free right now, for the ranks' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def loopback_interface() -> str:
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), "lo")


def interface_env(environ) -> dict[str, str]:
    """The variables that bind gloo's and NCCL's own listening sockets (one per rank, for the pairs / bootstrap) to
    the interface of `INTERFACE_ENV`, loopback by default."""
    chosen = environ.get(INTERFACE_ENV, "").strip()
    name = chosen or loopback_interface()
    # NCCL matches interface names by prefix unless told "=": "lo" must not also match some "lo..." interface.
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": chosen or f"={name}"}


def rendezvous_store(rank: int, world_size: int, port: int, timeout):
    """The ranks' TCPStore on loopback `port`. torch's own rendezvous (init_method tcp://) makes rank 0's store
    listen on every interface, unauthenticated, for the process group's life; here rank 0 binds the listening socket
    to loopback itself and hands it to the store (`master_listen_fd`)."""
    from torch.distributed import TCPStore

    if rank != 0:
        return TCPStore(LOOPBACK, port, world_size, False, timeout=timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((LOOPBACK, port))
        listener.listen(max(64, world_size))
    except OSError:
        listener.close()
        raise
    # The store owns the descriptor from here on (the Python object must not close it when collected).
    return TCPStore(LOOPBACK, port, world_size, True, timeout=timeout,
                    master_listen_fd=listener.detach())


def init_rank(layout: Layout, rank: int, port: int, timeout_s: float = 600.0) -> torch.device:
    """Join the process group of `layout` as `rank` (rendezvous on loopback `port`); returns the rank's device.
    Every socket the group opens listens on loopback (`rendezvous_store`, `interface_env`)."""
    import datetime

    import torch.distributed as dist

    device = layout.device_of(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.update(interface_env(os.environ))  # read by gloo and NCCL when the group creates their devices
    timeout = datetime.timedelta(seconds=timeout_s)
    store = rendezvous_store(rank, layout.degree, port, timeout)
    dist.init_process_group(layout.backend, store=store, rank=rank, world_size=layout.degree, timeout=timeout)
    return device


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    """This process's rank (0 outside a process group)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def parallelize(transformer: torch.nn.Module, layout: Layout) -> torch.nn.Module:
    """Apply diffusers' context-parallel plan of `transformer` for `layout` (in place; once per module).

    Must run inside an initialised process group of `layout.degree` ranks, after the module is placed (resident or
    block-streamed). A module already parallelised for the same degree is returned as is."""
    from diffusers import ContextParallelConfig

    from . import diffusers_adapter

    current = diffusers_adapter.parallel_config(transformer)
    if current is not None:
        cp = current.context_parallel_config
        if cp is None or cp.ulysses_degree * cp.ring_degree != layout.degree:
            raise SequenceParallelError("this DiT is already parallelised for another layout; load it again")
        return transformer
    heads = getattr(getattr(transformer, "config", None), "num_attention_heads", None)
    check(layout.degree, layout.mode, layout.base_device, heads)
    if not diffusers_adapter.has_context_parallel_plan(transformer):
        raise SequenceParallelError(f"{type(transformer).__name__} has no context-parallel plan")
    if layout.mode == "ring":
        transformer.set_attention_backend("_native_cudnn")  # returns the log-sum-exp the ring merge needs
        config = ContextParallelConfig(ring_degree=layout.degree, ring_anything=True)
    else:
        config = ContextParallelConfig(ulysses_degree=layout.degree, ulysses_anything=True)
    diffusers_adapter.install_uneven_gather_for_gloo()
    with diffusers_adapter.cpu_accelerator_count():
        transformer.enable_parallelism(config=config)
    return transformer


# --- bench/gpu_check.py's ranks (generate --sp and the Sampler use sequence_parallel_workers.WorkerPool) -----------


# What a rank imports before it runs: loaded once in the fork server, so N ranks do not each spend the seconds of CPU
# that importing torch, diffusers and the pack costs (the pack's lazy imports of diffusers, named here).
RANK_PRELOAD = ("__main__", "h3_core.cli", "h3_core.diffusion", "diffusers.modular_pipelines.minimax_h3",
                "diffusers.models.transformers.transformer_minimax_h3", "diffusers.models.autoencoders")


def launch(worker, layout: Layout, *args) -> None:
    """Run `worker(rank, layout, port, *args)` in `layout.degree` fresh processes and wait for all; a rank that
    raises or dies ends the others and raises here with its last line. Used by bench/gpu_check.py's scaling check
    only: `generate --sp N` and the Sampler's `gpus` run on sequence_parallel_workers.WorkerPool.

    The ranks are forked from a fork server (torch.multiprocessing, `forkserver`): a clean process started for this
    run that imports `RANK_PRELOAD` (and the worker's module) once and touches no device, so every rank starts
    with the libraries loaded and CUDA uninitialised, as a spawned one would, without importing them again.
    Only the parsed command-line values in `args` cross to the workers; tensors never travel between processes
    except through the process group's collectives."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(list(dict.fromkeys([*RANK_PRELOAD, worker.__module__])))
    port = free_port()
    try:
        mp.start_processes(worker, args=(layout, port, *args), nprocs=layout.degree, join=True,
                           start_method="forkserver")
    except mp.ProcessRaisedException as error:
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        raise RuntimeError(f"sequence-parallel rank {error.error_index} failed: {lines[-1]}") from None
    except mp.ProcessExitedException as error:
        raise RuntimeError(
            f"sequence-parallel rank {error.error_index} died (exit code {error.exit_code}); "
            "the other ranks were stopped"
        ) from None


def worker_threads(layout: Layout) -> int:
    """Torch threads per rank on the CPU: H3_THREADS (the reproducibility setting) or the cores shared out."""
    if "H3_THREADS" in os.environ:
        return max(1, int(os.environ["H3_THREADS"]))
    return max(1, (os.cpu_count() or 1) // layout.degree)
