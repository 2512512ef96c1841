"""Rehearse rank 0 of a world-N job on this machine: ``dsclip plan ... --measure``.

The child process builds the model, the DeepSpeed engine and the gradient-cache step exactly as
``dsclip train`` does (dsclip.train.build, dsclip.engine.build) under torch's fake process group
(dsclip.engine.fake_world), runs a few steps on synthetic batches and reports, as one JSON line:
peak memory, host time per step, the bytes and calls of every collective (dsclip.rehearsal.counter), and the
optimizer's partition. Collectives move no data, so losses are meaningless; the collective counter writes
each rank's own shard where its peers' would land so every tensor stays finite, and a step DeepSpeed
skipped (overflow) is never timed.

One fake world per process (DeepSpeed keeps its groups in module globals), so the parent spawns a child
per rehearsal. The child runs in a temporary folder that is removed afterwards: no run folder, no
checkpoint, nothing left behind.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsclip.losses.config import TRAIN_TILE_SIZE
from dsclip.plan.job import Job

CPU_PEAK_KIND = "CPU tensor storage alive at once in a steady step, model states included (LiveTensorBytes)"

RESULT_TAG = "DSCLIP_REHEARSAL "  # the child's result line on stdout
ERROR_TAG = "dsclip plan --measure: "  # the child's one-line error on stderr


class RehearsalError(RuntimeError):
    """A one-line reason the rehearsal could not run or finish."""


@dataclass
class RehearsalSpec:
    """Rank 0 of a job, as the child process reads it (JSON): the job's chosen configuration (``from_job``,
    and back with ``job``) and the rehearsal's own settings (node size, patches, steps, device, seed)."""

    model: str
    world: int
    batch_size: int  # micro-batch per rank
    accum_freq: int = 1
    ds_config: dict = field(default_factory=dict)  # the plan's DeepSpeed JSON ("auto" values allowed)
    precision: str = "bf16"
    grad_checkpointing: bool = False
    gpus_per_node: int = 8
    engine_patches: str = "all"
    steps: int = 3  # timed steps (after one warm-up step, and on CPU one memory step: _timed_steps)
    device: str = "cpu"  # "cpu" or "cuda": where this rank runs
    seed: int = 0
    grad_reduction: str = "auto"  # --grad-reduction (dsclip/engine/grad_reduction.py)
    loss: str = "infonce"  # the loss the step trains with (dsclip.losses.config.LOSS_NAMES)
    loss_tile_size: int = TRAIN_TILE_SIZE
    patch_dropout: float = 0.0  # --force-patch-dropout (0: the architecture's own)
    image_size: int | None = None  # --force-image-size

    @classmethod
    def from_job(cls, job: Job, **rehearsal) -> RehearsalSpec:
        """Rank 0 of ``job``, every setting chosen (dsclip.plan.job.Job.chosen); ``rehearsal``: the other fields."""
        if job.micro_batch is None or job.ds_config is None:
            raise RehearsalError("nothing to rehearse: the job's micro-batch and DeepSpeed JSON are not chosen")
        return cls(
            model=job.model, world=job.gpus, batch_size=job.micro_batch, accum_freq=job.accum_freq or 1,
            ds_config=job.ds_config[1], precision=job.precision, grad_checkpointing=bool(job.grad_checkpointing),
            loss=job.loss or "infonce", loss_tile_size=job.tile, patch_dropout=job.patch_dropout,
            image_size=job.image_size, grad_reduction=job.grad_reduction, **rehearsal,
        )  # fmt: skip

    def job(self) -> Job:
        """The job this rank belongs to (its DeepSpeed JSON named as the rehearsal writes it)."""
        return Job(
            model=self.model, gpus=self.world, batch_size=self.batch_size * self.accum_freq * self.world,
            micro_batch=self.batch_size, precision=self.precision, ds_config=("rehearsal", self.ds_config),
            loss=self.loss, tile=self.loss_tile_size, grad_checkpointing=self.grad_checkpointing,
            patch_dropout=self.patch_dropout, image_size=self.image_size, grad_reduction=self.grad_reduction,
        )  # fmt: skip


@dataclass
class RehearsalResult:
    spec: dict
    params: int
    step_s: list  # host wall time of each timed, applied step
    skipped: int  # steps DeepSpeed (or the non-finite check) skipped: not timed
    peak_bytes: int
    peak_kind: str  # what peak_bytes measures
    optimizer_numel: int  # fp32 master partition elements on this rank
    optimizer_bytes: int  # master partition + Adam state on this rank
    traffic: list  # [kind, group size, phase, calls, bytes] per step
    loss_finite: bool
    comm_s: list = field(default_factory=list)  # wall time inside collective calls per timed step (real groups)
    cpu_s: list = field(default_factory=list)  # this process's CPU time per timed step (all its threads)
    thread_s: list = field(default_factory=list)  # the main thread's own CPU time per timed step
    comm_cpu_s: list = field(default_factory=list)  # process CPU inside collective calls / waits per timed step
    comm_thread_s: list = field(default_factory=list)  # main-thread CPU inside the same intervals per timed step
    grad_reduction: str = ""  # the reduction the step ran (sharded | coalesced | boundary)
    grad_bytes: int = 0  # the most gradient storage held at once (probe_gradients), beside the plan's grads line


# ---------------------------------------------------------------------------------------------------
# checks the parent makes before spawning anything
def check_fake_group() -> None:
    """torch's fake process group must exist, or nothing can stand in for the peers."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    except ImportError as e:
        raise RehearsalError(
            f"this torch has no fake process group ({e}); --measure needs torch >= 2.1 (torch.testing's fake_pg)"
        ) from None


def smallest_group_numel(model: str) -> int:
    """Elements of the smaller of the two optimizer parameter groups (decayed / not), from a meta-device model."""
    from dsclip.engine.optim import param_groups
    from dsclip.model import create_model
    from dsclip.model.factory import get_model_config

    m = create_model(get_model_config(model), device="meta")
    return min(sum(p.numel() for p in g["params"]) for g in param_groups(m, 0.1) if g["params"])


def check_world(model: str, world: int, gpus_per_node: int) -> None:
    """A world the model can be partitioned for: ZeRO gives every rank a 1/N slice of each parameter group's
    flat buffer, so every group needs at least one element per rank (a rank holding only padding has an
    empty optimizer partition, which DeepSpeed does not support), and whole nodes above one node."""
    if world < 1:
        raise RehearsalError(f"--gpus {world}: a world needs at least one rank")
    if world > gpus_per_node and world % gpus_per_node:
        raise RehearsalError(f"--gpus {world} does not fill whole nodes of --gpus-per-node {gpus_per_node}")
    smallest = smallest_group_numel(model)
    if world > smallest:
        raise RehearsalError(
            f"--gpus {world}: {model}'s smallest parameter group has {smallest} elements, fewer than one per "
            f"rank, so ZeRO cannot partition it; rehearse at most {smallest} ranks"
        )


# ---------------------------------------------------------------------------------------------------
# the parent
def rehearse(spec: RehearsalSpec, timeout_s: float = 1800.0) -> RehearsalResult:
    """Run ``spec`` in a child process under a fake world; its result, or a RehearsalError (one line)."""
    return rehearse_many([spec], timeout_s)[0]


def rehearse_many(specs: list[RehearsalSpec], timeout_s: float = 1800.0) -> list[RehearsalResult]:
    """Several specs of one world size in one child process (one fake world, one engine after another)."""
    if len({(s.world, s.gpus_per_node, s.device) for s in specs}) != 1:
        raise RehearsalError("one child rehearses one world: give specs of one world size, node size and device")
    check_fake_group()
    for model in {s.model for s in specs}:
        check_world(model, specs[0].world, specs[0].gpus_per_node)
    proc = start_child(specs)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RehearsalError(f"the rehearsal took over {timeout_s:.0f} s; lower --measure-steps") from None
    finally:
        proc.tmp.cleanup()
    return read_child(proc.returncode, out, err)


def start_child(specs: list[RehearsalSpec]) -> subprocess.Popen:
    """The child process, started (callers may run something else meanwhile); ``.tmp`` is its folder."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # the child is its own (fake) world, whatever launched the parent
    tmp = tempfile.TemporaryDirectory(prefix="dsclip-rehearsal-")
    env["TMPDIR"] = tmp.name  # whatever the child writes lands in the folder removed afterwards
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsclip.rehearsal.room", json.dumps([asdict(s) for s in specs])],
        cwd=tmp.name,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.tmp = tmp
    return proc


def read_child(returncode: int, out: str, err: str) -> list[RehearsalResult]:
    results = [
        RehearsalResult(**json.loads(ln[len(RESULT_TAG) :])) for ln in out.splitlines() if ln.startswith(RESULT_TAG)
    ]
    if returncode == 0 and results:
        return results
    errors = [ln for ln in err.splitlines() if ln.startswith(ERROR_TAG)]
    if errors:
        raise RehearsalError(errors[-1][len(ERROR_TAG) :])
    tail = (err.strip().splitlines() or ["(no output)"])[-1]
    raise RehearsalError(f"the rehearsal's process ended with code {returncode}: {tail}")


# ---------------------------------------------------------------------------------------------------
# the child
class _Tokens:
    """What the model factory reads from a tokenizer; the rehearsal feeds synthetic token ids."""

    def __init__(self, model_cfg: dict):
        text = model_cfg.get("text_cfg", {})
        self.vocab_size = int(text.get("vocab_size", 49408))
        self.context_length = int(text.get("context_length", 77))
        self.eos_id, self.pad_id = self.vocab_size - 1, 0


def _optimizer_partition(engine) -> tuple[int, int]:
    """(fp32 master elements, master + Adam state bytes) this rank holds. ZeRO-1/2: the inner torch
    optimizer's parameters are ZeRO's flat fp32 partitions; ZeRO-3 lends each sub-group's partition
    (``fp32_partitioned_groups_flat``) to the inner optimizer only during its step, so read them there."""
    zero = engine.optimizer
    inner = getattr(zero, "optimizer", zero)
    flats = getattr(zero, "fp32_partitioned_groups_flat", None)
    if flats is None:
        flats = [p for g in inner.param_groups for p in g["params"]]
    numel = nbytes = 0
    for p in flats:
        numel += p.numel()
        nbytes += p.numel() * p.element_size()
        for v in inner.state.get(p, {}).values():
            if hasattr(v, "numel") and v.dim() > 0:
                nbytes += v.numel() * v.element_size()
    return numel, nbytes


def probe_gradients(engine) -> list[int]:
    """Record, in the returned one-element list, the most gradient bytes the engine holds at once
    (dsclip.engine.accumulation.held_gradient_storages): after every backward, and across the coalesced block's
    flush the storages alive before it and after it together (the whole ``.grad`` and the partition the flush
    fills: what the plan's coalesced line counts). Instance attributes over the engine's methods."""
    from dsclip.engine.accumulation import held_gradient_storages

    peak = [0]
    backward = engine.backward

    def probed_backward(*args, **kwargs):
        out = backward(*args, **kwargs)
        peak[0] = max(peak[0], sum(held_gradient_storages(engine).values()))
        return out

    engine.backward = probed_backward
    if hasattr(engine, "coalesce_grad_reduction"):
        make = engine.coalesce_grad_reduction

        @contextlib.contextmanager
        def probed_block(*args, **kwargs):
            with make(*args, **kwargs) as inner:
                yield inner
                before = held_gradient_storages(engine)
            both = {**before, **held_gradient_storages(engine)}
            peak[0] = max(peak[0], sum(both.values()))

        engine.coalesce_grad_reduction = probed_block
    return peak


def _synthetic_batches(spec: RehearsalSpec, model_cfg: dict, tok: _Tokens, gen) -> list:
    import torch

    size = model_cfg["vision_cfg"]["image_size"]
    size = size if isinstance(size, int) else size[0]
    out = []
    for _ in range(spec.accum_freq):
        images = torch.randn(spec.batch_size, 3, size, size, generator=gen)
        tokens = torch.randint(1, tok.vocab_size - 1, (spec.batch_size, tok.context_length), generator=gen)
        tokens[:, -1] = tok.eos_id
        out.append((images, tokens))
    return out


def rehearse_in_world(spec: RehearsalSpec, counter) -> RehearsalResult:
    """Build ``spec``'s engine and step in the world that is up (fake or real) and run its steps, counting
    collectives with ``counter`` (installed before DeepSpeed's backend started)."""
    import torch

    from dsclip.engine.build import build_engine
    from dsclip.rehearsal.counter import track_phases
    from dsclip.rehearsal.live_bytes import LiveTensorBytes
    from dsclip.train.build import build_step, model_factory

    train, model_args, loss_args, optim_args, model_cfg, tok, ds_config = _run_settings(spec, counter)
    cuda = spec.device == "cuda"
    gen = torch.Generator().manual_seed(spec.seed + int(os.environ.get("RANK", "0")))
    micro = _synthetic_batches(spec, model_cfg, tok, gen)  # made before the count: a GPU rank's are on the host
    # CPU: the storages alive at once (the CPU's max_memory_allocated), counted over the build and the untimed steps
    live = None if cuda else LiveTensorBytes("cpu")
    tracked = live if live is not None else contextlib.nullcontext()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    phase = "building the engine (model states)"
    try:
        with tracked:
            bundle = build_engine(
                ds_config, train, optim_args,
                model_factory(model_args, loss_args, model_cfg, tok, seed=spec.seed),
                grad_checkpointing=spec.grad_checkpointing, total_steps=spec.steps + 2,
                steps_per_epoch=spec.steps + 2,
            )  # fmt: skip
            step = build_step(bundle, loss_args, train)
        track_phases(bundle.engine, counter)
        held = probe_gradients(bundle.engine)
        params = sum(getattr(p, "ds_numel", p.numel()) for p in bundle.module.parameters())
        phase = f"a step of {spec.accum_freq} micro-batch(es) of {spec.batch_size} (activations, loss)"
        timed = _timed_steps(spec, step, micro, counter, cuda, live)
    except torch.OutOfMemoryError:
        raise RehearsalError(f"out of device memory while {phase}; lower --batch-size or add GPUs") from None
    peak = torch.cuda.max_memory_allocated() - base if cuda else live.peak
    numel, nbytes = _optimizer_partition(bundle.engine)
    reduction = step.reduction
    if hasattr(bundle.engine, "destroy"):
        bundle.engine.destroy()
    del bundle, step
    gc.collect()  # the next rehearsal in this process measures its own memory, not this engine's
    if cuda:
        torch.cuda.empty_cache()
    per_step = timed.traffic.scaled(max(1, len(timed.step_s)))
    traffic = [[*key, per_step.calls[key], per_step.bytes[key]] for key in sorted(per_step.calls)]
    return RehearsalResult(
        spec=asdict(spec),
        params=int(params),
        step_s=timed.step_s,
        skipped=timed.skipped,
        peak_bytes=int(max(0, peak)),
        peak_kind="CUDA max_memory_allocated over the build and steps" if cuda else CPU_PEAK_KIND,
        optimizer_numel=int(numel),
        optimizer_bytes=int(nbytes),
        traffic=traffic,
        loss_finite=timed.finite,
        comm_s=timed.comm_s,
        grad_reduction=reduction,
        grad_bytes=held[0],
        cpu_s=timed.cpu_s,
        thread_s=timed.thread_s,
        comm_cpu_s=timed.comm_cpu_s,
        comm_thread_s=timed.comm_thread_s,
    )


def _run_settings(spec: RehearsalSpec, counter):
    """The run config sections ``dsclip train`` would build for ``spec``'s job (its loss included), and its
    resolved DeepSpeed dict."""
    from dsclip.engine.optim import OptimArgs
    from dsclip.model.factory import get_model_config
    from dsclip.train.build import build_ds_config

    ds_path = Path(tempfile.mkdtemp(prefix="dsclip-rehearsal-ds-")) / "ds_config.json"
    ds_path.write_text(json.dumps(spec.ds_config))
    sections = spec.job().sections(
        deepspeed_config=str(ds_path), engine_patches=spec.engine_patches, seed=spec.seed, max_steps=spec.steps + 2
    )
    train, model_args, loss_args, optim_args = sections["train"], sections["model"], sections["loss"], OptimArgs()
    model_cfg = get_model_config(spec.model)
    if spec.image_size:  # as the planner's architecture (dsclip.plan.architecture.load_arch) and train's
        model_cfg.setdefault("vision_cfg", {})["image_size"] = int(spec.image_size)
    counter.recording = False
    try:
        ds_config = build_ds_config(train, optim_args, spec.world)
    finally:  # nothing of the rehearsal is left behind
        ds_path.unlink()
        ds_path.parent.rmdir()
    return train, model_args, loss_args, optim_args, model_cfg, _Tokens(model_cfg), ds_config


@dataclass
class _Timings:
    step_s: list = field(default_factory=list)  # wall seconds per timed step
    cpu_s: list = field(default_factory=list)  # process CPU
    thread_s: list = field(default_factory=list)  # the stepping thread's CPU
    comm_s: list = field(default_factory=list)  # inside collectives: wall, process CPU, thread CPU
    comm_cpu_s: list = field(default_factory=list)
    comm_thread_s: list = field(default_factory=list)
    skipped: int = 0
    finite: bool = True
    traffic: object = None


def _timed_steps(spec: RehearsalSpec, step, micro, counter, cuda: bool, live=None) -> _Timings:
    """One warm-up step (ZeRO-3 traces its prefetch order), then ``spec.steps`` timed ones; a step DeepSpeed
    skipped (overflow / non-finite) is counted and never timed: a real run would not time it either.

    ``live`` (a CPU rank's LiveTensorBytes): one more untimed step, the memory step, counted from its start. The
    optimizer makes its Adam states in the first step (torch's lazy state, and ZeRO's inner optimizer is torch's),
    so only the second step's peak is a steady step's; the timed steps after it run without the count's dispatch."""
    import torch

    from dsclip.plan.comm import Traffic
    from dsclip.rehearsal.counter import clocks

    untimed = 1 if live is None else 2
    out = _Timings(traffic=Traffic())
    for i in range(spec.steps + untimed):
        counter.reset()
        counter.recording = i >= untimed
        counting = live is not None and i < untimed
        if counting and i == untimed - 1:
            live.reset_peak()  # the steady step's peak: the states alive before it and what the step adds
        t0, c0, h0 = clocks()
        with live if counting else contextlib.nullcontext():
            res = step(micro)
        if cuda:
            torch.cuda.synchronize()
        t1, c1, h1 = clocks()
        counter.recording = False
        out.finite &= bool(torch.isfinite(torch.tensor(res.loss)))
        if not res.applied:
            out.skipped += 1
            continue
        if i >= untimed:
            out.step_s.append(t1 - t0)
            out.cpu_s.append(c1 - c0)
            out.thread_s.append(h1 - h0)
            out.comm_s.append(counter.seconds)
            out.comm_cpu_s.append(counter.cpu_seconds)
            out.comm_thread_s.append(counter.thread_seconds)
            out.traffic.merge(counter.traffic)
    return out


def run_child(specs: list[RehearsalSpec]) -> list[RehearsalResult]:
    """Every spec (same world) in this process's one fake world."""
    from dsclip.engine.fake_world import fake_world
    from dsclip.rehearsal.counter import CollectiveCounter

    # installed before the fake world: DeepSpeed's backend keeps references to the collectives it finds then
    with CollectiveCounter(fill_outputs=True) as counter, fake_world(specs[0].world, specs[0].gpus_per_node):
        return [rehearse_in_world(spec, counter) for spec in specs]


def run_real_rank(rank: int, world_size: int, specs: list[dict]) -> list[dict]:
    """One rank of a real (gloo) world already joined by the caller (tests/distutil.run_world): the same
    rehearsal, counted the same way, nothing filled in. For validating the fake rank against a real one."""
    import deepspeed

    from dsclip.rehearsal.counter import CollectiveCounter

    with CollectiveCounter(fill_outputs=False) as counter:
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        return [asdict(rehearse_in_world(RehearsalSpec(**s), counter)) for s in specs]


def _child_main(argv: list[str]) -> int:
    raw = json.loads(argv[0])
    specs = [RehearsalSpec(**s) for s in (raw if isinstance(raw, list) else [raw])]
    if specs[0].device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        results = run_child(specs)
    except Exception as e:  # one line for the parent; the traceback only under DSCLIP_DEBUG
        if os.environ.get("DSCLIP_DEBUG"):
            raise
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(
            f"{ERROR_TAG}{type(e).__name__ + ': ' if not isinstance(e, RehearsalError) else ''}{msg}", file=sys.stderr
        )
        return 2
    for result in results:
        print(RESULT_TAG + json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
