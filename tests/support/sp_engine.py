"""What makes a sequence-parallel rank one of the one engine's (h3_core/sequence_parallel_workers.py), read from /proc
(Linux): forked by the pool's launcher, which imported torch and diffusers before it forked, and never exec'd (its
command line is the launcher's, so no interpreter was started for it and it imported nothing again)."""

from __future__ import annotations

from pathlib import Path

WORKER_MODULE = b"h3_core.sequence_parallel_workers"


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def cmdline(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")


def comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def assert_forked_from_a_warm_launcher(pool) -> None:
    """Every rank of `pool` (a started WorkerPool) is a child of its one launcher, with the launcher's command line
    (forked, not started), named after its rank; the launcher is `python -m h3_core.sequence_parallel_workers --ranks
    N` and preloaded torch and the DiT's diffusers modules before forking."""
    launcher = pool.launcher.pid
    argv = cmdline(launcher)
    assert WORKER_MODULE in argv and b"--ranks" in argv, argv
    assert argv[argv.index(b"--ranks") + 1] == str(pool.layout.degree).encode()
    assert comm(launcher) == "h3-sp-launcher"
    preloaded = set(pool.launcher.preloaded)
    assert {"torch.distributed", "h3_core.diffusion", "diffusers.models.transformers.transformer_minimax_h3"} <= \
        preloaded, preloaded
    assert len(pool.pids) == pool.layout.degree and len(set(pool.pids)) == pool.layout.degree
    for rank, pid in enumerate(pool.pids):
        assert parent_of(pid) == launcher, f"rank {rank} (pid {pid}) was not forked by the launcher {launcher}"
        assert cmdline(pid) == argv, f"rank {rank} (pid {pid}) exec'd an interpreter of its own: {cmdline(pid)}"
        assert comm(pid) == f"h3-sp-rank{rank}"
