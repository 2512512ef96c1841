"""``dsclip <command>``: train, eval, convert, data, tokenizer, plan.

User mistakes (a missing recipe, an unknown flag or JSON key, batch sizes that don't multiply, an
unknown architecture, invalid JSON) end with one line naming the problem and exit code 2, not a
traceback. ``--debug`` (or DSCLIP_DEBUG=1) shows the traceback anyway.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from dsclip.config_base import ConfigError

USAGE = """usage: dsclip <command> [options]

commands:
  train       train a CLIP model (dsclip train --config RECIPE [--flag value ...]; --help for all flags)
  eval        zero-shot / retrieval evaluation of a checkpoint
  convert     ZeRO checkpoint -> single-file safetensors (or OpenCLIP layout)
  data        write webdataset shards / inspect them
  tokenizer   train a sentencepiece tokenizer
  plan        memory and throughput planner for large models
  launch      run a launcher so stop signals reach every rank: dsclip launch -- deepspeed ... --module dsclip train
"""

# command -> (module, function taking argv)
COMMANDS = {
    "train": ("dsclip.cli", "main_train"),
    "eval": ("dsclip.eval.cli", "main_eval"),
    "convert": ("dsclip.checkpoint.convert_cli", "main_convert"),
    "data": ("dsclip.data.cli", "main_data"),
    "tokenizer": ("dsclip.data.cli", "main_tokenizer"),
    "plan": ("dsclip.cli.plan", "main_plan"),
    "launch": ("dsclip.launch.supervise", "main"),
}


class UserError(Exception):
    """Raised for problems the user can fix; printed as one line."""


def _user_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConfigError, UserError, FileNotFoundError]
    # Launch problems (dsclip.engine.world.discovery, DeviceBindingError of .devices a subclass: bad launcher
    # env, a GPU view no rank can use, MASTER_PORT taken) and unknown architectures are one line too. Looked up
    # only where their module is loaded (an error of a module never imported was never raised): importing
    # them here would load the world package, and through it torch, at every exit, `--help` and a
    # misconfigured run's error included (issue #33).
    for module, name in (
        ("dsclip.engine.world.discovery", "WorldDiscoveryError"),
        ("dsclip.model.factory", "UnknownModelError"),
    ):
        if module in sys.modules:
            errors.append(getattr(sys.modules[module], name))
    return tuple(errors)


def main_train(argv: list[str]) -> int:
    # lazy, like COMMANDS: each command loads only its own stack (torch, deepspeed) when it runs
    from dsclip.train.goodput import process_start

    started = process_start()  # the run's goodput clock counts the start-up from here (dsclip.train.goodput)
    from dsclip import console
    from dsclip.config import parse_run_config
    from dsclip.train import preflight

    console.begin()  # this run's lines before its log file exists are kept for it (dsclip.console)
    cfg = parse_run_config(argv)
    # before the process group and before DeepSpeed loads: a misconfigured run fails in seconds
    cfg = preflight.check(cfg, rank=int(os.environ.get("RANK", "0")))
    from dsclip.train.loop import train  # loads DeepSpeed

    summary = train(cfg, started=started)
    if summary.get("zeroshot") and int(os.environ.get("RANK", "0")) == 0:
        from dsclip.console import say  # into RUN/out.log too

        say("final: " + json.dumps({"step": summary["step"], "zeroshot": summary["zeroshot"]}))
    from dsclip.launch.supervise import report_exit

    code = int(summary.get("exit_code", 0))
    report_exit(code)  # for `dsclip launch`, whose launcher may report a stopped rank as a failure
    return code


def venv_ninja_first(env=None) -> str | None:
    """Put the directory of this interpreter's ``ninja`` (the venv's, from the ``ninja`` wheel) first on PATH.

    Why: DeepSpeed JIT-builds its CPU ops with whichever ``ninja`` PATH names first, and ninja 1.11 (Debian's
    /usr/bin/ninja) and 1.13 (the wheel's) hash a command line differently in .ninja_log, so each sees the
    other's build as "command line changed" and rebuilds from scratch. ``make venv`` prebuilds the ops with
    the venv's ninja; a run started without the venv on PATH (``make demo``, ``.venv/bin/dsclip``) would
    otherwise rebuild them with the system's. Returns the directory put first, None when there is none."""
    env = os.environ if env is None else env
    bin_dir = os.path.dirname(sys.executable)
    if not os.access(os.path.join(bin_dir, "ninja"), os.X_OK):
        return None
    parts = env.get("PATH", "").split(os.pathsep)
    if parts[:1] != [bin_dir]:
        env["PATH"] = os.pathsep.join([bin_dir] + [p for p in parts if p and p != bin_dir])
    return bin_dir


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["launch"]:  # `dsclip launch` finds its launcher on the user's PATH; its ranks do this
        venv_ninja_first()  # before anything can load DeepSpeed (and JIT-build an op)
    # The deepspeed launcher puts --local_rank=N first when it runs `python -m dsclip`: drop it here.
    argv = [a for a in argv if not a.startswith("--local_rank=") and not a.startswith("--local-rank=")]
    if argv[:1] == ["--"]:  # `torchrun -m dsclip -- train ...` (docs/clusters.md): where argparse keeps the `--`
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"dsclip: unknown command '{command}'\n{USAGE}", file=sys.stderr)
        return 2
    module, fn = COMMANDS[command]
    # Under `dsclip launch` SIGTERM/SIGUSR1 arrive blocked (dsclip.launch.supervise blocks them in the launcher,
    # the mask is inherited): take them the ordinary way again, so that a rank still starting up (stuck in
    # the rendezvous, say) dies of them as it would without the supervisor; `train` then handles them.
    from dsclip.launch.supervise import release_stop_signals

    release_stop_signals()
    try:
        return int(getattr(importlib.import_module(module), fn)(rest) or 0)
    except _user_errors() as e:
        if os.environ.get("DSCLIP_DEBUG") or "--debug" in rest:  # OpenCLIP's --debug: the traceback too
            raise
        msg = str(e) if not isinstance(e, FileNotFoundError) or not e.filename else f"{e.strerror}: {e.filename}"
        print(f"dsclip {command}: error: {msg}", file=sys.stderr, flush=True)
        _mark_failed()
        return 2


def _mark_failed() -> None:
    # Other ranks may not reach the exit barrier after a user error on this one. Only a run that loaded
    # dsclip.engine.world.process_group can have a process group (and an exit barrier) to skip.
    process_group = sys.modules.get("dsclip.engine.world.process_group")
    if process_group is not None:
        process_group.mark_failed()


if __name__ == "__main__":
    sys.exit(main())
