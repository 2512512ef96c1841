"""Who am I in the job, and the process group's life cycle — the one place dsclip reads launcher env.

One module per concern; import from the one that owns what you need. This package re-exports nothing on
purpose: a monkeypatch on a re-export would silently miss the module whose code reads the name, while one
on this package fails at once (no such attribute).

``discovery``      rank, world size and rendezvous address from the deepspeed / torchrun / SLURM
                   environment (:func:`~.discovery.discover_world`), SLURM hostlists, ports,
                   :func:`~.discovery.export_env` for torch.distributed / DeepSpeed
``devices``        which GPU a rank binds, valid in its own ``CUDA_VISIBLE_DEVICES`` view
``cores``          CPU affinity, intra-op threads shared by the ranks of a host, ``--workers`` check
``process_group``  :func:`~.process_group.init_distributed` / :func:`~.process_group.shutdown`, the
                   timeout, the exit hook and barrier, recognising a lost peer
``stop``           SIGUSR1 / SIGTERM stop requests, the flags every rank sums, the exit codes
``watchdog``       a hung rank: the step-time watchdog thread, the ranks' signs of life in the store, torch's
                   flight-recorder variables (the policy: dsclip.train.hang)

``discovery``, ``devices`` and ``watchdog`` import no torch at import; ``cores``, ``process_group`` and ``stop`` do.
"""
